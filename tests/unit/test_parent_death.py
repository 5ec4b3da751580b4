"""A worker started by an agent dies with it (``sailor.megatron_patch.parent_death``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sailor.megatron_patch.parent_death import PARENT_ENV, die_with_parent

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")

# the "agent": starts a "worker" in a session of its own, as the supervisor does, then waits
_AGENT = """
import os, subprocess, sys, time
arm = sys.argv[1] == "arm"
env = {**os.environ, **({"PARENT_ENV": str(os.getpid())} if arm else {})}
child = subprocess.Popen(
    [sys.executable, "-c",
     "from sailor.megatron_patch.parent_death import die_with_parent as d; "
     "import time; d(); print('armed', flush=True); time.sleep(60)"],
    env=env, start_new_session=True, stdout=subprocess.PIPE,
)
child.stdout.readline()
print(child.pid, flush=True)
time.sleep(60)
""".replace("PARENT_ENV", PARENT_ENV)


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.parametrize("arm", [True, False])
def test_a_worker_dies_with_its_agent(arm: bool) -> None:
    """``kill -9`` of the agent: an armed worker is gone within a second; without the
    variable (before) it runs on, adopted by init."""
    agent = subprocess.Popen(
        [sys.executable, "-c", _AGENT, "arm" if arm else "no"],
        stdout=subprocess.PIPE,
        cwd=Path(__file__).parents[2],
    )
    assert agent.stdout is not None
    worker = int(agent.stdout.readline())
    try:
        agent.kill()
        agent.wait()
        end = time.monotonic() + (5 if arm else 1)
        while _alive(worker) and time.monotonic() < end:
            time.sleep(0.05)
        assert _alive(worker) is not arm
    finally:
        if _alive(worker):
            os.kill(worker, signal.SIGKILL)


def test_without_the_variable_nothing_is_armed() -> None:
    assert die_with_parent({}) is False
    assert die_with_parent({PARENT_ENV: "not a pid"}) is False
