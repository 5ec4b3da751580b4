"""Reading committed checkpoints: list, read the manifest, load-and-reshard, verify.

A rank of any layout calls ``load`` with the layers its stage owns and its TP (rank, size):
it opens only those layers' files, range-reads only the checksummed blocks covering its TP
slice of each tensor (``blocks.py``) on parallel threads (``fetch.py``), checks them, and
cuts out the slice. ``verify`` checks
every byte. Nothing is ever returned from a file that fails its size or checksum;
the error names the file so an operator (or the runtime's fallback) can act on it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, wait
from dataclasses import dataclass

import torch
from pydantic import ValidationError
from pydantic_core import ErrorDetails

from sailor.checkpoint import fetch
from sailor.checkpoint.blocks import (
    ALGORITHMS,
    ReadPlan,
    block_digests,
    digest,
    plan_read,
    rows_of,
    tensor_digest,
)
from sailor.checkpoint.errors import (
    CheckpointError,
    CorruptCheckpointError,
    NoCheckpointError,
    ReshardError,
    StorageError,
)
from sailor.checkpoint.fetch import READ_WORKERS, Fetcher, Temp
from sailor.checkpoint.format import MANIFEST, MARKER, merkle_root, parse_step_dir, step_dir
from sailor.checkpoint.state import ParamState, TrainingGlobals
from sailor.checkpoint.storage import RangeReader, Storage
from sailor.schemas.checkpoint import CheckpointManifest, CommitMarker, ShardEntry, TensorEntry

__all__ = [
    "Loaded",
    "committed_steps",
    "globals_of",
    "invalid_manifest",
    "latest_step",
    "load",
    "read_manifest",
    "verify",
]


@dataclass(frozen=True)
class Loaded:
    """What a rank gets back: its sliced parameters, the globals and the manifest."""

    params: dict[str, ParamState]
    globals: TrainingGlobals
    manifest: CheckpointManifest
    bytes_read: int


def _where(storage: Storage, step: int, name: str) -> str:
    return f"{storage.url.rstrip('/')}/{step_dir(step)}/{name}"


def read_manifest(storage: Storage, step: int) -> CheckpointManifest:
    """The manifest of a committed step; NoCheckpointError if not committed,
    CorruptCheckpointError if its marker or its checksum is wrong or it names a shard outside
    its step directory (``debris`` False), ValidationError if this release cannot take its
    other fields (a newer release's)."""
    d = step_dir(step)
    try:
        raw_marker = storage.read(f"{d}/{MARKER}")
    except FileNotFoundError as exc:
        raise NoCheckpointError(f"step {step} is not committed ({d}/{MARKER} absent)") from exc
    try:
        marker = CommitMarker.model_validate_json(raw_marker)
        raw = storage.read(f"{d}/{MANIFEST}")
    except (ValidationError, FileNotFoundError) as exc:
        where = _where(storage, step, MARKER if isinstance(exc, ValidationError) else MANIFEST)
        raise CorruptCheckpointError(f"{where}: unreadable: {exc}", path=where) from exc
    if len(raw) != marker.manifest_size or hashlib.sha256(raw).hexdigest() != (
        marker.manifest_sha256
    ):
        where = _where(storage, step, MANIFEST)
        raise CorruptCheckpointError(
            f"{where}: does not match the checksum in its commit marker", path=where
        )
    # a ValidationError here is not corruption: a newer release may have written it (the
    # retention and gc spare the step, ``gc.scan``). One that names a shard outside its
    # step directory (``ShardEntry.path``) is unreadable, as a corrupt file is: a load falls
    # back to the previous commit instead of holding the job as misconfigured; but never
    # debris (``CorruptCheckpointError.debris``): gc and retention delete nothing of it
    try:
        manifest = CheckpointManifest.model_validate_json(raw)
    except ValidationError as exc:
        paths = [e for e in exc.errors() if _is_shard_path(e["loc"])]
        if not paths:
            raise
        where = _where(storage, step, MANIFEST)
        raise CorruptCheckpointError(
            f"{where}: refused, names a shard outside its step directory: "
            f"{_fields(paths)}; no shard of it is read, and neither retention nor `sailor "
            "ckpt gc` deletes it: inspect it (it was written by hand, altered, or by a "
            "release that names its shards otherwise) and delete the step yourself",
            path=where,
            debris=False,
        ) from exc
    if manifest.step != step or marker.step != step:
        # a step directory copied or renamed by hand: its state is another step's (a resume
        # from it started at the manifest's step, not the one asked for); not debris either
        where = _where(storage, step, MANIFEST)
        raise CorruptCheckpointError(
            f"{where}: holds step {manifest.step} (its commit marker: {marker.step}), not "
            f"step {step}: copied or renamed by hand? Neither retention nor `sailor ckpt gc` "
            "deletes it: move it back or delete the step yourself",
            path=where,
            debris=False,
        )
    return manifest


def globals_of(storage: Storage, manifest: CheckpointManifest) -> TrainingGlobals:
    """The training globals of ``manifest`` (of ``storage``); ``CorruptCheckpointError``
    naming the manifest's file and the key of a value that does not parse
    (:meth:`TrainingGlobals.decode`)."""
    return TrainingGlobals.decode(
        manifest.step,
        manifest.consumed_samples,
        manifest.globals,
        manifest.data,
        where=_where(storage, manifest.step, MANIFEST),
    )


def _is_shard_path(loc: tuple[int | str, ...]) -> bool:
    return len(loc) == 3 and loc[0] == "shards" and loc[2] == "path"


def _fields(errors: list[ErrorDetails]) -> str:
    """The first three errors of a ValidationError: 'field.path: message'."""
    return "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in errors[:3])


def invalid_manifest(storage: Storage, step: int, exc: ValidationError) -> str:
    """One line on a manifest this release cannot take (``read_manifest``'s ValidationError):
    the file and the first fields wrong."""
    where = _where(storage, step, MANIFEST)
    return f"{where}: not a manifest this release reads: {_fields(exc.errors())}"


def committed_steps(storage: Storage) -> list[int]:
    """Steps with a commit marker, ascending (markers are checked when read, not here)."""
    steps = []
    for name in storage.listdir(""):
        s = parse_step_dir(name)
        if s is not None and storage.exists(f"{name}/{MARKER}"):
            steps.append(s)
    return sorted(steps)


def latest_step(storage: Storage) -> int:
    steps = committed_steps(storage)
    if not steps:
        raise NoCheckpointError(f"no committed checkpoint under {storage.url}")
    return steps[-1]


def _open_shard(storage: Storage, step: int, shard: ShardEntry) -> tuple[str, RangeReader]:
    """(where, open reader) of a shard whose size matches the manifest and whose checksum
    algorithm we have; the caller closes the reader."""
    where = _where(storage, step, shard.path)
    if shard.checksum not in ALGORITHMS:
        raise CheckpointError(
            f"{where}: checksum algorithm {shard.checksum!r} unavailable here (have "
            f"{sorted(ALGORITHMS)}); install the 'xxhash' package to read it"
        )
    try:
        reader = storage.open_read(f"{step_dir(step)}/{shard.path}")
    except FileNotFoundError as exc:
        raise CorruptCheckpointError(f"{where}: missing", path=where) from exc
    except OSError as exc:
        raise StorageError(f"{where}: cannot open: {exc}", retryable=True) from exc
    if reader.size != shard.size:
        reader.close()
        raise CorruptCheckpointError(
            f"{where}: size {reader.size} bytes, manifest says {shard.size} "
            "(truncated or overwritten)",
            path=where,
        )
    return where, reader


def _check_tensor(
    where: str, algorithm: str, t: TensorEntry, mv: memoryview, row0: int, row1: int
) -> None:
    """Check stored rows ``row0..row1`` of ``t`` held in ``mv``: each block in them, and the
    tensor digest too when they are all of it."""
    fail = f"{where}: tensor {t.name}"
    if t.block_rows == 0:  # written before blocks: one digest of the whole tensor
        if digest(algorithm, mv) != t.sha256:
            raise CorruptCheckpointError(f"{fail} fails its {algorithm} checksum", path=where)
        return
    rows = rows_of(t.shape, t.major_dim)
    row_bytes = t.nbytes // rows if rows else 0
    first = row0 // t.block_rows
    got = block_digests(algorithm, mv, row1 - row0, row_bytes, t.block_rows)
    for i, d in enumerate(got):
        b = first + i
        if d != t.blocks[b]:
            lo = t.offset + b * t.block_rows * row_bytes
            hi = min(lo + t.block_rows * row_bytes, t.offset + t.nbytes)
            raise CorruptCheckpointError(
                f"{fail} block {b} of {len(t.blocks)} (bytes {lo}..{hi}) fails its "
                f"{algorithm} checksum",
                path=where,
            )
    if (row0, row1) == (0, rows) and tensor_digest(got) != t.sha256:
        raise CorruptCheckpointError(f"{fail}: block digests do not match its digest", path=where)


def _stored_shape(t: TensorEntry, rows: int) -> tuple[int, ...]:
    """Shape of ``rows`` stored rows: the tensor's shape with major_dim moved first."""
    if not t.shape:
        return ()
    rest = t.shape[: t.major_dim] + t.shape[t.major_dim + 1 :]
    return (rows, *rest)


def _slice_shape(t: TensorEntry, dim: int | None, tp_size: int) -> tuple[int, ...]:
    shape = list(t.shape)
    if dim is not None and tp_size > 1:
        if shape[dim] % tp_size:
            raise ReshardError(
                f"cannot split dim {dim} of size {shape[dim]} (shape {t.shape}) over tp={tp_size}"
            )
        shape[dim] //= tp_size
    return tuple(shape)


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


_TRANSPOSE_BYTES = 1 << 20
"""Stored rows transposed at a time: a 1 MB piece transposed into a small contiguous buffer
ran at ~10 GB/s here, against 4 GB/s for a whole 1024-row (4 MB) chunk and 0.5-2 GB/s for
transposing straight into a column block of the destination (torch, 1 thread, hidden 1024)."""


@dataclass(frozen=True)
class _Placer:
    """Copies checked stored rows ``a..b`` (a chunk) to their place in a rank's slice.

    ``keep0..keep1``: the slice's rows along the major dim (all rows unless the TP dim is the
    major dim); ``cross``: (dim, start, length) of a TP cut along another dim, or None.
    """

    t: TensorEntry
    dest: torch.Tensor
    keep0: int
    keep1: int
    cross: tuple[int, int, int] | None

    def _place_tiles(self, chunk: torch.Tensor, a: int, b: int, lo: int, hi: int) -> None:
        """Tiles (``TensorEntry.tiled``): each block is the tensor's own rows ``k..k+n`` of
        its major dim, contiguous; copying its part of the slice is a row-segment gather."""
        t = self.t
        major, br = t.major_dim, t.block_rows
        rows = rows_of(t.shape, major)
        row_bytes = t.nbytes // rows
        dtype = getattr(torch, t.dtype)
        for k0 in range(a, b, br):
            k1 = min(k0 + br, b)
            t0, t1 = max(k0, lo), min(k1, hi)
            if t1 <= t0:
                continue
            shape = list(t.shape)
            shape[major] = k1 - k0
            off = (k0 - a) * row_bytes
            tile = chunk[off : off + (k1 - k0) * row_bytes].view(dtype).view(shape)
            src = tile.narrow(major, t0 - k0, t1 - t0)
            if self.cross is not None:
                src = src.narrow(*self.cross)
            self.dest.narrow(major, t0 - self.keep0, t1 - t0).copy_(src)

    def __call__(self, chunk: torch.Tensor, a: int, b: int, temp: Temp) -> None:
        t = self.t
        if t.tiled and t.shape:
            lo, hi = max(a, self.keep0), min(b, self.keep1)
            if hi > lo:
                self._place_tiles(chunk, a, b, lo, hi)
            return
        stored = chunk.view(getattr(torch, t.dtype)).reshape(_stored_shape(t, b - a))
        if not t.shape:  # a 0-dim tensor is one row
            self.dest.copy_(stored)
            return
        lo, hi = max(a, self.keep0), min(b, self.keep1)
        if hi <= lo:
            return
        rows = stored.narrow(0, lo - a, hi - lo)
        major = t.major_dim
        if not major:
            src = rows.narrow(*self.cross) if self.cross is not None else rows
            self.dest.narrow(0, lo - self.keep0, hi - lo).copy_(src)
            return
        if (lo, hi) == (self.keep0, self.keep1) and self.dest.is_contiguous():
            # The chunk is the whole slice: one transposing copy into a contiguous
            # destination takes torch's blocked-transpose path (3.9 GB/s here for a
            # 1024 x 762 slice, against 2.5 GB/s piece by piece).
            src = rows.movedim(0, major)
            self.dest.copy_(src.narrow(*self.cross) if self.cross is not None else src)
            return
        # Part of the slice: transpose a piece at a time into a small contiguous buffer
        # (cache-resident), then copy that into the destination's rows; transposing straight
        # into a column block of the destination ran at 0.5-2 GB/s here.
        row_bytes = max(1, rows[0].numel() * rows.element_size())
        step = max(1, _TRANSPOSE_BYTES // row_bytes)
        for r in range(0, hi - lo, step):
            piece = rows.narrow(0, r, min(step, hi - lo - r)).movedim(0, major)
            buf = temp(piece.numel() * piece.element_size())
            natural = buf.view(piece.dtype).view(piece.shape).copy_(piece)
            src = natural.narrow(*self.cross) if self.cross is not None else natural
            self.dest.narrow(major, lo - self.keep0 + r, piece.shape[major]).copy_(src)


def load(
    storage: Storage,
    layers: Iterable[int],
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    step: int | None = None,
    tp_dims: Mapping[str, int | None] | None = None,
    into: Mapping[str, ParamState] | None = None,
    workers: int = READ_WORKERS,
) -> Loaded:
    """Load ``layers`` of a committed checkpoint, sliced for TP rank ``tp_rank`` of ``tp_size``.

    Each parameter is split along its stored ``tp_dim`` unless ``tp_dims`` (keyed
    '<layer>.<param>') says otherwise for the new layout. ``step`` None means the latest.

    A rank range-reads only the blocks covering its slice (``blocks.py``), through one handle
    per shard, ``workers`` reads at a time, and checks every block it reads before using it
    (``fetch.py``). Slices stored contiguously are read straight into their destination;
    the others (another major dim, a TP degree whose slices cut blocks, a ``tp_dims``
    override) are read chunk by chunk into a small per-thread scratch buffer and copied out.
    ``into`` (keyed like the result) gives destination tensors of the slice's shape and
    dtype, e.g. the new layout's own parameters and moments; they are returned in
    ``Loaded.params``. If the load raises, tensors in ``into`` may hold partly read data.
    """
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank={tp_rank}: outside 0..{tp_size - 1}")
    s = latest_step(storage) if step is None else step
    manifest = read_manifest(storage, s)
    g = globals_of(storage, manifest)  # before any shard is read
    wanted = sorted(set(layers))
    readers: list[RangeReader] = []
    results: list[tuple[str, TensorEntry, int | None, Future[torch.Tensor]]] = []
    got: dict[str, dict[str, torch.Tensor]] = {}
    dims: dict[str, int | None] = {}
    try:
        with Fetcher(workers, fetch.READ_CHUNK) as fetcher:
            for layer in wanted:
                shard = manifest.shard_of(layer)
                where, reader = _open_shard(storage, s, shard)
                readers.append(reader)
                for t in shard.tensors:
                    key = f"{layer}.{t.param}"
                    dim = tp_dims.get(key, t.tp_dim) if tp_dims is not None else t.tp_dim
                    want = _slice_shape(t, dim, tp_size)
                    dest = into[key].tensor(t.kind) if into is not None and key in into else None
                    if dest is not None and (
                        tuple(dest.shape) != want or str(dest.dtype) != f"torch.{t.dtype}"
                    ):
                        raise ReshardError(
                            f"into[{key!r}].{t.kind}: {dest.dtype} {tuple(dest.shape)}, the "
                            f"slice is torch.{t.dtype} {want}"
                        )
                    fut = _fetch_one(
                        fetcher, reader, where, shard.checksum, t, dim, want, dest,
                        tp_rank, tp_size,
                    )  # fmt: skip
                    results.append((key, t, dim, fut))
            # One wake-up when everything is in, not one per tensor: on a busy machine each
            # wake-up of this thread waits for a time slice.
            wait([fut for _k, _t, _d, fut in results])
            for key, t, dim, fut in results:
                got.setdefault(key, {})[t.kind] = fut.result()
                dims[key] = dim
            nread = fetcher.bytes_read
    finally:
        for reader in readers:
            reader.close()
    out = {
        key: ParamState(k["weight"], k["exp_avg"], k["exp_avg_sq"], tp_dim=dims[key])
        for key, k in got.items()
    }
    return Loaded(params=out, globals=g, manifest=manifest, bytes_read=nread)


def _fetch_one(
    fetcher: Fetcher,
    reader: RangeReader,
    where: str,
    algorithm: str,
    t: TensorEntry,
    dim: int | None,
    want: tuple[int, ...],
    dest: torch.Tensor | None,
    tp_rank: int,
    tp_size: int,
) -> Future[torch.Tensor]:
    """Start reading one tensor's slice: straight into its destination when the rows read
    are exactly the slice in its natural layout, else chunk by chunk through scratch."""
    rows = rows_of(t.shape, t.major_dim)
    cut = dim is not None and tp_size > 1
    ranged = t.block_rows > 0 and cut and dim == t.major_dim
    if ranged:
        plan = plan_read(rows, t.block_rows, tp_rank, tp_size)
    else:
        plan = ReadPlan(0, rows, 0, rows, 0)
    out = dest if dest is not None else torch.empty(want, dtype=getattr(torch, t.dtype))
    # Read straight into the destination when its bytes are exactly the rows read: always
    # for a major dim of 0; for tiles, when the rows read are one tile (TP = block count).
    one_tile = t.tiled and plan.row1 - plan.row0 <= t.block_rows
    exact = plan.exact and (ranged or not cut) and (t.major_dim == 0 or one_tile)
    if exact and out.device.type == "cpu" and out.is_contiguous():
        return fetcher.fetch(reader, where, algorithm, t, plan, out, direct=_bytes_of(out))
    keep0, keep1, cross = 0, rows, None
    if cut and dim is not None:
        per = t.shape[dim] // tp_size
        if dim == t.major_dim:
            keep0, keep1 = tp_rank * per, (tp_rank + 1) * per
        else:
            cross = (dim, tp_rank * per, per)
    placer = _Placer(t, out, keep0, keep1, cross)
    return fetcher.fetch(reader, where, algorithm, t, plan, out, place=placer)


def verify(storage: Storage, step: int) -> list[str]:
    """Check every byte of every shard of a committed step: each block of each tensor, each
    tensor's digest and each shard's root. One message per bad file ([] = good)."""
    try:
        manifest = read_manifest(storage, step)
    except (NoCheckpointError, CorruptCheckpointError) as exc:
        return [str(exc)]
    except ValidationError as exc:
        return [invalid_manifest(storage, step, exc)]
    problems = []
    for shard in manifest.shards:
        try:
            where, reader = _open_shard(storage, step, shard)
            try:
                buf = torch.empty(shard.size, dtype=torch.uint8)
                mv = buf.numpy().data.cast("B")
                got = reader.read_into(mv, 0)
            except OSError as exc:
                raise StorageError(f"{where}: read failed: {exc}", retryable=True) from exc
            finally:
                reader.close()
            if got != shard.size:
                raise CorruptCheckpointError(
                    f"{where}: read {got} of {shard.size} bytes", path=where
                )
            for t in shard.tensors:
                rows = rows_of(t.shape, t.major_dim)
                _check_tensor(where, shard.checksum, t, mv[t.offset : t.offset + t.nbytes], 0, rows)
            if merkle_root(t.sha256 for t in shard.tensors) != shard.sha256:
                raise CorruptCheckpointError(f"{where}: shard checksum mismatch", path=where)
        except CheckpointError as exc:
            problems.append(str(exc))
    return problems
