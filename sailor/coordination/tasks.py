"""Named, guarded background tasks.

Every long-lived task of a daemon is created here: it has a name, its exception is logged (and
handed to ``on_crash``) instead of vanishing, and ``close()`` cancels and awaits all of them
with a timeout, so a daemon leaks no task on shutdown. Never use bare ``asyncio.create_task``
for a long-lived task in the daemons.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import structlog

__all__ = ["TaskSet"]

_log = structlog.get_logger("sailor.tasks")


class TaskSet:
    """A set of named tasks owned by one component."""

    def __init__(
        self, owner: str, on_crash: Callable[[str, BaseException], None] | None = None
    ) -> None:
        self._owner = owner
        self._tasks: set[asyncio.Task[Any]] = set()
        self._on_crash = on_crash

    def spawn(self, name: str, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.create_task(self._guard(name, coro), name=f"{self._owner}:{name}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        # A task cancelled before its first step never starts ``coro``; close it, else it is
        # garbage-collected as "never awaited" (a no-op when it ran to its end).
        task.add_done_callback(lambda _: coro.close())
        return task

    async def _guard(self, name: str, coro: Coroutine[Any, Any, Any]) -> Any:
        try:
            return await coro
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            _log.error("task_crashed", owner=self._owner, task=name, error=repr(exc))
            if self._on_crash is not None:
                self._on_crash(name, exc)
            return None

    @property
    def names(self) -> list[str]:
        return sorted(t.get_name() for t in self._tasks)

    async def close(self, timeout: float = 5.0, recancel_s: float = 0.1) -> None:
        """Cancel every task and wait (bounded) for them to finish.

        A task still running ``recancel_s`` after a cancel is cancelled again: a library
        call may swallow one cancellation (a client that turns it into its own error), and
        a retry loop around such a call would then run on after close."""
        pending = set(self._tasks)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while pending:
            for t in pending:
                t.cancel()
            left = deadline - loop.time()
            if left <= 0:
                break
            _, pending = await asyncio.wait(pending, timeout=min(recancel_s, left))
        self._tasks.clear()
