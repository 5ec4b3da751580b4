"""The largest token id of a data set without a manifest, scanned once per version of its file;
and every id of a file checked against its vocabulary, on request (``sailor data info``).

A data set prepared elsewhere (Megatron's tools) has no manifest to give its vocabulary size,
so the engine checks that the model can embed every id by the largest one in the ``.bin``.
That is one pass over the whole file: on a large corpus, minutes of I/O for every rank at
every start, and a run that reconfigures restarts often. The pass is done once per version of
the file: its result is kept beside it in ``PREFIX.scan.json`` with the ``.bin``'s size and
modification time, and read back while both match. Where the directory cannot be written
(a read-only mount), the scan is repeated as before. The ranks of a first start take turns
on a lock file beside it (``PREFIX.scan.lock``, ``flock``): one scans and records, the others
wait and read the record, so a multi-terabyte corpus on a shared file system is read once,
not once per rank at the same time. Where no lock can be taken (a read-only directory, a
file system without locks), each rank scans, as before. A rewrite of the ``.bin`` that keeps
its size within the file system's timestamp resolution would not be seen.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sailor.data.indexed import IndexedDataset
from sailor.schemas.json_text import load_json

__all__ = ["IdRange", "id_range", "max_token_id", "scan_path"]

_CHUNK = 1 << 24
"""Tokens per chunk of :func:`id_range` (64 MB of int32): its memory stays bounded."""


def scan_path(ds: IndexedDataset) -> Path:
    """Where the scan of ``ds`` is kept: ``PREFIX.scan.json``."""
    return ds.idx_path.with_suffix(".scan.json")


def _version(ds: IndexedDataset) -> dict[str, int]:
    st = ds.bin_path.stat()
    return {"bin_bytes": st.st_size, "bin_mtime_ns": st.st_mtime_ns}


def _recorded(path: Path, version: dict[str, int]) -> int | None:
    try:
        doc = load_json(path.read_text(), str(path))
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or any(doc.get(k) != v for k, v in version.items()):
        return None
    m = doc.get("max_token")
    return m if isinstance(m, int) and not isinstance(m, bool) and m >= 0 else None


def _scan(ds: IndexedDataset) -> int:
    return int(ds.document_tokens(0, ds.num_documents).max(initial=0))


@contextlib.contextmanager
def _turn(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if needed); no lock where none can
    be taken."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:
        yield
        return
    try:
        with contextlib.suppress(OSError):  # ENOLCK, EOPNOTSUPP: a file system without locks
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


@dataclass(frozen=True)
class IdRange:
    """The ids of a whole ``.bin`` (:func:`id_range`)."""

    low: int
    """The smallest id (0 when the file holds none)."""
    high: int
    """The largest id (0 when the file holds none)."""
    bad: int
    """Ids outside ``[0, vocab_size)``: 0 without a vocabulary to judge by (negative ids are
    counted whatever it is)."""
    first_bad: tuple[int, int] | None
    """(token offset in the ``.bin``, id) of the first of them; None when there is none."""


def id_range(ds: IndexedDataset, vocab_size: int | None = None) -> IdRange:
    """Every id of ``ds`` read once, in chunks (``sailor data info``): the smallest, the
    largest and those outside ``[0, vocab_size)``. Not recorded: an operator asks for it."""
    toks = ds.document_tokens(0, ds.num_documents)
    low = high = 0
    bad = 0
    first: tuple[int, int] | None = None
    bound = vocab_size
    for start in range(0, len(toks), _CHUNK):
        part = np.asarray(toks[start : start + _CHUNK])
        lo, hi = int(part.min()), int(part.max())
        low, high = (lo, hi) if start == 0 else (min(low, lo), max(high, hi))
        if lo >= 0 and (bound is None or hi < bound):
            continue
        out = (part < 0) if bound is None else (part < 0) | (part >= bound)
        bad += int(out.sum())
        if first is None:
            at = int(np.argmax(out))
            first = (start + at, int(part[at]))
    return IdRange(low, high, bad, first)


def max_token_id(ds: IndexedDataset) -> int:
    """The largest token id in ``ds`` (0 when it holds none): the record beside it when it
    describes this version of the ``.bin``, else one pass over the file by whichever rank
    takes the lock first (then recorded, atomically; the others read the record; a
    directory that cannot be written only costs the next start a scan)."""
    path = scan_path(ds)
    version = _version(ds)
    hit = _recorded(path, version)
    if hit is not None:
        return hit
    with _turn(path.with_suffix(".lock")):
        hit = _recorded(path, version)  # another rank's, made while this one waited
        if hit is not None:
            return hit
        found = _scan(ds)
        _record(path, {**version, "max_token": found})
    return found


def _record(path: Path, doc: dict[str, int]) -> None:
    try:
        fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
    except OSError:  # the directory cannot be written
        return
    try:
        os.fchmod(fd, 0o644)  # readable by every user of a shared data directory
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f)
        Path(tmp).replace(path)
    except OSError:
        Path(tmp).unlink(missing_ok=True)
