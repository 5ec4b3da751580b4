"""Reading committed checkpoints: list, read the manifest, load-and-reshard, verify.

A rank of any layout calls ``load`` with the layers its stage owns and its TP (rank, size):
it opens only those layers' files, range-reads only the checksummed blocks covering its TP
slice of each tensor (``blocks.py``), checks them, and cuts out the slice. ``verify`` checks
every byte. Nothing is ever returned from a file that fails its size or checksum;
the error names the file so an operator (or the runtime's fallback) can act on it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
from pydantic import ValidationError

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
from sailor.checkpoint.format import MANIFEST, MARKER, merkle_root, parse_step_dir, step_dir
from sailor.checkpoint.state import ParamState, TrainingGlobals, tp_slice
from sailor.checkpoint.storage import Storage
from sailor.schemas.checkpoint import CheckpointManifest, CommitMarker, ShardEntry, TensorEntry

__all__ = [
    "Loaded",
    "committed_steps",
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
    """The manifest of a committed step; NoCheckpointError if not committed."""
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
    return CheckpointManifest.model_validate_json(raw)


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


def _open_shard(storage: Storage, step: int, shard: ShardEntry) -> tuple[str, str]:
    """(where, path) of a shard whose size matches the manifest and whose algorithm we have."""
    where = _where(storage, step, shard.path)
    path = f"{step_dir(step)}/{shard.path}"
    if shard.checksum not in ALGORITHMS:
        raise CheckpointError(
            f"{where}: checksum algorithm {shard.checksum!r} unavailable here (have "
            f"{sorted(ALGORITHMS)}); install the 'xxhash' package to read it"
        )
    try:
        size = storage.size(path)
    except FileNotFoundError as exc:
        raise CorruptCheckpointError(f"{where}: missing", path=where) from exc
    if size != shard.size:
        raise CorruptCheckpointError(
            f"{where}: size {size} bytes, manifest says {shard.size} (truncated or overwritten)",
            path=where,
        )
    return where, path


def _read_range(storage: Storage, path: str, where: str, buf: torch.Tensor, start: int) -> None:
    """Fill the uint8 tensor ``buf`` from byte ``start`` of ``path`` (no intermediate copy)."""
    want = buf.numel()
    try:
        got = storage.read_into(path, buf.numpy().data, start)
    except FileNotFoundError as exc:
        raise CorruptCheckpointError(f"{where}: missing", path=where) from exc
    except OSError as exc:
        raise StorageError(f"{where}: read failed: {exc}", retryable=True) from exc
    if got != want:
        raise CorruptCheckpointError(
            f"{where}: read {got} of {want} bytes at offset {start}", path=where
        )


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


def _finish(
    where: str,
    algorithm: str,
    t: TensorEntry,
    buf: torch.Tensor,
    plan: ReadPlan,
    ranged: bool,
    dim: int | None,
    tp_rank: int,
    tp_size: int,
    dest: torch.Tensor | None,
) -> torch.Tensor:
    """Verify what was read, then cut the rank's slice out of it (helper thread)."""
    _check_tensor(where, algorithm, t, buf.numpy().data, plan.row0, plan.row1)
    stored = buf.view(getattr(torch, t.dtype)).reshape(_stored_shape(t, plan.row1 - plan.row0))
    natural = stored.movedim(0, t.major_dim) if t.major_dim else stored
    if ranged:
        out = natural.narrow(t.major_dim, plan.keep0 - plan.row0, plan.keep1 - plan.keep0)
    else:
        out = tp_slice(natural, dim, tp_rank, tp_size)
    if dest is not None:
        if out.data_ptr() != dest.data_ptr():
            dest.copy_(out)
        return dest
    if not out.is_contiguous():
        return out.contiguous()
    if out.numel() != stored.numel() and (
        out.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
    ):
        # A view into a larger read buffer: own it rather than pin the whole buffer.
        return out.clone()
    return out


def _slice_shape(t: TensorEntry, dim: int | None, tp_size: int) -> tuple[int, ...]:
    shape = list(t.shape)
    if dim is not None and tp_size > 1:
        if shape[dim] % tp_size:
            raise ReshardError(
                f"cannot split dim {dim} of size {shape[dim]} (shape {t.shape}) over tp={tp_size}"
            )
        shape[dim] //= tp_size
    return tuple(shape)


def _direct(dest: torch.Tensor | None, t: TensorEntry, exact: bool) -> torch.Tensor | None:
    """The bytes of ``dest`` if the rows read are exactly its contents, else None."""
    if (
        dest is None
        or not exact
        or t.major_dim != 0
        or dest.device.type != "cpu"
        or not dest.is_contiguous()
    ):
        return None
    return dest.reshape(-1).view(torch.uint8)


def load(
    storage: Storage,
    layers: Iterable[int],
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    step: int | None = None,
    tp_dims: Mapping[str, int | None] | None = None,
    into: Mapping[str, ParamState] | None = None,
) -> Loaded:
    """Load ``layers`` of a committed checkpoint, sliced for TP rank ``tp_rank`` of ``tp_size``.

    Each parameter is split along its stored ``tp_dim`` unless ``tp_dims`` (keyed
    '<layer>.<param>') says otherwise for the new layout. ``step`` None means the latest.

    A rank range-reads only the blocks covering its slice (``blocks.py``) and checks their
    checksums on a helper thread while it reads the next range. ``into`` (keyed like the
    result) gives destination tensors of the slice's shape and dtype, e.g. the new layout's
    own parameters and moments: slices stored contiguously are read straight into them, the
    others copied in; they are returned in ``Loaded.params``. If the load raises, tensors in
    ``into`` may hold partly read data.
    """
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank={tp_rank}: outside 0..{tp_size - 1}")
    s = latest_step(storage) if step is None else step
    manifest = read_manifest(storage, s)
    wanted = sorted(set(layers))
    nread = 0
    results: list[tuple[str, TensorEntry, int | None, Future[torch.Tensor]]] = []
    with ThreadPoolExecutor(1, thread_name_prefix="ckpt-verify") as pool:
        for layer in wanted:
            shard = manifest.shard_of(layer)
            where, path = _open_shard(storage, s, shard)
            for t in shard.tensors:
                key = f"{layer}.{t.param}"
                dim = tp_dims.get(key, t.tp_dim) if tp_dims is not None else t.tp_dim
                want_shape = _slice_shape(t, dim, tp_size)
                dest = into[key].tensor(t.kind) if into is not None and key in into else None
                if dest is not None and (
                    tuple(dest.shape) != want_shape or str(dest.dtype) != f"torch.{t.dtype}"
                ):
                    raise ReshardError(
                        f"into[{key!r}].{t.kind}: {dest.dtype} {tuple(dest.shape)}, the slice "
                        f"is torch.{t.dtype} {want_shape}"
                    )
                rows = rows_of(t.shape, t.major_dim)
                ranged = t.block_rows > 0 and tp_size > 1 and dim is not None and dim == t.major_dim
                plan = (
                    plan_read(rows, t.block_rows, tp_rank, tp_size)
                    if ranged
                    else ReadPlan(0, rows, 0, rows, 0)
                )
                exact = plan.exact and (ranged or tp_size == 1 or dim is None)
                row_bytes = t.nbytes // rows if rows else 0
                nbytes = (plan.row1 - plan.row0) * row_bytes
                buf = _direct(dest, t, exact)
                if buf is None:
                    buf = torch.empty(nbytes, dtype=torch.uint8)
                _read_range(storage, path, where, buf, t.offset + plan.row0 * row_bytes)
                nread += nbytes
                fut = pool.submit(
                    _finish,
                    where,
                    shard.checksum,
                    t,
                    buf,
                    plan,
                    ranged,
                    dim,
                    tp_rank,
                    tp_size,
                    dest,
                )
                results.append((key, t, dim, fut))
        got: dict[str, dict[str, torch.Tensor]] = {}
        dims: dict[str, int | None] = {}
        for key, t, dim, fut in results:
            got.setdefault(key, {})[t.kind] = fut.result()
            dims[key] = dim
    out = {
        key: ParamState(k["weight"], k["exp_avg"], k["exp_avg_sq"], tp_dim=dims[key])
        for key, k in got.items()
    }
    g = TrainingGlobals.decode(manifest.step, manifest.consumed_samples, manifest.globals)
    return Loaded(params=out, globals=g, manifest=manifest, bytes_read=nread)


def verify(storage: Storage, step: int) -> list[str]:
    """Check every byte of every shard of a committed step: each block of each tensor, each
    tensor's digest and each shard's root. One message per bad file ([] = good)."""
    try:
        manifest = read_manifest(storage, step)
    except (NoCheckpointError, CorruptCheckpointError) as exc:
        return [str(exc)]
    problems = []
    for shard in manifest.shards:
        try:
            where, path = _open_shard(storage, step, shard)
            buf = torch.empty(shard.size, dtype=torch.uint8)
            _read_range(storage, path, where, buf, 0)
            mv = buf.numpy().data
            for t in shard.tensors:
                rows = rows_of(t.shape, t.major_dim)
                _check_tensor(where, shard.checksum, t, mv[t.offset : t.offset + t.nbytes], 0, rows)
            if merkle_root(t.sha256 for t in shard.tensors) != shard.sha256:
                raise CorruptCheckpointError(f"{where}: shard checksum mismatch", path=where)
        except CheckpointError as exc:
            problems.append(str(exc))
    return problems
