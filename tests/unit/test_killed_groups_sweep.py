"""A sweep whose signal is refused (EPERM) still ends its kill and opens the gate.

A dead worker's group may hold only processes of another user (a setuid helper, a command
run through sudo): ``killpg`` then fails with EPERM. The probe takes that as "members there"
(``teardown.group_members``), and so must the signal: before, the SIGTERM's PermissionError
escaped :meth:`KilledGroups.sweep`, its kill never ended (``killing`` stayed up) and every
later launch was refused. No unprivileged test can own a process it may not signal (and as
root every signal is allowed), so ``os.killpg`` stands in for the kernel's refusal.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from pathlib import Path

import pytest

from sailor.agent.killed_groups import KilledGroups, WorkerTeardownError
from sailor.coordination import TaskSet

# Leaves a child in its process group, names it on stdout and exits.
_LEAVES_A_CHILD = """
import subprocess
print(subprocess.Popen(["sleep", "30"], stdout=subprocess.DEVNULL).pid, flush=True)
"""


async def test_a_sweep_refused_its_signals_ends_and_the_group_lingers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The SIGTERM and SIGKILL are refused: the sweep's kill still ends (the gate is no
    longer held by it), the child that could not be signalled lingers past the bound (the
    failure record, no worker starts), and once it is gone the gate opens."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _LEAVES_A_CHILD,
        stdout=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    assert proc.stdout is not None
    child = int((await proc.stdout.readline()).decode())
    code = await proc.wait()  # reaped: the worker a sweep is for

    class Worker:
        rank, step, exit_code = 0, 3, code

    w = Worker()
    w.proc = proc  # type: ignore[attr-defined]
    real_killpg = os.killpg

    def refused(pgid: int, sig: int) -> None:
        if sig == 0:  # the probe: the group is really there
            real_killpg(pgid, sig)
            return
        raise PermissionError(1, "Operation not permitted")

    tasks = TaskSet("test")
    groups = KilledGroups(tmp_path, tasks, lambda *a: None, lambda: None, teardown_timeout_s=0.3)
    groups.kill_grace_s = 0.1
    try:
        with monkeypatch.context() as m:
            m.setattr(os, "killpg", refused)
            groups.sweep(w)  # type: ignore[arg-type]  # before: PermissionError from the SIGTERM
            assert groups.killing  # under way: no worker starts meanwhile
            async with asyncio.timeout(5):
                while groups.killing:
                    await asyncio.sleep(0.02)
        assert groups.going == 0
        assert f'"pid": {child}' in groups.record or str(child) in groups.record, groups.record
        with pytest.raises(WorkerTeardownError):
            await groups.gate()
        os.kill(child, signal.SIGKILL)
        async with asyncio.timeout(5):
            while True:
                with contextlib.suppress(WorkerTeardownError):
                    await groups.gate()
                    break
                await asyncio.sleep(0.05)
        assert groups.record == ""
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
        await tasks.close()
