"""Whatever a worker writes, its agent keeps reading it and the worker keeps running.

A line longer than the pipe reader's 64 KiB buffer (a ``\\r`` progress bar on stderr) killed
the task reading it: nothing drained the pipe, the worker blocked on its next write and
training stopped without a failure. A diverged run's NaN loss reached the agent's status,
which refuses non-finite numbers, and the status loop crashed until the agent exited. A
step line with a field of the wrong type ended the stdout reader the same way.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest
import structlog

from sailor.agent.supervisor import Supervisor
from sailor.schemas.runtime import AgentStatus
from tests.integration.test_worker_signals import PLAN, launch_of

_WORKER = """
import json, sys, time
bar = "\\r" + "=" * 1000
for _ in range(400):  # 400 kB on stderr without a newline: more than the pipe holds
    sys.stderr.write(bar)
sys.stderr.flush()
def say(**m):
    print(json.dumps(m), flush=True)
say(event="ready", rank=0)
say(event="step", rank=0, step=1, loss=float("nan"))
say(event="step", rank=0, step=None, loss=2.0)
print("x" * 200_000, flush=True)
say(event="step", rank=0, step=2, loss=float("inf"))
say(event="step", rank=0, step=3, loss=1.5)
sys.stderr.write("done\\n")
sys.stderr.flush()
time.sleep(60)
"""


async def test_long_lines_and_bad_fields_neither_stop_the_reader_nor_the_worker(
    tmp_path: Path,
) -> None:
    sup = Supervisor(tmp_path, worker_argv=(sys.executable, "-c", _WORKER))
    await sup.launch(launch_of(PLAN))
    try:
        async with asyncio.timeout(60):
            while sup.workers[0].step < 3:
                sup.changed.clear()
                await sup.changed.wait()
            while not any("done" in t for t in sup.workers[0].stderr_tail):
                await asyncio.sleep(0.05)  # the worker wrote on past its 400 kB line
        w = sup.workers[0]
        assert w.step == 3 and w.loss == 1.5 and w.exit_code is None
        assert sup.state == "running", sup.failure
        json.dumps(w.loss, allow_nan=False)  # what the status will carry
    finally:
        await sup.abort()


_HOSTILE_NUMBERS = """
import json, sys, time  # no braces: argv is formatted
def say(**m):
    print(json.dumps(m), flush=True)
t = dict(fwd_s=0.01, bwd_s=0.02, p2p_s=0.0, sync_s=0.0, optim_s=0.001, step_s=0.1,
         microbatches=2)
say(event="ready", rank=0)
for s in (1, 2, 3):
    say(event="step", rank=0, step=s, loss=1.0, **t)
print("[" * 5000, flush=True)  # nested past json's recursion limit
say(event="step", rank=0, step=-5, loss=1.0)
say(event="step", rank=0, step=float("inf"), loss=1.0)
say(event="saved", rank=0, step=-9)
say(event="step", rank=0, step=4, loss=1.0, **dict(t, fwd_s=float("inf")))
say(event="step", rank=0, step=5, loss=1.0, **dict(t, bwd_s=1e308, step_s=1e308))
say(event="step", rank=0, step=6, loss=1.0, **dict(t, microbatches=-3))
say(event="step", rank=0, step=7, loss=1.0, **dict(t, microbatches=10**400))
say(event="held", rank=0, step=-7)
say(event="step", rank=0, step=8, loss=1.0, **t)
sys.stderr.write("done\\n")
sys.stderr.flush()
time.sleep(60)
"""


async def test_hostile_numbers_in_progress_lines_are_refused_by_name(tmp_path: Path) -> None:
    """A line nested past json's recursion limit is skipped (it raised ``RecursionError``,
    which ended the stdout reader). Steps below -1, an infinite step, infinite, huge or
    negative timings: each line is
    refused with a log naming the field and its value, the reader goes on, and what the
    agent puts in its status still validates. Before, a step of -5 (or a saved step of -9,
    a held step of -7) reached the status record, which refuses it, and an infinite or
    overflowing timing made the rank's timing summary raise: the agent's status loop
    crashed until the agent exited; a step of ``Infinity`` ended the stdout reader."""
    sup = Supervisor(tmp_path, worker_argv=(sys.executable, "-c", _HOSTILE_NUMBERS))
    with structlog.testing.capture_logs() as logs:
        await sup.launch(launch_of(PLAN))
        try:
            async with asyncio.timeout(60):
                while sup.workers[0].step < 8:
                    sup.changed.clear()
                    await sup.changed.wait()
                while not any("done" in t for t in sup.workers[0].stderr_tail):
                    await asyncio.sleep(0.05)
            w = sup.workers[0]
            assert w.exit_code is None and sup.state == "running", sup.failure
            assert (sup.step, sup.saved_step, w.held, w.held_step) == (8, -1, False, -1)
            timings = sup.timings()
            assert [t.last_step for t in timings] == [8]
            # the status the agent writes from these (``Agent.status``) validates
            AgentStatus(
                node_id="n1",
                state="running",
                step=sup.step,
                saved_step=sup.saved_step,
                held_step=sup.held_step,
                loss=sup.loss,
                timings=timings,
            )
        finally:
            await sup.abort()
    errors = [str(e.get("error")) for e in logs if e.get("event") == "worker_line_malformed"]
    for named in (
        "step=-5",
        "step=inf",
        "step=-9",
        "fwd_s=inf",
        "bwd_s=1e+308",
        "microbatches=-3",
        "microbatches=1000",
        "step=-7",
    ):
        assert any(named in e for e in errors), (named, errors)


async def test_a_launch_that_fails_halfway_leaves_no_worker(tmp_path: Path) -> None:
    """Rank 1's control file cannot be written (a directory stands there, as a full disk
    would fail it): the launch raises, and rank 0, already started, is killed instead of
    running outside the supervisor's list (each retry of the command started another)."""
    sup = Supervisor(tmp_path, worker_argv=(sys.executable, "-c", "import time; time.sleep(60)"))
    two = PLAN.model_copy(update={"pipelines": PLAN.pipelines * 2, "global_batch_size": 4})
    cmd = launch_of(two).model_copy(update={"ranks": (0, 1), "world_size": 2})
    (tmp_path / "gen-00001" / "control-1.json").mkdir(parents=True)
    with pytest.raises(OSError):
        await sup.launch(cmd)
    assert sup.workers == []
    started = [p for p in _children() if "time.sleep(60)" in p]
    assert started == [], started


def _children() -> list[str]:
    """Command lines of this process's children."""
    import os

    me = str(os.getpid())
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text().rsplit(")", 1)[1].split()
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if stat[1] == me:
            out.append(cmd)
    return out


_SPARE = """
import json, sys, time
print(json.dumps(dict(event="warm", pid=0)), flush=True)  # no braces: argv is formatted
time.sleep(float(sys.argv[1]))
"""


async def test_a_spare_that_leaves_is_replaced_and_failing_ones_stop(tmp_path: Path) -> None:
    """A warm spare that exits (its directive never came) is replaced, so the node keeps
    its spare; spares that exit before they are warm stop being started after three in a
    row, and the agent then wants none (the controller stops waiting for them). Before, a
    spare that left was never replaced and the node reported 0 of 1 spares for good."""
    sup = Supervisor(tmp_path, worker_argv=(sys.executable, "-c", _SPARE, "0.3"), warm_spares=1)
    try:
        await sup.top_up_spares()
        first = sup.spares[0].proc.pid
        async with asyncio.timeout(30):
            while not any(w.proc.pid != first and w.warm for w in sup.spares):
                await asyncio.sleep(0.05)
        assert sup.spares_wanted == 1
    finally:
        await sup.close()

    broken = Supervisor(
        tmp_path / "b", worker_argv=(sys.executable, "-c", "raise SystemExit(3)"), warm_spares=1
    )
    try:
        await broken.top_up_spares()
        async with asyncio.timeout(30):
            while broken.spares_wanted:
                await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # no further spare is started
        assert all(w.exit_code is not None for w in broken.spares)
        assert broken.spares_ready == 0 and broken.spares_wanted == 0
    finally:
        await broken.close()


_CHATTY = """
import json, sys
print("host:1:1 [0] NCCL INFO Channel 00/02 : 0 1 via NET/Socket/0", flush=True)
for i in range(40):
    sys.stderr.write("warning line %d\\n" % i)  # no braces: argv is formatted
sys.stderr.flush()
print(json.dumps(dict(event="ready", rank=0)), flush=True)
raise SystemExit(0)
"""


async def test_a_workers_own_output_is_kept_in_its_logs(tmp_path: Path) -> None:
    """NCCL's diagnostics go to stdout and are not progress lines; an early traceback falls
    out of the 20 stderr lines kept for the failure record: both are in the rank's logs."""
    sup = Supervisor(tmp_path, worker_argv=(sys.executable, "-c", _CHATTY))
    await sup.launch(launch_of(PLAN))
    try:
        async with asyncio.timeout(60):
            while sup.workers[0].exit_code is None:
                sup.changed.clear()
                await sup.changed.wait()
        pid = sup.workers[0].proc.pid
        gen = next(tmp_path.glob("gen-*"))
        out = (gen / f"rank-0-{pid}.stdout.log").read_text()
        err = (gen / f"rank-0-{pid}.stderr.log").read_text()
        assert "NCCL INFO Channel 00/02" in out and '"event": "ready"' in out
        assert all(f"warning line {i}\n" in err for i in range(40))
        assert len(sup.workers[0].stderr_tail) == 20  # what the failure record keeps
    finally:
        await sup.abort()


_DATA_CHANGED = """
import json, sys, time
def say(**m):
    print(json.dumps(m), flush=True)
say(event="ready", rank=0, data_changed="data.seed: trained with seed=0, this run has seed=5")
say(event="step", rank=0, step=1, loss=1.0)
time.sleep(60)
"""


async def test_a_resume_on_other_data_is_in_the_agents_log(tmp_path: Path) -> None:
    """A worker that resumed a checkpoint trained on other data (the training config's
    ``allow_data_change``) says what changed in its ``ready`` line; the agent logs it
    (``worker_data_changed``), so the operator's override leaves a trace beside the job."""
    sup = Supervisor(tmp_path, worker_argv=(sys.executable, "-c", _DATA_CHANGED))
    with structlog.testing.capture_logs() as logs:
        await sup.launch(launch_of(PLAN))
        try:
            async with asyncio.timeout(60):
                while sup.workers[0].step < 1:
                    sup.changed.clear()
                    await sup.changed.wait()
        finally:
            await sup.abort()
    said = [e for e in logs if e.get("event") == "worker_data_changed"]
    assert len(said) == 1 and said[0]["rank"] == 0
    assert said[0]["changes"] == "data.seed: trained with seed=0, this run has seed=5"
