"""``within``: a deadline that holds when the awaited code does not end at the first cancel."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from sailor.coordination.deadline import within


async def test_an_answer_in_time_is_returned() -> None:
    async def quick() -> int:
        await asyncio.sleep(0.01)
        return 7

    assert await within(quick(), 1.0, "quick") == 7


async def test_its_own_error_is_raised() -> None:
    async def broken() -> None:
        raise ConnectionRefusedError("no")

    with pytest.raises(ConnectionRefusedError):
        await within(broken(), 1.0, "broken")


async def test_a_cancellation_swallowed_once_is_repeated() -> None:
    """As nats-py's connect loop on 3.11: one cancellation dropped, the loop goes on."""
    cancels = 0

    async def stubborn() -> None:
        nonlocal cancels
        while True:
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                cancels += 1
                if cancels >= 3:
                    raise

    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(TimeoutError, match=r"stubborn: no answer within 0\.05 s"):
        await within(stubborn(), 0.05, "stubborn", grace_s=5.0, recancel_s=0.01)
    assert cancels == 3
    assert loop.time() - t0 < 2.0


async def test_a_task_that_never_ends_is_left_after_the_grace() -> None:
    release = asyncio.Event()

    async def deaf() -> None:
        while not release.is_set():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(0.01)

    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(TimeoutError):
        await within(deaf(), 0.05, "deaf", grace_s=0.2, recancel_s=0.02)
    assert 0.2 <= loop.time() - t0 < 1.5
    release.set()
    await asyncio.sleep(0.05)


async def test_a_result_that_comes_despite_the_cancel_is_kept() -> None:
    async def finishes_anyway() -> str:
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(1.0)
        return "connected"

    assert await within(finishes_anyway(), 0.05, "late") == "connected"


async def test_the_callers_cancellation_stops_the_task() -> None:
    stopped = asyncio.Event()

    async def long() -> None:
        try:
            await asyncio.sleep(10)
        finally:
            stopped.set()

    outer = asyncio.ensure_future(within(long(), 10.0, "long"))
    await asyncio.sleep(0.05)
    outer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await outer
    assert stopped.is_set()


@pytest.mark.parametrize(
    ("timeout_s", "grace_s", "recancel_s"), [(0, 1, 0.1), (1, -1, 0.1), (1, 1, 0)]
)
async def test_bad_settings_are_refused(
    timeout_s: float, grace_s: float, recancel_s: float
) -> None:
    async def nothing() -> None:
        return None

    coro = nothing()
    with pytest.raises(ValueError, match="timeout_s="):
        await within(coro, timeout_s, "x", grace_s=grace_s, recancel_s=recancel_s)
    coro.close()
