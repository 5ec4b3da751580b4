"""Named, guarded background tasks.

Every long-lived task of a daemon is created here: it has a name, its exception is logged (and
handed to ``on_crash``) instead of vanishing, and ``close()`` cancels and awaits all of them
with a timeout, so a daemon leaks no task on shutdown. Never use bare ``asyncio.create_task``
for a long-lived task in the daemons.

A crashed long-lived task must never pass in silence: either it is restarted (``keep``: with
exponential backoff, and after ``max_crashes`` crashes in a row handed to ``on_crash``), or
its crash goes to ``on_crash`` at once (``spawn``), whose owner takes the daemon down (a
non-zero exit; systemd restarts it). A TaskSet without ``on_crash`` is for tasks whose
owner notices their end by itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
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

    def keep(
        self,
        name: str,
        factory: Callable[[], Coroutine[Any, Any, Any]],
        *,
        backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        max_crashes: int = 5,
        healthy_s: float = 60.0,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> asyncio.Task[Any]:
        """Run ``factory()`` as a long-lived task, restarted when it crashes.

        Restarts wait ``backoff_s``, doubling up to ``max_backoff_s``; a run that lasted
        ``healthy_s`` resets the count and the delay. The ``max_crashes``-th crash in a row is
        not restarted but handed to ``on_crash`` (0: restart forever). Returning ends it.
        """

        async def supervise() -> Any:
            loop = asyncio.get_running_loop()
            crashes, delay = 0, backoff_s
            while True:
                started = loop.time()
                try:
                    return await factory()
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    if loop.time() - started >= healthy_s:
                        crashes, delay = 0, backoff_s
                    crashes += 1
                    if max_crashes and crashes >= max_crashes:
                        raise  # _guard logs it and calls on_crash
                    _log.error(
                        "task_restarting",
                        owner=self._owner,
                        task=name,
                        error=repr(exc),
                        crashes=crashes,
                        after_s=delay,
                    )
                await sleep(delay)
                delay = min(delay * 2, max_backoff_s)

        return self.spawn(name, supervise())

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
