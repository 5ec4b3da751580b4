"""The supervisor's file work runs in order on its own thread, each piece waited a bounded
time: work stuck in the kernel holds neither the event loop nor the interpreter's exit."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from sailor.agent.run_dir_io import RunDirIO, RunDirTimeoutError


async def test_work_runs_in_order_and_its_errors_reach_the_caller() -> None:
    io = RunDirIO("t")
    done: list[int] = []
    try:
        firsts = [io.submit(lambda i=i: done.append(i)) for i in range(5)]
        assert await io.run(lambda: len(done), "count not read", 5.0) == 5
        assert done == [0, 1, 2, 3, 4] and all(f.done() for f in firsts)
        with pytest.raises(ZeroDivisionError):
            await io.run(lambda: 1 // 0, "division not done", 5.0)
    finally:
        io.close()


async def test_stuck_work_times_out_its_wait_and_work_behind_it_is_dropped() -> None:
    """The first piece blocks (a hung mount); its wait ends after the bound with the cause,
    the loop runs on meanwhile, and a piece queued behind it whose wait timed out too is
    dropped, not run late; one asked for after the mount answered runs."""
    io = RunDirIO("t")
    release = threading.Event()
    ran: list[str] = []
    try:
        t0 = time.monotonic()
        with pytest.raises(
            RunDirTimeoutError, match=r"error file x unreadable within 0\.2 s"
        ) as first:
            await io.run(release.wait, "error file x unreadable", 0.2)
        assert 0.2 <= time.monotonic() - t0 < 1.0
        assert first.value.holder == ""  # its own file did not answer
        with pytest.raises(RunDirTimeoutError) as late:
            await io.run(lambda: ran.append("late"), "control not written", 0.1)
        # the wait behind it names the work that holds the thread, and for how long (before:
        # only itself, as if its own file had not answered)
        assert late.value.holder == "error file x unreadable"
        # the two waits were 0.2 + 0.1 s; the holder started in the thread after the first
        # wait began, and asyncio fires a timer up to its clock resolution early (a
        # fresh-clone CI read 0.2985 s)
        assert 0.25 <= late.value.holder_s < 2.0
        assert "the thread is still on error file x unreadable, for " in str(late.value)
        release.set()
        assert await io.run(lambda: ran.append("now") or ran, "control not written", 5.0) == ["now"]
    finally:
        release.set()
        io.close()


async def test_after_close_no_work_is_taken() -> None:
    io = RunDirIO("t")
    io.close()
    with pytest.raises(RuntimeError, match="closed"):
        await io.run(lambda: None, "nothing", 1.0)
    await asyncio.sleep(0)
