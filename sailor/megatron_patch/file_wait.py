"""Sleep until a file is replaced or a signal arrives: a wait that costs no CPU while idle.

A warm spare waits for its first directive for as long as its agent keeps it (hours), and a
held rank waits up to ``--pause-timeout-s``; both waited by reading their control file every
``--poll-s`` (20 ms). Measured on this 2-core host (a real spare started as the agent does,
``/proc/<pid>/stat`` utime+stime over 5 s): 1.4-1.8 % of a core and ~50 wake-ups/s for each
idle spare, taken from the data loader and the agent on a GPU node. :class:`FileWait` blocks
in ``poll`` instead (not ``select``, which refuses an fd numbered 1024 or above: a held rank
of a long job can hold that many), on

- an inotify watch of the file's directory (Linux): the agent replaces the control file
  atomically (write a temporary file, rename it over), which is ``IN_MOVED_TO`` with the
  file's name; ``IN_CLOSE_WRITE`` covers a writer that rewrites it in place;
- the signal wake-up fd (``signal.set_wakeup_fd``): a SIGTERM whose handler only sets a flag
  wakes the wait at once (Python retries an interrupted ``select`` on its own, PEP 475, so
  without it the flag would be seen only at the next event or recheck).

The hand-over (the rename to the wait's return, the writer in another process:
``benchmarks/spare_wait.py``, load 6 on the 2 cores) went from a median of 9-12 ms (max 21-34)
polling to 0.5-0.6 ms (max 6-9). One inotify fd serves the whole process and is never closed:
closing one waits for an RCU grace period (10-25 ms measured here, which first made the
blocking hand-over slower than the poll); a watch is added per wait and removed after it,
which does not wait.

Every ``recheck_s`` (1 s) it returns anyway: an event missed (a queue overflow, a file system
without inotify events for this writer) costs at most that much latency, and an idle waiter
~1 wake-up/s. A directory removed or moved away ends its watch (``IN_IGNORED``): the wait
returns and watches the path again, so a directory made anew is watched too (until it
exists again, each wait tries the watch again and sleeps ``poll_s``). Where inotify or the
wake-up fd is unavailable (not Linux, not the main thread), :meth:`FileWait.wait` sleeps
``poll_s`` as the loop always did.

The caller reads the file after every return: a return says "look now", never what changed.
This module never reads the file and never decides anything: the directive is the caller's.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import select
import signal
import struct
import sys
import threading
import time
from pathlib import Path
from types import TracebackType

__all__ = ["RECHECK_S", "FileWait", "concerns", "ended"]

RECHECK_S = 1.0
"""Longest blocking wait without an event: the latency of a missed event, the idle wake-up
rate (1/s instead of 50/s)."""

# <sys/inotify.h>
_IN_CLOSE_WRITE = 0x008
_IN_MOVED_TO = 0x080
_IN_CREATE = 0x100
_IN_DELETE_SELF = 0x400
_IN_MOVE_SELF = 0x800
_IN_Q_OVERFLOW = 0x4000
_IN_IGNORED = 0x8000
_IN_NONBLOCK = os.O_NONBLOCK
_IN_CLOEXEC = 0o2000000
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then len bytes of name
_WATCH = _IN_CLOSE_WRITE | _IN_MOVED_TO | _IN_CREATE | _IN_DELETE_SELF | _IN_MOVE_SELF
_LOOK = _IN_CLOSE_WRITE | _IN_MOVED_TO | _IN_CREATE  # with the file's name
_LOST = _IN_Q_OVERFLOW | _IN_IGNORED | _IN_DELETE_SELF | _IN_MOVE_SELF  # any name


_instance = -1  # this process's inotify fd (main thread only); -2: there is none


def _inotify() -> int:
    """This process's inotify fd, made on first use and kept: closing one costs 10-25 ms
    (the kernel waits for an RCU grace period; measured here, 15 of a spare's 17 ms
    hand-over), while removing a watch does not wait. -1 where there is none (not Linux)."""
    global _instance
    if _instance == -1:
        _instance = -2
        if sys.platform.startswith("linux"):
            with contextlib.suppress(OSError, AttributeError):
                fd = int(_libc().inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC))
                _instance = fd if fd >= 0 else -2
    return _instance if _instance >= 0 else -1


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def ended(events: bytes, wd: int) -> bool:
    """Whether a batch of inotify events ends watch ``wd`` (``IN_IGNORED``: the directory
    was removed or moved away, or the watch removed)."""
    off = 0
    while off + _EVENT.size <= len(events):
        got_wd, mask, _cookie, length = _EVENT.unpack_from(events, off)
        off += _EVENT.size + length
        if got_wd == wd and mask & _IN_IGNORED:
            return True
    return False


def concerns(events: bytes, wd: int, name: bytes) -> bool:
    """Whether a batch of inotify events read from the fd may have changed file ``name`` of
    watch ``wd``: an event naming it, or one after which nothing can be told (the watch
    gone, events lost). Events of other (earlier, removed) watches do not."""
    off = 0
    while off + _EVENT.size <= len(events):
        got_wd, mask, _cookie, length = _EVENT.unpack_from(events, off)
        got = events[off + _EVENT.size : off + _EVENT.size + length].rstrip(b"\0")
        off += _EVENT.size + length
        if mask & _IN_Q_OVERFLOW:
            return True
        if got_wd == wd and (mask & _LOST or (mask & _LOOK and got == name)):
            return True
    return False


class FileWait:
    """``with FileWait(path, poll_s) as w: ... w.wait(timeout_s)`` (see the module). One at a
    time in a process: the inotify fd and the signal wake-up fd are the process's. While one
    is open, a signal's byte goes to its pipe, not to a wake-up fd set before it (asyncio's
    ``add_signal_handler``: no worker runs an event loop while it waits); the previous fd is
    set again at the exit, with ``warn_on_full_buffer`` at its default."""

    def __init__(self, path: Path | str, poll_s: float, recheck_s: float = RECHECK_S) -> None:
        self.path = Path(path)
        self.poll_s = poll_s
        self.recheck_s = recheck_s
        self._name = os.fsencode(self.path.name)
        self._wd = -1
        self._pipe: tuple[int, int] | None = None
        self._old_wakeup = -1

    @property
    def blocking(self) -> bool:
        """True if :meth:`wait` blocks on events (inotify and the signal wake-up fd)."""
        return self._wd >= 0 and self._pipe is not None

    def __enter__(self) -> FileWait:
        if threading.current_thread() is not threading.main_thread():
            return self  # signals are delivered to the main thread only: poll as before
        fd = _inotify()
        if fd < 0:
            return self
        _drain(fd)  # what earlier watches left (their removal's IN_IGNORED)
        self._watch(fd)
        if self._wd < 0:
            return self
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        try:
            self._old_wakeup = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        except ValueError:
            os.close(r)
            os.close(w)
            return self
        self._pipe = (r, w)
        return self

    def __exit__(
        self,
        _t: type[BaseException] | None,
        _e: BaseException | None,
        _tb: TracebackType | None,
    ) -> None:
        if self._pipe is not None:
            signal.set_wakeup_fd(self._old_wakeup)
            for fd in self._pipe:
                os.close(fd)
            self._pipe = None
        if self._wd >= 0:
            _libc().inotify_rm_watch(_inotify(), self._wd)
            self._wd = -1

    def _watch(self, fd: int) -> None:
        """Watch the file's directory (-1: it cannot be watched, e.g. it does not exist)."""
        self._wd = int(_libc().inotify_add_watch(fd, os.fsencode(self.path.parent), _WATCH))

    def wait(self, timeout_s: float) -> None:
        """Return once the file may have changed, a signal arrived, or after ``timeout_s``
        (at most ``recheck_s``); without events, after ``min(poll_s, timeout_s)``."""
        fd = _inotify()
        if self._pipe is not None and self._wd < 0:
            self._watch(fd)  # the directory went at an earlier wait: watch it if it is back
        if not self.blocking or self._pipe is None:
            time.sleep(max(0.0, min(self.poll_s, timeout_s)))
            return
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        poller.register(self._pipe[0], select.POLLIN)
        end = time.monotonic() + max(0.0, min(self.recheck_s, timeout_s))
        while True:
            left = end - time.monotonic()
            if left <= 0:
                return
            ready = {f for f, _ in poller.poll(left * 1000.0)}
            if self._pipe[0] in ready:
                _drain(self._pipe[0])
                return
            if fd in ready:
                events = _drain(fd)
                if ended(events, self._wd):  # the directory went: look now, watch it anew
                    self._watch(fd)
                    return
                if concerns(events, self._wd, self._name):
                    return


def _drain(fd: int) -> bytes:
    """Everything readable on a non-blocking fd now."""
    out = b""
    with contextlib.suppress(BlockingIOError, InterruptedError):
        while chunk := os.read(fd, 65536):
            out += chunk
    return out
