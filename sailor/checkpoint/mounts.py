"""Which storage a checkpoint root lives on, judged without touching it.

A save whose write hangs (an NFS server gone) makes every other root on the same storage
suspect: a new write there would most likely hang the same way. Two roots are on one
storage (:func:`storage_of`) when

- both are object-store URLs (``s3://``, ``gs://``, any ``scheme://`` but ``file://``) of the
  same scheme and bucket (the URL's authority): the same endpoint and bucket;
- both are local paths whose file system is one, found from the process's mount table
  (``/proc/self/mountinfo``: :func:`parse_mountinfo`, read by :func:`read_mounts`) by the
  longest mount point that is a prefix of the path, and not hidden by a later mount at or
  above it: the same device (``major:minor``: a
  bind mount of the file system and the mount itself count as one), or, for network file
  systems whose source names a server (NFS ``host:/export``, CIFS ``//host/share``), the
  same server: a server gone hangs every mount of its exports.

Never a ``stat``, ``realpath`` or ``open`` of the root: on a hung mount each would hang too.
So a path is judged as written (normalised, made absolute against the working directory): a
root reached through a symbolic link into another mount is judged by where the link lives.
Without a mount table (not Linux, unreadable) a local root is its own storage (its
normalised path), as before mounts were looked at; so is a root on an automounter's
trigger (``autofs``: the server it mounts there on first use is not in the table yet).
Pure, but for :func:`read_mounts`.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

__all__ = [
    "MOUNTINFO",
    "NETWORK_FS",
    "Mount",
    "parse_mountinfo",
    "read_mounts",
    "same_storage",
    "storage_of",
]

MOUNTINFO = "/proc/self/mountinfo"

NETWORK_FS = frozenset({"nfs", "nfs4", "cifs", "smb3", "smbfs"})
"""File systems whose mount source names the server (``host:/export``, ``//host/share``):
two mounts from one server count as one storage."""


@dataclass(frozen=True)
class Mount:
    """One line of a mount table: where it is mounted and what is mounted there."""

    mount_point: str
    device: str
    """``major:minor`` of the mounted file system (the same for its bind mounts)."""
    fstype: str
    source: str


_ESCAPE = re.compile(r"\\([0-7]{3})")


def _unescape(field: str) -> str:
    """A mountinfo path field: the kernel writes space, tab, newline and backslash as octal
    escapes (``\\040``)."""
    return _ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str) -> tuple[Mount, ...]:
    """The mounts of a ``/proc/<pid>/mountinfo`` text, in its order (a later line mounted
    later: it hides an earlier one at the same point). A line that does not parse (no
    ``-`` separator, too few fields) is skipped: one odd line must not hide the others."""
    out: list[Mount] = []
    for line in text.splitlines():
        fields = line.split()
        if "-" not in fields[6:]:
            continue
        sep = fields.index("-", 6)
        if len(fields) < sep + 3:
            continue
        point = _unescape(fields[4])
        out.append(Mount(point, fields[2], fields[sep + 1], _unescape(fields[sep + 2])))
    return tuple(out)


def read_mounts(path: str = MOUNTINFO) -> tuple[Mount, ...]:
    """This process's mount table; empty if it cannot be read (then roots are compared as
    paths). Reading it asks the kernel, not a mounted file system, but it takes the mount
    namespace's lock: while an unmount of a hung mount is stuck it can block too (callers
    that must not wait read it on a thread, bounded: ``ckpt_glue``)."""
    try:
        return parse_mountinfo(Path(path).read_text(encoding="utf-8", errors="surrogateescape"))
    except OSError:
        return ()


def _server(m: Mount) -> str | None:
    """The server a network mount's source names, or None."""
    if m.fstype not in NETWORK_FS:
        return None
    src = m.source
    if src.startswith("//"):  # CIFS: //host/share
        host = src[2:].split("/", 1)[0]
    elif ":" in src:  # NFS: host:/export, [v6addr]:/export
        host = src.rsplit(":", 1)[0] if src.startswith("[") else src.split(":", 1)[0]
    else:
        return None
    return host.lower() or None


def _under(path: str, point: str) -> bool:
    return point == "/" or path == point or path.startswith(point.rstrip("/") + "/")


def storage_of(root: str, mounts: Sequence[Mount], cwd: str = "/") -> str:
    """A key naming the storage ``root`` lives on: equal keys, one storage (module
    docstring). ``cwd`` anchors a relative path (the caller's working directory)."""
    r = root[len("file://") :] if root.startswith("file://") else root
    if "://" in r:
        u = urlsplit(r)
        return f"url:{u.scheme.lower()}://{u.netloc}"
    # normpath keeps a leading '//' (POSIX leaves it to the system); Linux takes it as '/'
    path = "/" + posixpath.normpath(posixpath.join(cwd, r)).lstrip("/")
    best = _mount_of(path, mounts)
    if best is None or best.fstype == "autofs":
        # an automounter's trigger: what it mounts there (each server of /net) is not in
        # the table until first used, so the path is all that is known
        return f"path:{path}"
    server = _server(best)
    return f"server:{server}" if server else f"dev:{best.device}"


def _mount_of(path: str, mounts: Sequence[Mount]) -> Mount | None:
    """The mount ``path`` is on: of the mounts whose point is a prefix of it, the one with
    the longest point that no later mount hides. A later mount at or above a point hides
    what was mounted there (``/mnt/x/y`` mounted, then ``/mnt/x`` over it: ``/mnt/x/y/c``
    is on the second). A mount hiding one of these is one of these too (its point is a
    prefix of theirs, so of the path): only they are looked at, in the table's order."""
    seen: list[Mount] = []
    for m in mounts:
        if _under(path, m.mount_point):
            seen = [e for e in seen if not _under(e.mount_point, m.mount_point)]
            seen.append(m)
    return max(seen, key=lambda m: len(m.mount_point), default=None)


def same_storage(a: str, b: str, mounts: Sequence[Mount], cwd: str | None = None) -> bool:
    """Whether roots ``a`` and ``b`` live on one storage (:func:`storage_of`)."""
    if cwd is None:
        try:
            cwd = str(Path.cwd())
        except OSError:  # removed: a relative root then counts from /
            cwd = "/"
    return storage_of(a, mounts, cwd) == storage_of(b, mounts, cwd)
