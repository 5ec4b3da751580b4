"""Reading committed checkpoints: list, read the manifest, load-and-reshard, verify.

A rank of any layout calls ``load`` with the layers its stage owns and its TP (rank, size):
it opens only those layers' files, checks every tensor's checksum, and slices each parameter
along its TP dimension. Nothing is ever returned from a file that fails its size or checksum;
the error names the file so an operator (or the runtime's fallback) can act on it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
from pydantic import ValidationError

from sailor.checkpoint.errors import (
    CorruptCheckpointError,
    NoCheckpointError,
    StorageError,
)
from sailor.checkpoint.format import MANIFEST, MARKER, merkle_root, parse_step_dir, step_dir
from sailor.checkpoint.state import ParamState, TrainingGlobals, tp_slice
from sailor.checkpoint.storage import Storage
from sailor.schemas.checkpoint import CheckpointManifest, CommitMarker, ShardEntry

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


def _read_shard(storage: Storage, step: int, shard: ShardEntry) -> torch.Tensor:
    where = _where(storage, step, shard.path)
    path = f"{step_dir(step)}/{shard.path}"
    try:
        size = storage.size(path)
    except FileNotFoundError as exc:
        raise CorruptCheckpointError(f"{where}: missing", path=where) from exc
    if size != shard.size:
        raise CorruptCheckpointError(
            f"{where}: size {size} bytes, manifest says {shard.size} (truncated or overwritten)",
            path=where,
        )
    buf = torch.empty(shard.size, dtype=torch.uint8)
    try:
        got = storage.read_into(path, buf.numpy().data, 0)
    except OSError as exc:
        raise StorageError(f"{where}: read failed: {exc}", retryable=True) from exc
    if got != shard.size:
        raise CorruptCheckpointError(f"{where}: read {got} of {shard.size} bytes", path=where)
    return buf


def _check_tensors(where: str, buf: torch.Tensor, shard: ShardEntry) -> None:
    mv = buf.numpy().data
    digests = []
    for t in shard.tensors:
        d = hashlib.sha256(mv[t.offset : t.offset + t.nbytes]).hexdigest()
        if d != t.sha256:
            raise CorruptCheckpointError(f"{where}: tensor {t.name} fails its checksum", path=where)
        digests.append(d)
    if merkle_root(digests) != shard.sha256:
        raise CorruptCheckpointError(f"{where}: shard checksum mismatch", path=where)


def _tensor(
    buf: torch.Tensor, offset: int, nbytes: int, dtype: str, shape: tuple[int, ...]
) -> torch.Tensor:
    return buf[offset : offset + nbytes].view(getattr(torch, dtype)).reshape(shape)


def load(
    storage: Storage,
    layers: Iterable[int],
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    step: int | None = None,
    tp_dims: Mapping[str, int | None] | None = None,
) -> Loaded:
    """Load ``layers`` of a committed checkpoint, sliced for TP rank ``tp_rank`` of ``tp_size``.

    Each parameter is split along its stored ``tp_dim`` unless ``tp_dims`` (keyed
    '<layer>.<param>') says otherwise for the new layout. ``step`` None means the latest.
    """
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank={tp_rank}: outside 0..{tp_size - 1}")
    s = latest_step(storage) if step is None else step
    manifest = read_manifest(storage, s)
    wanted = sorted(set(layers))
    out: dict[str, ParamState] = {}
    nread = 0
    checks: list[Future[None]] = []
    with ThreadPoolExecutor(1, thread_name_prefix="ckpt-verify") as pool:
        bufs: list[tuple[ShardEntry, torch.Tensor]] = []
        for layer in wanted:
            shard = manifest.shard_of(layer)
            buf = _read_shard(storage, s, shard)
            nread += shard.size
            where = _where(storage, s, shard.path)
            # Verify on a helper thread while the next file is read.
            checks.append(pool.submit(_check_tensors, where, buf, shard))
            bufs.append((shard, buf))
        for fut in checks:
            fut.result()
    for shard, buf in bufs:
        by_param: dict[str, dict[str, torch.Tensor]] = {}
        dims: dict[str, int | None] = {}
        for t in shard.tensors:
            by_param.setdefault(t.param, {})[t.kind] = _tensor(
                buf, t.offset, t.nbytes, t.dtype, t.shape
            )
            dims[t.param] = t.tp_dim
        layer = shard.layers[0]
        for pname, kinds in by_param.items():
            key = f"{layer}.{pname}"
            dim = tp_dims.get(key, dims[pname]) if tp_dims is not None else dims[pname]
            sliced = {k: tp_slice(v, dim, tp_rank, tp_size) for k, v in kinds.items()}
            if tp_size > 1 and dim is not None:
                # Own the slice (don't pin the whole layer buffer through a view); a slice
                # along dim > 0 was already copied by ``contiguous`` in tp_slice.
                base = buf.untyped_storage().data_ptr()
                sliced = {
                    k: v.clone() if v.untyped_storage().data_ptr() == base else v
                    for k, v in sliced.items()
                }
            out[key] = ParamState(
                sliced["weight"], sliced["exp_avg"], sliced["exp_avg_sq"], tp_dim=dim
            )
    g = TrainingGlobals.decode(manifest.step, manifest.consumed_samples, manifest.globals)
    return Loaded(params=out, globals=g, manifest=manifest, bytes_read=nread)


def verify(storage: Storage, step: int) -> list[str]:
    """Check every shard of a committed step; return one message per bad file ([] = good)."""
    try:
        manifest = read_manifest(storage, step)
    except (NoCheckpointError, CorruptCheckpointError) as exc:
        return [str(exc)]
    problems = []
    for shard in manifest.shards:
        where = _where(storage, step, shard.path)
        try:
            _check_tensors(where, _read_shard(storage, step, shard), shard)
        except CorruptCheckpointError as exc:
            problems.append(str(exc))
    return problems
