"""A worker's own output, kept in a file of bounded size, written off the agent's loop.

The agent reads each worker's stdout for its JSON progress lines and keeps the last lines of
its stderr for a failure's record; everything else was dropped. NCCL's diagnostics
(``NCCL_DEBUG=INFO``: the transport each channel uses, "falling back to NET/Socket", its
warnings) go to stdout, and a traceback printed before the last 20 stderr lines was lost.
:class:`RankLog` appends every line a worker writes on one stream to a file beside its error
record, up to a byte cap (a runaway writer must not fill the disk); past it, one line says so
and the rest is dropped. A file that cannot be written is given up with a warning: the
worker's supervision never depends on it.

The file lives in the generation's run directory, which may be on a mount that hangs. The
agent's loop only queues each line (:meth:`RankLog.write` never blocks); a thread of the
log's own opens the file and writes them. Lines queued and not yet written are bounded
(:data:`PENDING_CAP_BYTES`): past it they are dropped, counted, and one line in the file
says how many bytes went missing once it is written again (or, if no line comes after,
when the log is closed). Before, the loop wrote each line
itself: a write that hung held the agent's heartbeats, status and commands.
"""

from __future__ import annotations

import queue
import threading
from pathlib import Path
from typing import BinaryIO

import structlog

__all__ = ["DEFAULT_CAP_BYTES", "PENDING_CAP_BYTES", "RankLog"]

DEFAULT_CAP_BYTES = 64 << 20
"""Bytes kept per stream and worker process (64 MiB: hours of ``NCCL_DEBUG=INFO``)."""

PENDING_CAP_BYTES = 4 << 20
"""Bytes queued for the file and not yet written, per stream and worker, beyond which lines
are dropped (a file system that does not answer must not grow the agent's memory)."""

_log = structlog.get_logger("sailor.agent")


class RankLog:
    """Append-only, capped copy of one stream of one worker."""

    def __init__(
        self,
        path: Path,
        cap_bytes: int = DEFAULT_CAP_BYTES,
        pending_cap_bytes: int = PENDING_CAP_BYTES,
    ) -> None:
        if cap_bytes <= 0:
            raise ValueError(f"cap_bytes={cap_bytes}: must be > 0")
        if pending_cap_bytes <= 0:
            raise ValueError(f"pending_cap_bytes={pending_cap_bytes}: must be > 0")
        self.path = path
        self.cap_bytes = cap_bytes
        self.pending_cap_bytes = pending_cap_bytes
        self.written = 0
        """Bytes taken for the file (queued or written), against ``cap_bytes``."""
        self.capped = False
        self.dropped = 0
        """Bytes dropped because the file did not keep up (``pending_cap_bytes``) and not yet
        said so in it (the next line that fits, or the close, does)."""
        self._closed = False
        self._pending = 0
        self._lock = threading.Lock()
        self._lines: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._done = threading.Event()
        threading.Thread(target=self._drain, name=f"sailor-log-{path.name}", daemon=True).start()

    def write(self, line: bytes) -> None:
        """One line (its newline added if missing), queued for the file: never blocks."""
        if self._closed or self.capped:
            return
        if not line.endswith(b"\n"):
            line += b"\n"
        if self.written + len(line) > self.cap_bytes:
            self.capped = True
            self._put(f"[sailor: log capped at {self.cap_bytes} bytes]\n".encode())
            return
        with self._lock:
            if self._pending + len(line) > self.pending_cap_bytes:
                self.dropped += len(line)
                return
            missed, self.dropped = self.dropped, 0
        if missed:
            self._put(_missed_note(missed))
        self.written += len(line)
        self._put(line)

    def close(self) -> None:
        """No more lines; the thread writes those queued, closes the file and ends (it does
        not wait: :meth:`wait_closed`)."""
        if not self._closed:
            self._closed = True
            with self._lock:
                missed, self.dropped = self.dropped, 0
            if missed:  # no later line will carry the note: the file's last says so
                self._put(_missed_note(missed))
            self._lines.put(None)

    def wait_closed(self, timeout_s: float) -> bool:
        """Wait (blocking: a thread's call, not the loop's) until the file is closed with
        every line queued before :meth:`close` in it, at most ``timeout_s``; True if so."""
        return self._done.wait(timeout_s)

    def _put(self, data: bytes) -> None:
        with self._lock:
            self._pending += len(data)
        self._lines.put(data)

    def _drain(self) -> None:
        f: BinaryIO | None = None
        try:
            f = self.path.open("ab")
        except OSError as exc:
            _log.warning("rank_log_unwritable", path=str(self.path), error=str(exc))
        while True:
            data = self._lines.get()
            if data is None:
                break
            with self._lock:
                self._pending -= len(data)
            if f is None:
                continue
            try:
                f.write(data)
                if self._lines.empty():
                    f.flush()  # a reader (or a crash of the agent) sees what came so far
            except OSError as exc:
                _log.warning("rank_log_write_failed", path=str(self.path), error=str(exc))
                _close(f, self.path)
                f = None
        if f is not None:
            _close(f, self.path)
        self._done.set()


def _missed_note(missed: int) -> bytes:
    """The line that says ``missed`` bytes were dropped (the file did not keep up)."""
    return f"[sailor: {missed} bytes not kept: the log file did not keep up]\n".encode()


def _close(f: BinaryIO, path: Path) -> None:
    try:
        f.close()
    except OSError as exc:
        _log.warning("rank_log_close_failed", path=str(path), error=str(exc))
