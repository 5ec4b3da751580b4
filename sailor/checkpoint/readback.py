"""Reading a new commit back before retention deletes the checkpoints older than it.

A committer deletes older steps once its own commit is written (``gc.apply_retention``,
``prune.apply_seen_prune``). The commit was never read: after in-place reconfigurations, which keep
the weights in memory and load nothing, the only steps left on disk may be ones nobody ever
read. So before anything is deleted the new commit is read back (:func:`read_back`), and one
that fails keeps every older step (the caller reports it).

What is read, and why the cost is bounded whatever the checkpoint's size:

- the commit marker and the manifest (a few KB to a few MB): the marker's SHA-256 of the
  manifest and the manifest's schema (``reader.read_manifest``);
- every shard the manifest names: its size (one ``stat`` or HEAD per file, no data): a file
  missing, truncated or overwritten with other contents of another size;
- checksummed data within a byte budget (``budget_bytes``, default :data:`READBACK_BYTES`),
  shared out so that every shard has a block checked if the budget allows it: each shard's
  share (what is left of the budget over the shards left) goes to the last block of the
  file that fits in it, found from the file's end: its tail (where a torn or short write
  shows) when its last tensor's last block fits, else the last block of a smaller tensor
  nearer the end (at 70B, a layer's tail blocks are ~56 MB and its 64 MB budget is 0.8 MB a
  shard: the norm weights' 32 KB blocks, three quarters into the file). What is left then
  goes first to the shards with no block yet (the last block that fits, cheapest shard
  first), then, in order, to each shard's tail not yet checked, then each head (the first
  block of its first tensor), a block larger than what is left skipped. Each block is
  checked against its digest in the manifest (``blocks.py``); a checkpoint written before
  blocks (one digest per tensor) is checked whole where the tensor fits. A shard with data
  none of whose blocks fit (a budget too small for its smallest last block) is counted
  (``ReadBack.unchecked``) and reported by the caller: only its size was checked.

Reads at most ``budget_bytes`` of shard data plus the manifest, in one request per block,
one after another. A 104 MB checkpoint of 8 shards (``benchmarks/readback_cost.py``, page
cache warm, as for a commit just written): 1.1-1.7 ms, 4.3 MB read, against 19-100 ms for
``verify``, which reads every byte; with whole-tensor blocks (rows not divisible into
blocks) 3-10 ms for 35 MB. The budget caps it at a 70B model's size too: a LLaMA-70B-shaped
commit of 80 layer shards has a block of each shard checked (80 blocks of its norm weights,
then what the rest of the budget holds of its tails and heads), where the tails-first order
checked 5 blocks of 1 shard's tail and the heads of 4 and left 75 shards unread.

Any exception of the storage (an fsspec backend re-raises its client's errors: aiohttp's
are no ``OSError``) is a problem of the read-back, never raised: the commit it reads is
committed already.

It is not ``verify``: a flipped bit in the middle of a shard passes. It proves what
retention needs: the commit is there, complete, parses, and its files hold the data it
names at both ends.

Never deletes or writes anything.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from sailor.checkpoint.blocks import ALGORITHMS, block_digests, digest, rows_of
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
    unchecked: int
    """Shards (of those at their size) holding data of which no block was read: none fit
    in the budget. Only their sizes were checked."""
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
    except Exception as exc:  # whatever the backend raises: the commit is committed
        why = f"{type(exc).__name__}: {exc}"
        return ReadBack(step, (why,), 0, 0, 0, 0, time.perf_counter() - t0)
    problems: list[str] = []
    sized: list[ShardEntry] = []
    for sh in manifest.shards:
        where = f"{storage.url.rstrip('/')}/{d}/{sh.path}"
        try:
            size = storage.size(f"{d}/{sh.path}")
        except FileNotFoundError:
            problems.append(f"{where}: missing")
            continue
        except Exception as exc:  # an OSError, or a backend's own (aiohttp's)
            problems.append(f"{where}: cannot stat: {type(exc).__name__}: {exc}")
            continue
        if size != sh.size:
            problems.append(f"{where}: {size} bytes, the manifest says {sh.size}")
        elif sh.checksum not in ALGORITHMS:
            problems.append(f"{where}: checksum algorithm {sh.checksum!r} unavailable here")
        else:
            sized.append(sh)
    blocks = nread = 0
    chosen = _choose(sized, budget_bytes)
    for sh, t, b in chosen:
        lo, hi = _block_range(t, b)
        where = f"{storage.url.rstrip('/')}/{d}/{sh.path}"
        try:
            data = storage.read(f"{d}/{sh.path}", lo, hi - lo)
        except Exception as exc:  # an OSError, or a backend's own (aiohttp's)
            problems.append(
                f"{where}: read of bytes {lo}..{hi} failed: {type(exc).__name__}: {exc}"
            )
            continue
        nread += len(data)
        blocks += 1
        want = t.sha256 if t.block_rows == 0 else t.blocks[b]
        got = "" if len(data) != hi - lo else _digest(sh.checksum, t, memoryview(data))
        if got != want:
            problems.append(
                f"{where}: tensor {t.name} block {b} (bytes {lo}..{hi}) fails its "
                f"{sh.checksum} checksum"
            )
    read = {id(sh) for sh, _t, _b in chosen}
    unchecked = sum(1 for sh in sized if _checkable(sh) and id(sh) not in read)
    return ReadBack(
        step,
        tuple(problems),
        len(manifest.shards),
        blocks,
        unchecked,
        nread,
        time.perf_counter() - t0,
    )


def _choose(shards: list[ShardEntry], budget: int) -> list[tuple[ShardEntry, TensorEntry, int]]:
    """(shard, tensor, block) to read within ``budget`` bytes (module docstring), each block
    at most once: each shard's equal share to the last block of the file that fits in it;
    then, for a shard with none yet, the last block that fits in what is left (smallest
    first: as many shards covered as the budget allows); then tails, then heads
    (:func:`_candidates`) while the budget lasts."""
    checkable = [sh for sh in shards if _checkable(sh)]
    chosen: list[tuple[ShardEntry, TensorEntry, int]] = []
    taken: set[tuple[int, str, int]] = set()
    left = budget

    def take(sh: ShardEntry, t: TensorEntry, b: int) -> None:
        nonlocal left
        lo, hi = _block_range(t, b)
        left -= hi - lo
        chosen.append((sh, t, b))
        taken.add((id(sh), t.name, b))

    share = budget // len(checkable) if checkable else 0
    for sh in checkable:
        pick = _last_fitting(sh, share)
        if pick is not None:
            take(sh, *pick)
    covered = {id(sh) for sh, _t, _b in chosen}
    for sh in sorted((sh for sh in checkable if id(sh) not in covered), key=_smallest_tail):
        pick = _last_fitting(sh, left)
        if pick is not None:
            take(sh, *pick)
    for sh, t, b in _candidates(checkable):
        lo, hi = _block_range(t, b)
        if (id(sh), t.name, b) not in taken and hi - lo <= left:
            take(sh, t, b)
    return chosen


def _smallest_tail(sh: ShardEntry) -> int:
    """Bytes of the smallest last block of ``sh``'s tensors (what it costs to cover it)."""
    sizes = [
        hi - lo
        for t in sh.tensors
        if _nblocks(t) and t.nbytes
        for lo, hi in [_block_range(t, _nblocks(t) - 1)]
    ]
    return min(sizes, default=0)


def _checkable(sh: ShardEntry) -> bool:
    return any(_nblocks(t) and t.nbytes for t in sh.tensors)


def _last_fitting(sh: ShardEntry, share: int) -> tuple[TensorEntry, int] | None:
    """The block of ``sh`` nearest its end of at most ``share`` bytes: a tensor's last block
    is its smallest (the others are whole blocks), so only last blocks are looked at."""
    for t in sorted(sh.tensors, key=lambda t: t.offset, reverse=True):
        if not _nblocks(t) or not t.nbytes:
            continue
        b = _nblocks(t) - 1
        lo, hi = _block_range(t, b)
        if hi - lo <= share:
            return t, b
    return None


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
