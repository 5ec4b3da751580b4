"""A run directory that does not answer never holds the agent's event loop.

The workers' error files, control files and logs live in the generation's run directory,
which may be on a network mount. A hard-mounted NFS whose server went away blocks every
read and write there in the kernel, for good; the supervisor did its file work on the
agent's loop, so one such read (a failed worker's error file) stopped the agent's
heartbeats, status and commands with it. Now that work runs on a thread of its own, waited
``io_wait_s`` at most, and the failure says what did not answer.

A FIFO stands in for the hung file: opening one blocks in the kernel until its other end is
opened, as a read or write on a dead hard mount does. Real worker processes; a ticker task
measures how long the loop was held.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sailor.agent.killed_groups import KILLED_FILE
from sailor.agent.run_dir_io import RunDirTimeoutError
from sailor.agent.supervisor import Supervisor
from sailor.agent.worker_view import WorkerView
from tests.integration.test_supervisor_teardown import _gone, _stat, until
from tests.integration.test_worker_children import _WITH_GRANDCHILD
from tests.integration.test_worker_signals import PLAN, launch_of

# Makes its error file a FIFO (no braces: the supervisor formats the argv), says it is ready
# and fails without writing it.
_FIFO_ERROR_FILE = """
import json, os, sys, time
os.mkfifo(sys.argv[1])
print(json.dumps(dict(event="ready", rank=0)), flush=True)
time.sleep(0.2)
sys.exit(3)
"""

_SLEEPER = """
import json, time
print(json.dumps(dict(event="ready", rank=0)), flush=True)
time.sleep(60)
"""


@contextlib.contextmanager
def _unjammed_later(fifo: Path, after_s: float) -> Iterator[None]:
    """From ``after_s`` on (and at the end), open both ends of ``fifo`` now and then, so
    that whatever blocks in its open goes on: the hung mount answers again. On the old
    code, what the loop was held by ends that way rather than at the test's timeout."""
    stop = threading.Event()

    def unjam() -> None:
        if stop.wait(after_s):
            return
        while not stop.wait(0.05):
            for flags in (os.O_WRONLY, os.O_RDONLY):
                try:
                    fd = os.open(fifo, flags | os.O_NONBLOCK)
                except OSError:
                    continue
                os.close(fd)

    t = threading.Thread(target=unjam, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(2.0)
        for flags in (os.O_WRONLY, os.O_RDONLY):  # let a thread still stuck there go
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, flags | os.O_NONBLOCK))


class _Ticker:
    """The longest the event loop went without running this task (10 ms ticks)."""

    def __init__(self) -> None:
        self.longest = 0.0
        self._task: asyncio.Task[None] | None = None

    async def _tick(self) -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.01)
            now = time.monotonic()
            self.longest = max(self.longest, now - last)
            last = now

    def __enter__(self) -> _Ticker:
        self._task = asyncio.create_task(self._tick(), name="ticker")
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()


async def test_an_error_file_that_does_not_answer_neither_holds_the_loop_nor_hides_the_failure(
    tmp_path: Path,
) -> None:
    """Rank 0 fails; its error file does not answer. The failure is reported after
    ``io_wait_s``, naming the file that did not answer and the worker's exit, and the loop
    is never held meanwhile. Before, the loop blocked in the error file's open until the
    file system answered (here: 3 s, when the test lets it)."""
    sup = Supervisor(tmp_path, worker_argv=(sys.executable, "-c", _FIFO_ERROR_FILE, "{error_file}"))
    sup.io_wait_s = 0.5
    fifo = tmp_path / "gen-00001" / "error-0.json"
    with _unjammed_later(fifo, 3.0), _Ticker() as ticker:
        try:
            await sup.launch(launch_of(PLAN))
            async with asyncio.timeout(20):
                while not sup.failure:
                    sup.changed.clear()
                    await sup.changed.wait()
            assert f"error file {fifo} unreadable within 0.5 s" in sup.failure, sup.failure
            assert sup.failure.startswith("rank 0 exit 3: "), sup.failure
            assert sup.state == "failed"
            assert ticker.longest < 1.5, ticker.longest  # before: 3 s, until unjammed
        finally:
            await sup.close()


async def test_a_control_file_that_does_not_answer_fails_the_stop_not_the_loop(
    tmp_path: Path,
) -> None:
    """A Stop whose control file write does not answer fails with the cause (the agent
    refuses the command with it, and the controller sends it again) within ``io_wait_s``,
    and the loop goes on. Before, the loop blocked in the write."""
    sup = Supervisor(tmp_path, worker_argv=(sys.executable, "-c", _SLEEPER))
    sup.io_wait_s = 0.5
    try:
        await sup.launch(launch_of(PLAN))
        tmp = tmp_path / "gen-00001" / "control-0.json.tmp"
        os.mkfifo(tmp)  # the atomic write's temporary file: its open blocks
        with _unjammed_later(tmp, 3.0), _Ticker() as ticker:
            with pytest.raises(RunDirTimeoutError, match=r"not written within 0\.5 s"):
                await sup.stop_at(5)
            assert ticker.longest < 1.5, ticker.longest  # before: 3 s, until unjammed
        with contextlib.suppress(FileNotFoundError):  # unless the late write renamed it
            tmp.unlink()
        sup.io_wait_s = 10.0
        await sup.stop_at(6)  # the mount answers again: the latest request is written
        control = json.loads((tmp_path / "gen-00001" / "control-0.json").read_text())
        assert control["stop_at_step"] == 6
    finally:
        await sup.close()


# Says it is ready, then that it holds (an in-place worker whose world ended), and waits.
_HOLDER = """
import json, time
print(json.dumps(dict(event="ready", rank=0)), flush=True)
print(json.dumps(dict(event="held", rank=0, step=0)), flush=True)
time.sleep(60)
"""


async def _directive_times_out(sup: Supervisor, w: WorkerView, generation: int) -> None:
    """An in-place launch hands ``w`` the rank, and the directive's write into the control
    file ``w`` polls does not answer: the launch fails, and ``w`` is killed with what the
    launch had started (before, it was out of every list: neither killed nor tracked, and
    the late write could still make it join the refused generation)."""
    assert w.control is not None
    tmp = w.control.with_name(w.control.name + ".tmp")
    os.mkfifo(tmp)  # the directive's atomic write blocks in its open
    with _unjammed_later(tmp, 30.0):
        with pytest.raises(RunDirTimeoutError, match="directive"):
            await sup.launch(
                launch_of(PLAN).model_copy(
                    update={
                        "generation": generation,
                        "command_id": f"c{generation}",
                        "in_place": True,
                    }
                )
            )
        assert w.proc.returncode is not None, "handed a rank, its directive failed: not killed"
        assert w not in sup.workers and w not in sup.spares


async def test_a_spare_whose_directive_does_not_answer_is_killed_with_the_launch(
    tmp_path: Path,
) -> None:
    sup = Supervisor(tmp_path, worker_argv=(sys.executable, "-c", _SLEEPER), warm_spares=1)
    sup.io_wait_s = 0.5
    sup.kill_grace_s = 0.5
    try:
        await sup.top_up_spares()
        spare = sup.spares[0]
        await _directive_times_out(sup, spare, 1)
    finally:
        await sup.close()


async def test_a_held_worker_whose_directive_does_not_answer_is_killed_with_the_launch(
    tmp_path: Path,
) -> None:
    sup = Supervisor(tmp_path, worker_argv=(sys.executable, "-c", _HOLDER))
    sup.io_wait_s = 0.5
    sup.kill_grace_s = 0.5
    try:
        await sup.launch(launch_of(PLAN).model_copy(update={"in_place": True}))
        async with asyncio.timeout(20):
            while not (sup.workers and sup.workers[0].held):
                sup.changed.clear()
                await sup.changed.wait()
        await _directive_times_out(sup, sup.workers[0], 2)
    finally:
        await sup.close()


async def test_a_killed_record_that_does_not_answer_holds_neither_the_loop_nor_the_kill(
    tmp_path: Path,
) -> None:
    """A worker dies and leaves a grandchild in its group; ``killed.json``, which the sweep
    writes before its SIGTERM, does not answer. The loop is never held; the record is
    waited ``io_wait_s`` and the group signalled all the same: the grandchild is gone
    within seconds. Before, the write ran on the loop and held it until the file answered
    (3 s here)."""
    sup = Supervisor(tmp_path, worker_argv=(sys.executable, "-c", _WITH_GRANDCHILD, "{run_dir}"))
    sup.io_wait_s = 0.5
    grandchild = -1
    fifo = tmp_path / f"{KILLED_FILE}.tmp"
    try:
        await sup.launch(launch_of(PLAN))
        await until(lambda: bool(sup.workers) and sup.workers[0].started)
        grandchild = int((tmp_path / "gen-00001" / "grandchild.pid").read_text())
        os.mkfifo(fifo)  # the record's atomic write blocks in its open
        with _unjammed_later(fifo, 3.0), _Ticker() as ticker:
            os.kill(sup.workers[0].proc.pid, signal.SIGKILL)
            await until(lambda: _gone(_stat(grandchild)), timeout=3.0)
            await until(lambda: not sup.kill_under_way, timeout=3.0)
            assert ticker.longest < 1.5, ticker.longest  # before: 3 s, until unjammed
    finally:
        await sup.close()
        if grandchild > 0:  # never -1: kill(-1) signals every process we may
            with contextlib.suppress(ProcessLookupError):
                os.kill(grandchild, signal.SIGKILL)


async def test_an_abort_whose_killed_record_does_not_answer_still_signals(
    tmp_path: Path,
) -> None:
    """An abort while ``killed.json`` does not answer returns within ``io_wait_s`` (and
    the wait for its worker to go), its worker killed, the loop never held. Before, the
    record's write held the loop until the file answered (3 s here)."""
    sup = Supervisor(tmp_path, worker_argv=(sys.executable, "-c", _SLEEPER))
    sup.io_wait_s = 0.5
    fifo = tmp_path / f"{KILLED_FILE}.tmp"
    try:
        await sup.launch(launch_of(PLAN))
        w = sup.workers[0]
        os.mkfifo(fifo)
        with _unjammed_later(fifo, 3.0), _Ticker() as ticker:
            t0 = time.monotonic()
            await sup.abort()
            assert time.monotonic() - t0 < 0.5 + 1.5
            assert w.proc.returncode is not None
            assert ticker.longest < 1.5, ticker.longest  # before: 3 s, until unjammed
    finally:
        await sup.close()
