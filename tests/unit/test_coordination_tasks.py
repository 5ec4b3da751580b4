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
