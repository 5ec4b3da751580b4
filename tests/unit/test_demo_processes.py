"""The demo's process registry finds and ends every marked process, workers included."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from sailor.cli.demo.processes import ProcessRegistry, children_of, marked_pids

# A parent that starts a child in a session of its own, as an agent starts its workers.
_PARENT = (
    "import subprocess, sys, time;"
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'],"
    " start_new_session=True); time.sleep(60)"
)


def _wait(cond: object, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond() and time.monotonic() < end:  # type: ignore[operator]
        time.sleep(0.05)


def _own_session(pids: list[int]) -> bool:
    try:
        return all(os.getsid(p) == p for p in pids)
    except ProcessLookupError:
        return False


def test_kill_node_takes_its_workers(tmp_path: Path) -> None:
    reg = ProcessRegistry(log_dir=tmp_path)
    try:
        agent = reg.start("agent-x", [sys.executable, "-c", _PARENT])
        _wait(lambda: len(children_of(agent.pid)) == 1)
        (worker,) = children_of(agent.pid)
        assert worker in marked_pids(reg.token) and agent.pid in marked_pids(reg.token)
        victims = reg.kill_node("agent-x")
        assert set(victims) == {agent.pid, worker}
        _wait(lambda: not marked_pids(reg.token))
        assert marked_pids(reg.token) == []
    finally:
        reg.kill_all()


def test_kill_all_reaches_orphans(tmp_path: Path) -> None:
    reg = ProcessRegistry(log_dir=tmp_path)
    try:
        agent = reg.start("agent-y", [sys.executable, "-c", _PARENT])
        # the child in a session of its own: between its fork and its setsid it is still in
        # the parent's group and goes with it (CI saw it gone under load)
        _wait(lambda: len(children_of(agent.pid)) == 1 and _own_session(children_of(agent.pid)))
        reg.stop(["agent-y"], grace_s=2.0)  # the parent goes; its worker is orphaned
        assert len(marked_pids(reg.token)) == 1
    finally:
        assert reg.kill_all() == []
    assert marked_pids(reg.token) == []


_INTERRUPT = """
import asyncio, signal, sys, time
from sailor.cli.demo.run import Interrupted

def interrupt():
    raise Interrupted(signal.SIGINT)

async def background():
    await asyncio.sleep(0)
    interrupt()

async def main():
    if sys.argv[1] == "callback":
        asyncio.get_running_loop().call_soon(interrupt)
    else:
        asyncio.get_running_loop().create_task(background())
    await asyncio.sleep(5)

t0 = time.monotonic()
try:
    asyncio.run(main())
except Interrupted:
    print(f"interrupted after {time.monotonic() - t0:.2f} s")
"""


@pytest.mark.parametrize("where", ["callback", "task"])
def test_an_interrupt_inside_the_event_loop_ends_the_run(where: str) -> None:
    """The demo's signal handler raises Interrupted wherever the main thread is: inside an
    event-loop callback or a background task it must still end ``asyncio.run`` at once (a
    plain BaseException there is logged or kept on the task, and the demo ran on). In a
    process of its own: an interrupted task leaves this interpreter's state unfit for more
    tests (CPython 3.11), which the demo, exiting after, never meets."""
    import subprocess

    out = subprocess.run(
        [sys.executable, "-c", _INTERRUPT, where], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("interrupted after "), (out.stdout, out.stderr[-2000:])
    assert float(out.stdout.split()[2]) < 2.0, out.stdout


# A demo that starts a child through the registry and is then killed outright.
_DEMO = (
    "import sys, time; from pathlib import Path;"
    "from sailor.cli.demo.processes import ProcessRegistry;"
    "reg = ProcessRegistry(log_dir=Path(sys.argv[1]), token=sys.argv[2]);"
    "reg.start('server', [sys.executable, '-c', 'import time; time.sleep(60)']);"
    "print('started', flush=True); time.sleep(60)"
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_demo_killed_outright_takes_its_children(tmp_path: Path) -> None:
    """Killed with SIGKILL (no teardown runs), the demo's children went on running until a
    later run found its marker; now the kernel ends them with it."""
    import signal
    import subprocess
    import uuid

    token = uuid.uuid4().hex
    demo = subprocess.Popen(
        [sys.executable, "-c", _DEMO, str(tmp_path), token], stdout=subprocess.PIPE
    )
    try:
        assert demo.stdout is not None and demo.stdout.readline().strip() == b"started"
        _wait(lambda: len(marked_pids(token)) == 1)
        assert len(marked_pids(token)) == 1
        os.kill(demo.pid, signal.SIGKILL)
        demo.wait(timeout=10)
        _wait(lambda: not marked_pids(token), timeout=5)
        assert marked_pids(token) == []
    finally:
        demo.kill()
        for pid in marked_pids(token):
            os.kill(pid, signal.SIGKILL)
