"""A worker's own output, kept in a file of bounded size.

The agent reads each worker's stdout for its JSON progress lines and keeps the last lines of
its stderr for a failure's record; everything else was dropped. NCCL's diagnostics
(``NCCL_DEBUG=INFO``: the transport each channel uses, "falling back to NET/Socket", its
warnings) go to stdout, and a traceback printed before the last 20 stderr lines was lost.
:class:`RankLog` appends every line a worker writes on one stream to a file beside its error
record, up to a byte cap (a runaway writer must not fill the disk); past it, one line says so
and the rest is dropped. A file that cannot be written is given up with a warning: the
worker's supervision never depends on it.
"""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO

import structlog

__all__ = ["DEFAULT_CAP_BYTES", "RankLog"]

DEFAULT_CAP_BYTES = 64 << 20
"""Bytes kept per stream and worker process (64 MiB: hours of ``NCCL_DEBUG=INFO``)."""

_log = structlog.get_logger("sailor.agent")


class RankLog:
    """Append-only, capped copy of one stream of one worker."""

    def __init__(self, path: Path, cap_bytes: int = DEFAULT_CAP_BYTES) -> None:
        if cap_bytes <= 0:
            raise ValueError(f"cap_bytes={cap_bytes}: must be > 0")
        self.path = path
        self.cap_bytes = cap_bytes
        self.written = 0
        self.capped = False
        self._f: BinaryIO | None = None
        try:
            self._f = path.open("ab")
        except OSError as exc:
            _log.warning("rank_log_unwritable", path=str(path), error=str(exc))

    def write(self, line: bytes) -> None:
        """One line (its newline added if missing)."""
        if self._f is None or self.capped:
            return
        if not line.endswith(b"\n"):
            line += b"\n"
        try:
            if self.written + len(line) > self.cap_bytes:
                self.capped = True
                self._f.write(f"[sailor: log capped at {self.cap_bytes} bytes]\n".encode())
                self._f.flush()
                return
            self._f.write(line)
            self.written += len(line)
        except OSError as exc:
            _log.warning("rank_log_write_failed", path=str(self.path), error=str(exc))
            self.close()

    def close(self) -> None:
        if self._f is not None:
            try:
                self._f.close()
            except OSError as exc:
                _log.warning("rank_log_close_failed", path=str(self.path), error=str(exc))
            self._f = None
