"""Writing a data set's small files so that a crash leaves the old file or the new one.

A file is written beside its name (``NAME.tmp``), fsync'd, renamed over the name, and the
directory fsync'd, so a power loss never leaves a renamed file whose blocks were not
written. A data set's manifest is its commit: ``sailor data prepare`` removes the old one
before it writes anything (:func:`remove_durably`) and writes the new one last.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["fsync_dir", "remove_durably", "write_durably"]


def fsync_dir(path: Path) -> None:
    """Make the renames and removals in directory ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data``: the old content or the new, never a mix or zeros."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with tmp.open("wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def remove_durably(path: Path) -> None:
    """Remove ``path`` if it exists, durably (a crash after this never brings it back)."""
    try:
        path.unlink()
    except FileNotFoundError:
        return
    fsync_dir(path.parent)
