"""Named, guarded background tasks.

Every long-lived task of a daemon is created here: it has a name, its exception is logged (and
handed to ``on_crash``) instead of vanishing, and ``close()`` cancels and awaits all of them
with a timeout, so a daemon leaks no task on shutdown. Never use bare ``asyncio.create_task``
for a long-lived task in the daemons.
"""

from __future__ import annotations

import asyncio
import contextlib
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

    async def close(self, timeout: float = 5.0) -> None:
        """Cancel every task and wait (bounded) for them to finish."""
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        if tasks:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait(tasks, timeout=timeout)
        self._tasks.clear()
