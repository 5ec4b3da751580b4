"""The supervisor's file work in the workers' run directory, off the agent's event loop.

The agent's event loop carries its heartbeats, its status and every command. A read or a
write in the run directory blocks in the kernel for as long as its file system does: on a
hard-mounted NFS whose server went away, for good, and the loop with it (no heartbeat, no
status, no command). :class:`RunDirIO` runs such work on one daemon thread of its own, in
the order it was asked for, and the loop waits for each piece at most ``timeout_s``: past
that it gets :class:`RunDirTimeoutError` (an ``OSError``) and goes on.

One thread, not the loop's default executor: a job stuck in the kernel never returns, and
would hold one of that executor's few threads for good (and the interpreter's exit joins
them); a daemon thread is left behind at exit. One thread, not one per job: the jobs run in
order (a control file's later state is written after its earlier one, never before it), and
a hung mount holds one thread, whatever number of jobs wait behind it (each of their waits
that runs out names the job holding the thread, and for how long it has run). A job whose wait
timed out before it began is dropped (the caller was told it failed; a later job carries
the newer state); one under way when its wait timed out ends whenever its file system
answers.

This module never decides what to read or write, and never touches a file itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

import structlog

__all__ = ["RUN_DIR_WAIT_S", "RunDirIO", "RunDirTimeoutError"]

_log = structlog.get_logger("sailor.agent")

T = TypeVar("T")

RUN_DIR_WAIT_S = 10.0
"""How long the agent waits for one piece of file work in a run directory before it gives
up on it (``Supervisor.io_wait_s``). A local read or write takes milliseconds; an NFS mount
whose server went away answers never (hard) or after its retries (soft: ``timeo=600`` and
``retrans=2``, minutes); the workers' own bounded record write waits as long
(``load_barrier.RECORD_WAIT_S``)."""


class RunDirTimeoutError(OSError):
    """File work in a run directory did not end within its bound (its file system does not
    answer). The work goes on, on its thread: it may still happen later."""

    def __init__(
        self, what: str, timeout_s: float, holder: str = "", holder_s: float = 0.0
    ) -> None:
        why = "its file system does not answer"
        if holder:
            why += f"; the thread is still on {holder}, for {holder_s:.1f} s"
        super().__init__(f"{what} within {timeout_s:g} s ({why})")
        self.what = what
        self.timeout_s = timeout_s
        self.holder = holder
        """The earlier work that held the thread when the wait ran out ('' if none did:
        this work's own file did not answer)."""
        self.holder_s = holder_s
        """How long that work had run by then."""


_Job = tuple[Callable[[], object], "Future[object]", str]


class RunDirIO:
    """One thread doing file work in order; :meth:`run` waits for one piece, bounded."""

    def __init__(self, name: str = "sailor-run-dir") -> None:
        self._name = name
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._running: tuple[str, float, Future[object]] | None = None
        """The work on the thread now: what it is, since when (``time.monotonic``), its
        future."""

    def submit(self, fn: Callable[[], T], what: str = "") -> Future[T]:
        """Queue ``fn`` (``what``: its name in a later wait's error) behind the work asked
        for before; its future, done once it ran. After :meth:`close`, ``fn`` runs on no
        thread and the future fails (RuntimeError)."""
        fut: Future[T] = Future()
        with self._lock:
            if self._closed:
                fut.set_exception(RuntimeError(f"{self._name}: closed"))
                return fut
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name=self._name, daemon=True)
                self._thread.start()
            self._jobs.put((fn, fut, what))  # type: ignore[arg-type]
        return fut

    async def run(self, fn: Callable[[], T], what: str, timeout_s: float) -> T:
        """``fn()``, run after the work asked for before, waited for ``timeout_s`` at most
        (the wait counts the work queued ahead of it: the same file system). ``what`` names
        the work in :class:`RunDirTimeoutError` ("error file X unreadable"), which also names
        an earlier piece still on the thread then, and for how long (one stuck for good fails
        every later wait: the error says which one). Past the bound (or cancelled) the work
        is dropped if it has not begun, else left to its thread."""
        fut = self.submit(fn, what)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(fut), timeout_s)
        except TimeoutError:
            holder, holder_s = "", 0.0
            running = self._running
            if running is not None and running[2] is not fut:
                holder, holder_s = running[0] or "earlier work", time.monotonic() - running[1]
            _log.warning(
                "run_dir_io_slow",
                what=what,
                timeout_s=timeout_s,
                behind=holder,
                behind_s=round(holder_s, 1),
            )
            raise RunDirTimeoutError(what, timeout_s, holder, holder_s) from None

    def held_s(self) -> float:
        """How long the work on the thread now has run (0 when idle): past a caller's bound,
        the thread is stuck and work queued now waits for it."""
        running = self._running
        return 0.0 if running is None else time.monotonic() - running[1]

    def close(self) -> None:
        """Take no more work; the thread ends after the work already queued (at once when
        there is none: a thread stuck in the kernel stays, a daemon, until it returns)."""
        with self._lock:
            self._closed = True
            if self._thread is not None:
                self._jobs.put(None)

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, fut, what = job
            if not fut.set_running_or_notify_cancel():
                continue
            self._running = (what, time.monotonic(), fut)
            try:
                result = fn()
            except BaseException as exc:  # the caller's to judge, on the loop
                with contextlib.suppress(Exception):
                    fut.set_exception(exc)
            else:
                fut.set_result(result)
            finally:
                self._running = None
