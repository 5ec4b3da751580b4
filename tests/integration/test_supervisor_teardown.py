"""Killed workers are gone before anything starts on their GPUs.

A worker runs in a process group of its own with whatever it started (data loader workers,
compile subprocesses). Before, the supervisor waited for the group leader alone, and only
``kill_grace_s`` after SIGKILL; a rank still in the GPU driver's teardown then (state ``D``,
after an NCCL hang or an XID error) held its GPU while the next generation started on it and
failed with out-of-memory or hung, and nothing said why. Now every process of the group must
be gone, within ``teardown_timeout_s`` after SIGKILL, before a rank or a spare starts; one
still there past it is the node's failure (retry false) and no rank starts on top of it.
Real worker processes throughout; only a process that outlives SIGKILL is simulated (the
probe's answer), as none can on this machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from sailor.agent.supervisor import Supervisor, WorkerTeardownError
from sailor.agent.teardown import GONE_STATES, group_members
from sailor.schemas.commands import Launch
from tests.integration.test_worker_signals import PLAN, launch_of

# A worker with a second member in its process group: a child that ignores SIGTERM (only the
# group's SIGKILL ends it). It names the child in {run_dir}/child.pid before "ready".
# No braces in these scripts: the supervisor formats the argv.
_WITH_STUBBORN_CHILD = """
import json, subprocess, sys, time
code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); " + (
    "print(1, flush=True); time.sleep(60)"
)
child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
child.stdout.readline()  # its handler is set
with open(sys.argv[1] + "/child.pid", "w") as f:
    f.write(str(child.pid))
print(json.dumps(dict(event="ready", rank=0)), flush=True)
time.sleep(60)
"""

_STUBBORN_ARGV = (sys.executable, "-c", _WITH_STUBBORN_CHILD, "{run_dir}")

# A worker whose child dies at SIGTERM as it does (a data loader worker, say).
_WITH_CHILD = """
import json, subprocess, sys, time
child = subprocess.Popen(["sleep", "60"])
with open(sys.argv[1] + "/child.pid", "w") as f:
    f.write(str(child.pid))
print(json.dumps(dict(event="ready", rank=0)), flush=True)
time.sleep(60)
"""

# Started next: appends the state of the process named in argv[1] ("gone" if none) to
# argv[2], as it finds it at its own start.
_CHECKER = """
import sys, time
pid = int(open(sys.argv[1]).read())
try:
    state = open("/proc/%d/stat" % pid).read().rsplit(")", 1)[1].split()[0]
except OSError:
    state = "gone"
with open(sys.argv[2], "a") as f:
    f.write(state + "\\n")
time.sleep(60)
"""


def _gen(n: int) -> Launch:
    return launch_of(PLAN).model_copy(update={"generation": n, "command_id": f"c{n}"})


async def _until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.02)


def _gone(state: str) -> bool:
    return state == "gone" or state in GONE_STATES


def _group_gone(pgid: int) -> bool:
    """No process of ``pgid`` holds anything (zombies aside: init reaps those, late here)."""
    members = group_members([pgid]).get(pgid, {})
    return all(s in GONE_STATES for s in members.values())


async def _started_with_child(sup: Supervisor, gen_dir: Path) -> tuple[int, int]:
    """The first generation's worker is ready: its pid and its child's."""
    await sup.launch(_gen(1))
    await _until(lambda: bool(sup.workers) and sup.workers[0].started)
    return sup.workers[0].proc.pid, int((gen_dir / "child.pid").read_text())


async def test_a_launch_starts_only_once_the_killed_workers_group_is_gone(
    tmp_path: Path,
) -> None:
    """The worker leaves at SIGTERM, its child does not: the abort SIGKILLs the group after
    the grace period and returns once both are gone; the next generation's worker finds the
    child gone. Before, the abort returned when the leader exited and the child lived on."""
    sup = Supervisor(tmp_path, worker_argv=_STUBBORN_ARGV)
    sup.kill_grace_s = 0.5
    child = -1
    try:
        leader, child = await _started_with_child(sup, tmp_path / "gen-00001")
        t0 = time.monotonic()
        await sup.abort()
        took = time.monotonic() - t0
        assert _group_gone(leader), group_members([leader])
        assert took >= sup.kill_grace_s  # the child needed the group's SIGKILL
        assert sup.failure == ""

        seen = tmp_path / "seen.txt"
        child_file = tmp_path / "gen-00001" / "child.pid"
        sup.worker_argv = (sys.executable, "-c", _CHECKER, str(child_file), str(seen))
        await sup.launch(_gen(2))
        await _until(seen.exists)
        states = seen.read_text().split()
        assert len(states) == 1 and _gone(states[0]), states
    finally:
        await sup.close()
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)  # the old code left it behind


async def test_a_spare_asked_for_during_an_abort_starts_after_the_teardown(
    tmp_path: Path,
) -> None:
    """A spare top-up (a spare that left, a generation that came up) runs beside an abort
    of the agent's command: it starts its spare only once the killed group is gone."""
    sup = Supervisor(tmp_path, worker_argv=_STUBBORN_ARGV)
    sup.kill_grace_s = 0.5
    child = -1
    try:
        leader, child = await _started_with_child(sup, tmp_path / "gen-00001")
        seen = tmp_path / "seen.txt"
        child_file = tmp_path / "gen-00001" / "child.pid"
        sup.worker_argv = (sys.executable, "-c", _CHECKER, str(child_file), str(seen))
        sup.warm_spares = 1
        await asyncio.gather(sup.abort(), sup.top_up_spares())
        assert len(sup.spares) == 1
        await _until(seen.exists)
        states = seen.read_text().split()
        assert len(states) == 1 and _gone(states[0]), states
        assert _group_gone(leader)
    finally:
        await sup.close()
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)


async def test_a_process_outliving_sigkill_past_the_bound_fails_the_node(tmp_path: Path) -> None:
    """No process survives SIGKILL on this machine (no GPU driver to sleep in), so the probe
    is wrapped to report the killed worker's pid still there in state 'D' (what a rank in the
    driver's teardown shows); the worker itself is real and dies. Past ``teardown_timeout_s``
    the supervisor reports the failure record (retry false: no restart here frees that GPU),
    the launch is refused and starts nothing, nor does a spare; the failure outlives an
    abort. Once the probe finds the process gone, the node takes ranks again."""
    sup = Supervisor(
        tmp_path,
        worker_argv=(sys.executable, "-c", "import time; time.sleep(60)"),
        teardown_timeout_s=1.0,
    )
    sup.kill_grace_s = 0.3
    in_driver = [True]

    def probe(pgids: list[int]) -> dict[int, dict[int, str]]:
        found = group_members(pgids)
        if in_driver[0]:
            for pgid in pgids:
                found.setdefault(pgid, {})[pgid] = "D"
        return found

    sup.probe = probe
    try:
        await sup.launch(_gen(1))
        pid = sup.workers[0].proc.pid
        marker = tmp_path / "started"
        sup.worker_argv = (
            sys.executable,
            "-c",
            "import sys, time; open(sys.argv[1], 'a').close(); time.sleep(60)",
            str(marker),
        )
        t0 = time.monotonic()
        with pytest.raises(WorkerTeardownError):
            await sup.launch(_gen(2))
        assert time.monotonic() - t0 >= sup.kill_grace_s + sup.teardown_timeout_s
        record = json.loads(sup.failure)
        assert record["retry"] is False and record["origin"] == "local", record
        assert (record["pid"], record["rank"], record["state"]) == (pid, 0, "D"), record
        assert record["seconds"] >= sup.teardown_timeout_s
        assert f"process {pid} (state D" in record["message"], record["message"]
        assert sup.state == "failed" and sup.workers == []

        sup.warm_spares = 1
        await sup.top_up_spares()
        assert sup.spares == []
        await sup.abort()
        assert json.loads(sup.failure) == record  # still reported: the GPU is still taken
        await asyncio.sleep(0.3)
        assert not marker.exists()

        in_driver[0] = False  # the driver's teardown ended
        await sup.launch(_gen(3))
        await _until(marker.exists)
        assert sup.failure == "" and len(sup.workers) == 1
    finally:
        in_driver[0] = False
        await sup.close()


async def test_a_worker_that_exits_at_sigterm_is_not_delayed(tmp_path: Path) -> None:
    """The common case: the worker and its child go at SIGTERM. The abort returns at once,
    well inside the grace period (the child, an orphaned zombie until init reaps it, holds
    nothing and is not waited for)."""
    sup = Supervisor(tmp_path, worker_argv=(sys.executable, "-c", _WITH_CHILD, "{run_dir}"))
    assert sup.kill_grace_s == 3.0
    child = -1
    try:
        leader, child = await _started_with_child(sup, tmp_path / "gen-00001")
        t0 = time.monotonic()
        await sup.abort()
        took = time.monotonic() - t0
        assert took < sup.kill_grace_s / 3, took  # measured: under 0.1 s
        assert _group_gone(leader)
    finally:
        await sup.close()
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
