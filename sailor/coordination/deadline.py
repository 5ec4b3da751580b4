"""A deadline that holds even when the awaited code does not end when cancelled.

``asyncio.wait_for`` ends its awaitable by cancelling it once and then waits, without bound,
for it to finish. Code that swallows that cancellation, or hangs on its way out, keeps the
caller waiting past its timeout. Both happen in nats-py on Python 3.11: its ``close()`` of a
client whose first connect was stopped during the TLS handshake waits for ever on the plain
socket's ``wait_closed()`` (seen here: a refused client, asked to give up after 2 s, hung
until the test's 10 min limit), and its ``wait_for`` calls may drop a cancellation that
arrives in the same loop turn as their result (the race CPython 3.12's ``wait_for`` fixed).

``within`` runs the awaitable as a task and, at the deadline, cancels it again every
``recancel_s`` until it ends, for at most ``grace_s``; whatever it does, the caller has an
answer at most ``timeout_s + grace_s`` later: ``TimeoutError``, or the task's own outcome if
it ended otherwise than cancelled (it finished anyway, or raised its own error).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

import structlog

__all__ = ["within"]

_log = structlog.get_logger("sailor.deadline")

T = TypeVar("T")


async def within(
    coro: Coroutine[Any, Any, T],
    timeout_s: float,
    what: str,
    grace_s: float = 2.0,
    recancel_s: float = 0.05,
) -> T:
    """``await coro``, or ``TimeoutError`` once ``timeout_s`` has passed and the task has
    ended (or ``grace_s`` more has passed). A cancellation of the caller cancels the task."""
    if timeout_s <= 0 or grace_s < 0 or recancel_s <= 0:
        raise ValueError(
            f"timeout_s={timeout_s}, grace_s={grace_s}, recancel_s={recancel_s}: "
            "need timeout_s > 0, grace_s >= 0, recancel_s > 0"
        )
    task = asyncio.ensure_future(coro)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
    except asyncio.CancelledError:
        await _stop(task, grace_s, recancel_s, what)
        raise
    if done:
        return task.result()
    if await _stop(task, grace_s, recancel_s, what) and not task.cancelled():
        # it ended by itself after all (or turned the cancellation into its own outcome)
        return task.result()
    raise TimeoutError(f"{what}: no answer within {timeout_s:g} s")


async def _stop(task: asyncio.Future[Any], grace_s: float, recancel_s: float, what: str) -> bool:
    """Cancel ``task`` until it ends or ``grace_s`` passes; whether it ended."""
    loop = asyncio.get_running_loop()
    end = loop.time() + grace_s
    cancels = 0
    while not task.done():
        left = end - loop.time()
        if left <= 0:
            _log.warning("task_ignores_cancel", what=what, cancels=cancels)
            # its exception, if it ever raises one, is not "never retrieved"
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
            return False
        task.cancel()
        cancels += 1
        await asyncio.wait({task}, timeout=min(recancel_s, left))
    if cancels > 1:
        _log.debug("task_needed_recancel", what=what, cancels=cancels)
    return True
