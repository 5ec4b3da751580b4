"""Reading a new commit back before retention deletes the checkpoints older than it.

A committer deletes older steps once its own commit is written (``gc.apply_retention``,
``gc.apply_prune``). The commit was never read: after in-place reconfigurations, which keep
the weights in memory and load nothing, the only steps left on disk may be ones nobody ever
read. So before anything is deleted the new commit is read back (:func:`read_back`), and one
that fails keeps every older step (the caller reports it).

What is read, and why the cost is bounded whatever the checkpoint's size:

- the commit marker and the manifest (a few KB to a few MB): the marker's SHA-256 of the
  manifest and the manifest's schema (``reader.read_manifest``);
- every shard the manifest names: its size (one ``stat`` or HEAD per file, no data): a file
  missing, truncated or overwritten with other contents of another size;
- checksummed data within a byte budget (``budget_bytes``, default :data:`READBACK_BYTES`):
  of each shard, the last block of its last tensor (the file's tail: where a torn or
  short write shows), then the first block of its first tensor (its head), tails of every
  shard before any head, a block larger than what is left of the budget skipped. Each block
  is checked against its digest in the manifest (``blocks.py``); a checkpoint written before
  blocks (one digest per tensor) is checked whole where the tensor fits in the budget.

Reads at most ``budget_bytes`` of shard data plus the manifest, in one request per block,
one after another. A 104 MB checkpoint of 8 shards (``benchmarks/readback_cost.py``, page
cache warm, as for a commit just written): 1.1-1.7 ms, 4.3 MB read, against 19-100 ms for
``verify``, which reads every byte; with whole-tensor blocks (rows not divisible into
blocks) 3-10 ms for 35 MB. The budget caps it at a 70B model's size too.

It is not ``verify``: a flipped bit in the middle of a shard passes. It proves what
retention needs: the commit is there, complete, parses, and its files hold the data it
names at both ends.

Never deletes or writes anything.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from sailor.checkpoint.blocks import ALGORITHMS, block_digests, digest, rows_of
from sailor.checkpoint.errors import CheckpointError
from sailor.checkpoint.format import step_dir
from sailor.checkpoint.reader import read_manifest
from sailor.checkpoint.storage import Storage
from sailor.schemas.checkpoint import ShardEntry, TensorEntry

__all__ = ["READBACK_BYTES", "ReadBack", "read_back"]

READBACK_BYTES = 64 << 20
"""Shard bytes checked at most per commit. ``verify`` read and checked 104 MB in 19-100 ms
here (page cache warm), so this costs well under 0.1 s after a save of any size; a cold
cache or an object store adds its read time (not measured here)."""


@dataclass(frozen=True)
class ReadBack:
    """What reading a commit back found."""

    step: int
    problems: tuple[str, ...]
    """One message per failure ('' nowhere: empty means the commit read back)."""
    shards: int
    """Shard files whose size was checked."""
    blocks: int
    """Checksummed blocks read and checked."""
    bytes_read: int
    """Shard bytes read (the manifest and marker not counted)."""
    seconds: float

    @property
    def ok(self) -> bool:
        return not self.problems


def read_back(storage: Storage, step: int, *, budget_bytes: int = READBACK_BYTES) -> ReadBack:
    """Read the commit of ``step`` back within ``budget_bytes`` (module docstring)."""
    if budget_bytes < 0:
        raise ValueError(f"budget_bytes={budget_bytes}: must be >= 0")
    t0 = time.perf_counter()
    d = step_dir(step)
    try:
        manifest = read_manifest(storage, step)
    except (CheckpointError, ValueError, OSError) as exc:
        return ReadBack(step, (f"{type(exc).__name__}: {exc}",), 0, 0, 0, time.perf_counter() - t0)
    problems: list[str] = []
    sized: list[ShardEntry] = []
    for sh in manifest.shards:
        where = f"{storage.url.rstrip('/')}/{d}/{sh.path}"
        try:
            size = storage.size(f"{d}/{sh.path}")
        except FileNotFoundError:
            problems.append(f"{where}: missing")
            continue
        except OSError as exc:
            problems.append(f"{where}: cannot stat: {exc}")
            continue
        if size != sh.size:
            problems.append(f"{where}: {size} bytes, the manifest says {sh.size}")
        elif sh.checksum not in ALGORITHMS:
            problems.append(f"{where}: checksum algorithm {sh.checksum!r} unavailable here")
        else:
            sized.append(sh)
    left = budget_bytes
    blocks = nread = 0
    for sh, t, b in _candidates(sized):
        lo, hi = _block_range(t, b)
        if hi - lo > left:
            continue
        where = f"{storage.url.rstrip('/')}/{d}/{sh.path}"
        try:
            data = storage.read(f"{d}/{sh.path}", lo, hi - lo)
        except OSError as exc:
            problems.append(f"{where}: read of bytes {lo}..{hi} failed: {exc}")
            continue
        left -= hi - lo
        nread += len(data)
        blocks += 1
        want = t.sha256 if t.block_rows == 0 else t.blocks[b]
        got = "" if len(data) != hi - lo else _digest(sh.checksum, t, memoryview(data))
        if got != want:
            problems.append(
                f"{where}: tensor {t.name} block {b} (bytes {lo}..{hi}) fails its "
                f"{sh.checksum} checksum"
            )
    return ReadBack(
        step, tuple(problems), len(manifest.shards), blocks, nread, time.perf_counter() - t0
    )


def _candidates(shards: list[ShardEntry]) -> list[tuple[ShardEntry, TensorEntry, int]]:
    """(shard, tensor, block) to check, in order: every shard's tail, then every head."""
    tails, heads = [], []
    for sh in shards:
        checked = [t for t in sh.tensors if _nblocks(t)]  # an empty tensor has no block
        if not checked:
            continue
        last, first = checked[-1], checked[0]
        tails.append((sh, last, _nblocks(last) - 1))
        if first is not last or _nblocks(last) > 1:
            heads.append((sh, first, 0))
    return tails + heads


def _nblocks(t: TensorEntry) -> int:
    return 1 if t.block_rows == 0 else len(t.blocks)


def _block_range(t: TensorEntry, b: int) -> tuple[int, int]:
    """Byte range of block ``b`` of ``t`` in its shard (the whole tensor before blocks)."""
    if t.block_rows == 0:
        return t.offset, t.offset + t.nbytes
    rows = rows_of(t.shape, t.major_dim)
    row_bytes = t.nbytes // rows if rows else 0
    lo = t.offset + b * t.block_rows * row_bytes
    return lo, min(lo + t.block_rows * row_bytes, t.offset + t.nbytes)


def _digest(algorithm: str, t: TensorEntry, mv: memoryview) -> str:
    if t.block_rows == 0:
        return digest(algorithm, mv)
    rows = rows_of(t.shape, t.major_dim)
    row_bytes = t.nbytes // rows if rows else 0
    n = len(mv) // row_bytes if row_bytes else 1
    (got,) = block_digests(algorithm, mv, n, row_bytes, max(n, 1))
    return got
