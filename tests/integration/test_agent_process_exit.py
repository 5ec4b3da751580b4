"""What an agent's processes cost while they wait, and that they go when told or orphaned.

A warm spare (``--warm``, started by the supervisor ahead of need) may wait hours for its
rank. Before, it read its control file every ``--poll-s`` (20 ms): 1.4-1.8 % of a core and
~50 wake-ups/s per idle spare on this host; a SIGTERM then took 0.7-0.8 s to end it (the
interpreter's teardown after torch and ``torch._dynamo``), seconds with several spares on the
2 cores. Toy trainers (the protocol tests' workers) did not die with their agent: after a
pytest run was interrupted, its workers and spares ran on. Real processes throughout: the
real worker started by the real supervisor, a real agent process killed with SIGKILL.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sailor.agent.supervisor import Supervisor
from sailor.agent.worker_argv import DEFAULT_WORKER_ARGV
from sailor.agent.worker_view import WorkerView

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc is Linux's")

_TICK = os.sysconf("SC_CLK_TCK")


def _usage(pid: int) -> tuple[float, int]:
    """(CPU seconds, voluntary context switches) of every thread of ``pid`` so far."""
    cpu, switches = 0.0, 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with_comm = (task / "stat").read_text().rsplit(")", 1)[1].split()
        cpu += (int(with_comm[11]) + int(with_comm[12])) / _TICK
        for line in (task / "status").read_text().splitlines():
            if line.startswith("voluntary_ctxt_switches:"):
                switches += int(line.split()[1])
    return cpu, switches


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


async def _warm_spare(sup: Supervisor) -> WorkerView:
    """The supervisor's spare, once it reported it waits (torch imported, warmed up)."""
    await sup.top_up_spares()
    async with asyncio.timeout(60):
        while sup.spares_ready < 1:
            await asyncio.sleep(0.05)
    return sup.spares[0]


async def test_an_idle_spare_uses_no_cpu_and_takes_its_directive(tmp_path: Path) -> None:
    """Over 3 s an idle real spare uses < 1 % of a core and wakes < 30 times (before: 1.4-1.8 %
    and ~150 wake-ups, a read of its control file every 20 ms); a directive written as the
    agent writes it (a rename over the file) is still taken at once."""
    sup = Supervisor(tmp_path, worker_argv=DEFAULT_WORKER_ARGV, warm_spares=1)
    try:
        spare = await _warm_spare(sup)
        await asyncio.sleep(0.5)  # past its last start-up work
        pid = spare.proc.pid
        cpu0, sw0, t0 = *_usage(pid), time.monotonic()
        await asyncio.sleep(3.0)
        cpu1, sw1, t1 = *_usage(pid), time.monotonic()
        share, wakeups = (cpu1 - cpu0) / (t1 - t0), sw1 - sw0
        print(f"idle spare over {t1 - t0:.1f} s: {100 * share:.2f} % of a core, {wakeups} wake-ups")
        assert share < 0.01 and wakeups < 30, (share, wakeups)

        # a directive naming a plan that does not exist: the spare takes it and fails at once
        assert spare.control is not None
        missing, error = tmp_path / "no-such-plan.json", tmp_path / "error.json"
        argv = [
            *("--plan", str(missing), "--rank", "0", "--world-size", "1", "--master", ""),
            *("--control", str(spare.control), "--error-file", str(error)),
        ]
        tmp = spare.control.with_name("control.json.tmp")
        tmp.write_text(json.dumps({"relayout": {"generation": 0, "argv": argv}}))
        t = time.monotonic()
        tmp.replace(spare.control)
        async with asyncio.timeout(10):
            code = await spare.proc.wait()
        taken = time.monotonic() - t
        print(f"directive -> spare exited (failed at its plan) in {1000 * taken:.0f} ms")
        assert code == 1
        assert json.loads(error.read_text())["error_type"] == "FileNotFoundError"
    finally:
        await sup.close()


async def test_a_spare_exits_promptly_on_sigterm(tmp_path: Path) -> None:
    """SIGTERM to an idle real spare: gone within 1 s (before: 0.7-0.8 s on an idle host,
    the interpreter's teardown after torch, and seconds under load; now ~0.3 s idle and
    0.64 s seen under a full test run), exit status 0."""
    sup = Supervisor(tmp_path, worker_argv=DEFAULT_WORKER_ARGV, warm_spares=1)
    try:
        spare = await _warm_spare(sup)
        t = time.monotonic()
        os.kill(spare.proc.pid, signal.SIGTERM)
        async with asyncio.timeout(10):
            code = await spare.proc.wait()
        took = time.monotonic() - t
        print(f"SIGTERM -> spare gone in {1000 * took:.0f} ms")
        assert code == 0 and took < 1.0, (code, took)
    finally:
        await sup.close()


# An agent process: the real supervisor with toy workers, one launched rank and two warm
# spares; prints their pids once the spares are warm, then waits to be killed.
_AGENT = """
import asyncio, sys
from pathlib import Path
from sailor.agent.supervisor import Supervisor
from sailor.agent.worker_argv import TOY_TRAINER_ARGV
from tests.integration.test_worker_signals import PLAN, launch_of

async def main():
    sup = Supervisor(Path(sys.argv[1]), worker_argv=TOY_TRAINER_ARGV, warm_spares=2)
    await sup.launch(launch_of(PLAN))
    while not all(w.started for w in sup.workers) or sup.spares_ready < 2:
        await asyncio.sleep(0.05)
    print("pids", *(w.proc.pid for w in [*sup.workers, *sup.spares]), flush=True)
    await asyncio.sleep(60)

asyncio.run(main())
"""


def test_an_agent_killed_leaves_no_worker_or_spare(tmp_path: Path) -> None:
    """SIGKILL of an agent process: its running rank and its two warm spares are gone within
    2 s (they ask the kernel for SIGKILL at their parent's death). Before, toy workers did not
    ask: all three ran on, adopted by init (a toy rank trains for hours, a spare waits
    forever)."""
    agent = subprocess.Popen(
        [sys.executable, "-c", _AGENT, str(tmp_path)],
        stdout=subprocess.PIPE,
        cwd=Path(__file__).parents[2],
    )
    assert agent.stdout is not None
    pids: list[int] = []
    try:
        for line in agent.stdout:  # the supervisor logs on stdout too
            if line.startswith(b"pids "):
                pids = [int(p) for p in line.split()[1:]]
                break
        assert len(pids) == 3, pids
        agent.kill()
        agent.wait()
        end = time.monotonic() + 2.0
        while any(_alive(p) for p in pids) and time.monotonic() < end:
            time.sleep(0.05)
        assert not [p for p in pids if _alive(p)]
    finally:
        agent.kill()
        agent.wait()
        for p in pids:
            if _alive(p):
                os.kill(p, signal.SIGKILL)
