"""A worker's own children die with it, however it ends.

A worker runs in a process group of its own, and what it starts (data loader workers,
compile workers, a launcher's processes) is in that group. The supervisor's kills (an
abort, a launch, its close) signal the whole group; but a worker that ended without one (it
crashed, the OOM killer or an operator SIGKILLed it, it ended its run) left its children
running, adopted by init, holding memory, ports and GPU memory, and the next launch did not
wait for them. Now the supervisor kills what is left of a worker's group when it reaps the
worker, as a kill's groups are: SIGTERM, SIGKILL after the grace period, no worker starting
until they are gone. Real processes throughout.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from pathlib import Path

from sailor.agent.supervisor import Supervisor
from tests.integration.test_supervisor_teardown import (
    _CHECKER,
    _STUBBORN_ARGV,
    _gone,
    _stat,
    _written,
    kill_known,
    launch_gen,
    until,
)

# A worker that starts a child which starts a grandchild (each a plain sleep: none arms
# itself to die with its parent), names the grandchild in {run_dir}/grandchild.pid and says
# it is ready. No braces: the supervisor formats the argv.
_WITH_GRANDCHILD = """
import json, subprocess, sys, time
code = (
    "import subprocess; p = subprocess.Popen(['sleep', '60']); print(p.pid, flush=True); p.wait()"
)
child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
pid = child.stdout.readline().decode().strip()
with open(sys.argv[1] + "/grandchild.pid", "w") as f:
    f.write(pid + "\\n")
print(json.dumps(dict(event="ready", rank=0)), flush=True)
time.sleep(60)
"""


async def test_a_sigkilled_workers_grandchild_is_gone_within_seconds(tmp_path: Path) -> None:
    """SIGKILL of the worker alone (not through the supervisor): its child and grandchild
    are gone within 3 s (0.2 s here unloaded: the exit is seen within ``_EXIT_POLL_S``, and
    the sleeps die at SIGTERM), the worker's exit is its failure, and nothing is left being
    killed. Before, both lived on, adopted by init, and the worker's death went unseen while
    the grandchild held its stderr open (the state stayed ``running``)."""
    sup = Supervisor(tmp_path, worker_argv=(sys.executable, "-c", _WITH_GRANDCHILD, "{run_dir}"))
    grandchild = -1
    try:
        await sup.launch(launch_gen(1))
        await until(lambda: bool(sup.workers) and sup.workers[0].started)
        grandchild = int((tmp_path / "gen-00001" / "grandchild.pid").read_text())
        assert not _gone(_stat(grandchild))
        os.kill(sup.workers[0].proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        await until(lambda: _gone(_stat(grandchild)), timeout=3.0)
        took = time.monotonic() - t0
        await until(lambda: sup.state == "failed" and not sup.kill_under_way, timeout=5.0)
        assert "exit -9" in sup.failure or '"signal"' in sup.failure, sup.failure
        assert took < 3.0
    finally:
        await sup.close()
        if grandchild > 0:  # never -1: kill(-1) signals every process we may
            with contextlib.suppress(ProcessLookupError):
                os.kill(grandchild, signal.SIGKILL)  # the old code left it behind


async def test_the_next_launch_waits_for_a_dead_workers_stubborn_child(tmp_path: Path) -> None:
    """The worker exits on its own; its child ignores SIGTERM: it gets SIGKILL after the
    grace period, the supervisor reports a kill under way meanwhile (the agent refuses a
    Launch then), and a launch waits until the child is gone: the next generation's
    worker finds it gone. Before, the child lived on and the launch started beside it."""
    sup = Supervisor(tmp_path, worker_argv=_STUBBORN_ARGV)
    sup.kill_grace_s = 0.5
    child = -1
    try:
        await sup.launch(launch_gen(1))
        await until(lambda: bool(sup.workers) and sup.workers[0].started)
        child = int((tmp_path / "gen-00001" / "child.pid").read_text())
        sup.workers[0].proc.send_signal(signal.SIGKILL)
        await until(lambda: sup.kill_under_way and sup.killing == 1, timeout=2.0)
        assert not _gone(_stat(child))  # SIGTERM is ignored: the grace period runs

        seen = tmp_path / "seen.txt"
        child_file = tmp_path / "gen-00001" / "child.pid"
        sup.worker_argv = (sys.executable, "-c", _CHECKER, str(child_file), str(seen))
        t0 = time.monotonic()
        await sup.launch(launch_gen(2))
        assert time.monotonic() - t0 < 0.5 + 2.0
        await until(lambda: _written(seen))
        states = seen.read_text().split()
        assert len(states) == 1 and _gone(states[0]), states
        assert not sup.kill_under_way and sup.failure == ""
    finally:
        await sup.close()
        kill_known(child)


async def test_close_during_a_sweep_still_sigkills_the_stubborn_child(tmp_path: Path) -> None:
    """The agent stops while a dead worker's group is being swept and its child ignores
    SIGTERM: the close waits for the sweep, whose SIGKILL comes after the grace period, and
    the child is gone once it returns. Before, closing the supervisor's tasks (2 s) cancelled
    the sweep inside its grace period (2.5 s here): no SIGKILL, the child outlived the agent."""
    sup = Supervisor(tmp_path, worker_argv=_STUBBORN_ARGV)
    sup.kill_grace_s = 2.5  # longer than the tasks' close (2 s)
    child = -1
    try:
        await sup.launch(launch_gen(1))
        await until(lambda: bool(sup.workers) and sup.workers[0].started)
        child = int((tmp_path / "gen-00001" / "child.pid").read_text())
        sup.workers[0].proc.send_signal(signal.SIGKILL)
        await until(lambda: sup.kill_under_way, timeout=2.0)
        await sup.close()
        await until(lambda: _gone(_stat(child)), timeout=1.0)
        assert not sup.kill_under_way
    finally:
        await sup.close()
        kill_known(child)


async def test_a_worker_that_ends_its_run_leaves_no_child_behind(tmp_path: Path) -> None:
    """A worker that exits 0 (its run is over) with a child still running: the child goes
    too, and the exit is no failure."""
    script = """
import json, subprocess, sys
child = subprocess.Popen(["sleep", "60"])
with open(sys.argv[1] + "/child.pid", "w") as f:
    f.write(str(child.pid) + "\\n")
print(json.dumps(dict(event="ready", rank=0)), flush=True)
print(json.dumps(dict(event="stopped", rank=0)), flush=True)
"""
    sup = Supervisor(tmp_path, worker_argv=(sys.executable, "-c", script, "{run_dir}"))
    child = -1
    try:
        await sup.launch(launch_gen(1))
        await until(lambda: bool(sup.workers) and sup.workers[0].exit_code is not None)
        child = int((tmp_path / "gen-00001" / "child.pid").read_text())
        await until(lambda: _gone(_stat(child)), timeout=2.0)
        await until(lambda: not sup.kill_under_way, timeout=2.0)
        assert sup.state == "stopped" and sup.failure == ""
    finally:
        await sup.close()
        kill_known(child)


async def test_a_worker_without_children_costs_no_kill(tmp_path: Path) -> None:
    """The common case: a worker that started nothing exits; no kill is begun (one
    ``killpg(pgid, 0)`` finds its group empty), nothing is recorded for a restarted agent."""
    script = "import json; print(json.dumps(dict(event='ready', rank=0)), flush=True)"
    sup = Supervisor(tmp_path, worker_argv=(sys.executable, "-c", script))
    try:
        await sup.launch(launch_gen(1))
        await until(lambda: bool(sup.workers) and sup.workers[0].exit_code is not None)
        await asyncio.sleep(0.1)
        assert not sup.kill_under_way and sup.killing == 0
        assert not (tmp_path / "killed.json").exists()
    finally:
        await sup.close()


async def test_a_sweep_that_fails_does_not_hide_the_workers_exit(tmp_path: Path) -> None:
    """A sweep that raises (a bug, an error the kernel gave that it did not expect) is
    logged; the worker's exit is still handled: its failure is reported. Before, the
    exception ended the task that waits for the worker: no failure, the state stale."""
    fails = (
        "import json, sys; print(json.dumps(dict(event='ready', rank=0)), flush=True); sys.exit(3)"
    )
    sup = Supervisor(tmp_path, worker_argv=(sys.executable, "-c", fails))

    def broken(w: object) -> None:
        raise RuntimeError("sweep failed")

    sup.killed_groups.sweep = broken  # type: ignore[method-assign]
    try:
        await sup.launch(launch_gen(1))
        await until(lambda: sup.state == "failed", timeout=5.0)
        assert '"returncode": 3' in sup.failure, sup.failure
    finally:
        await sup.close()
