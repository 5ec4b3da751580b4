"""TaskSet: a task cancelled before it ever ran leaves no un-awaited coroutine behind."""

from __future__ import annotations

import asyncio
import gc
import warnings

from sailor.coordination.tasks import TaskSet


def test_close_right_after_spawn_leaves_no_unawaited_coroutine() -> None:
    ran: list[str] = []

    async def work() -> None:
        ran.append("ran")

    async def main() -> None:
        tasks = TaskSet("test")
        tasks.spawn("late", work())  # cancelled before the loop ever runs it
        await tasks.close()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        asyncio.run(main())
        gc.collect()
    assert ran == []
    assert not [w for w in caught if "never awaited" in str(w.message)], caught


def test_a_task_that_ran_still_returns_its_value() -> None:
    async def main() -> int:
        tasks = TaskSet("test")

        async def seven() -> int:
            return 7

        t = tasks.spawn("seven", seven())
        out = await t
        await tasks.close()
        return int(out)

    assert asyncio.run(main()) == 7


def test_close_cancels_again_a_task_that_swallowed_the_first_cancel() -> None:
    swallowed: list[int] = []

    async def stubborn() -> None:
        while True:  # a retry loop around a call that turns a cancel into its own error
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                if swallowed:
                    raise
                swallowed.append(1)

    async def main() -> bool:
        tasks = TaskSet("test")
        t = tasks.spawn("stubborn", stubborn())
        await asyncio.sleep(0)
        await tasks.close(timeout=2.0)
        return t.done()

    assert asyncio.run(main()) and swallowed == [1]


async def test_keep_restarts_with_backoff_then_hands_the_crash_over() -> None:
    runs: list[str] = []
    sleeps: list[float] = []
    crashed: list[tuple[str, str]] = []

    async def fake_sleep(s: float) -> None:
        sleeps.append(s)

    async def flaky() -> str:
        runs.append("run")
        if len(runs) < 3:
            raise RuntimeError(f"crash {len(runs)}")
        return "done"

    tasks = TaskSet("test", on_crash=lambda name, exc: crashed.append((name, str(exc))))
    t = tasks.keep("flaky", flaky, backoff_s=0.5, sleep=fake_sleep)
    assert await t == "done"
    assert runs == ["run"] * 3 and sleeps == [0.5, 1.0] and crashed == []

    async def broken() -> None:
        raise ValueError("for good")

    t = tasks.keep(
        "broken", broken, backoff_s=0.5, max_backoff_s=1.5, max_crashes=4, sleep=fake_sleep
    )
    await t
    assert sleeps[2:] == [0.5, 1.0, 1.5]  # three restarts, then the fourth crash is handed over
    assert crashed == [("broken", "for good")]
    await tasks.close()
