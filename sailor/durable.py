"""Replacing or removing a small file so that a crash leaves the old file or the new one.

The one way Sailor writes a small file whose loss or tearing matters: a data set's manifest,
the agent's epoch fence and its workers' control files, the toy trainer's checkpoint parts
and commit marker, the CLI's JSON outputs, the profile database, a profiling rank's result
and the demo's preemption notice; the checkpoint storage syncs its directories with
:func:`fsync_dir`. A file is written beside its name (``NAME`` + a temporary suffix),
fsync'd, renamed over the name, and its directory fsync'd. Without the file's fsync a power
loss can leave the renamed name with blocks never written (empty or zeros: ext4's delayed
allocation); without the directory's, the rename itself (or a removal) can be undone.

It sits at the bottom of the layers, beside ``sailor.schemas``, so that every layer may use
it; it must never import anything of Sailor's, and never decide what a failure means for
its caller: it raises ``OSError`` as the system gives it, and the caller maps it (the
checkpoint storage's ``StorageError``, the agent's refusal of a command, a rank's error file).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
from collections.abc import Callable
from pathlib import Path

__all__ = [
    "FSYNC_UNSUPPORTED",
    "fsync_dir",
    "make_dirs_durably",
    "remove_durably",
    "write_durably",
]

FSYNC_UNSUPPORTED = frozenset({errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF})
"""What opening or fsyncing a directory raises where the file system cannot do it (some
FUSE and network file systems: EINVAL, ENOTSUP, EBADF): the rename's durability is the
file system's there, as it always is. Anything else (EIO, ENOSPC, EROFS, ...) is the
storage failing."""


def fsync_dir(path: Path, *, skip_unsupported: bool = False) -> None:
    """Make the entries of directory ``path`` durable (a rename, a new file or subdirectory,
    a removal). ``skip_unsupported``: return quietly where the file system cannot fsync a
    directory (:data:`FSYNC_UNSUPPORTED`); any other failure raises ``OSError`` either way."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        if skip_unsupported and exc.errno in FSYNC_UNSUPPORTED:
            return
        raise
    try:
        os.fsync(fd)
    except OSError as exc:
        if not (skip_unsupported and exc.errno in FSYNC_UNSUPPORTED):
            raise
    finally:
        os.close(fd)


def make_dirs_durably(path: Path, sync: Callable[[Path], None] = fsync_dir) -> None:
    """Make directory ``path`` and its missing parents, each new one's entry fsync'd in its
    parent (a file written into it must not vanish with its directory after a power loss).
    ``sync(directory)`` does the fsync (a caller mapping its errors passes its own)."""
    missing = []
    q = path
    while not q.is_dir() and q != q.parent:
        missing.append(q)
        q = q.parent
    path.mkdir(parents=True, exist_ok=True)
    for made in reversed(missing):
        sync(made.parent)


def write_durably(
    path: Path,
    data: bytes,
    *,
    tmp_suffix: str = ".tmp",
    make_dirs: bool = False,
    skip_unsupported: bool = False,
) -> None:
    """Replace ``path`` with ``data``: after a crash at any moment ``path`` holds its old
    content (or is absent, if it was) or ``data``, never a mix or zeros; once this returns,
    ``data`` survives a power loss.

    ``tmp_suffix``: the temporary file is ``NAME`` + this, in the same directory (so the
    rename is atomic). Writers that may race over one name give each its own (their pid); a
    temporary file a crash left is overwritten by the next write with the same suffix. It
    is removed when the write fails after creating it, and never touched otherwise (a
    directory or another writer's file standing at that name stays).

    ``make_dirs``: make the missing directories first (:func:`make_dirs_durably`), and make
    them again, once, if they go before the temporary file opens (a cleaner that removes
    emptied directories, e.g. the deletion of a checkpoint given up on).

    ``skip_unsupported``: where the file system cannot fsync a directory
    (:data:`FSYNC_UNSUPPORTED`), the directories' syncs are skipped (:func:`fsync_dir`), for a
    file a user names anywhere (a command's output); the file's own fsync never is."""
    tmp = path.with_name(path.name + tmp_suffix)
    sync_dir = functools.partial(fsync_dir, skip_unsupported=skip_unsupported)
    if make_dirs:
        make_dirs_durably(path.parent, sync_dir)
    try:
        fh = tmp.open("wb")
    except FileNotFoundError:
        if not make_dirs:
            raise
        make_dirs_durably(path.parent, sync_dir)
        fh = tmp.open("wb")
    try:
        with fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        tmp.replace(path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    sync_dir(path.parent)


def remove_durably(path: Path) -> None:
    """Remove ``path`` if it exists, durably (a crash after this never brings it back)."""
    try:
        path.unlink()
    except FileNotFoundError:
        return
    fsync_dir(path.parent)
