"""Persisting shards and committing a checkpoint: the write half of the I/O shell.

Order of a save (each step durable before the next starts):
1. every writer rank writes its layer files (``persist_layers``), then its part file;
2. the committer waits for a part from every writer rank, assembles the manifest, writes it;
3. the committer writes the commit marker (manifest size + SHA-256): the checkpoint exists;
4. only then does retention delete older checkpoints and debris.

A crash before 3 leaves a step directory without a marker: invisible to readers, collected by
gc. Each tensor is put in its stored layout and hashed per block (``blocks.py``) on a helper
thread while the previous tensor is written (torch copies, hashing and file writes all release
the GIL), so checksums cost almost no extra wall time.

Never holds locks across ranks or calls torch.distributed: the commit rendezvous goes through
the storage itself, so it also works from a background thread.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from sailor.checkpoint.blocks import (
    block_digests,
    block_rows_for,
    default_algorithm,
    rows_of,
    tensor_digest,
)
from sailor.checkpoint.errors import CheckpointError
from sailor.checkpoint.format import (
    MANIFEST,
    MARKER,
    assemble_manifest,
    merkle_root,
    part_name,
    shard_name,
    step_dir,
)
from sailor.checkpoint.gc import apply_retention
from sailor.checkpoint.state import ParamState, TrainingGlobals, split_key
from sailor.checkpoint.storage import Storage
from sailor.schemas.checkpoint import (
    TENSOR_KINDS,
    CheckpointManifest,
    CommitMarker,
    ShardEntry,
    ShardPart,
    TensorEntry,
    TensorKind,
)

__all__ = ["commit", "persist_layer", "persist_layers", "save_full", "tensor_bytes"]


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a CPU tensor (copied once if not contiguous)."""
    flat = t.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().data.cast("B")


@dataclass(frozen=True)
class _Prepared:
    """One tensor in its stored layout, with its block digests."""

    data: memoryview
    major_dim: int
    block_rows: int
    blocks: list[str]


def _prepare(t: torch.Tensor, major_dim: int, algorithm: str) -> _Prepared:
    """Stored layout (TP dim first: one transposed copy if that dim is not 0) and digests.

    Runs on the helper thread: torch's copy and both hashes release the GIL.
    """
    stored = t.detach().movedim(major_dim, 0) if major_dim else t.detach()
    data = tensor_bytes(stored)
    rows = rows_of(tuple(t.shape), major_dim)
    br = block_rows_for(tuple(t.shape), major_dim, len(data))
    row_bytes = len(data) // rows if rows else 0
    return _Prepared(data, major_dim, br, block_digests(algorithm, data, rows, row_bytes, br))


def persist_layer(
    storage: Storage,
    step: int,
    save_id: str,
    layer: int,
    params: Mapping[str, ParamState],
    *,
    rank: int = -1,
    hasher: ThreadPoolExecutor | None = None,
    before_write: Callable[[str], None] | None = None,
    checksum: str | None = None,
) -> ShardEntry:
    """Write every full tensor of one layer to one file; return its entry for the manifest.

    ``params`` maps parameter names (without the layer prefix) to full, CPU tensors. Each is
    written in its stored layout (``blocks.py``) with per-block digests of ``checksum``
    (default: the fastest available). The next tensor is prepared (transposed if needed,
    hashed) on the helper thread while the current one is written.
    ``before_write`` is a test hook called with the shard path.
    """
    algorithm = checksum or default_algorithm()
    own_pool = hasher is None
    pool = hasher or ThreadPoolExecutor(1, thread_name_prefix="ckpt-hash")
    path = f"{step_dir(step)}/{shard_name(layer, save_id)}"
    items: list[tuple[str, TensorKind, torch.Tensor, int | None]] = []
    for pname in sorted(params):
        p = params[pname]
        for kind in TENSOR_KINDS:
            t = p.tensor(kind)
            if t.device.type != "cpu":
                raise CheckpointError(f"{layer}.{pname}.{kind} is on {t.device}, not CPU")
            items.append((pname, kind, t, p.tp_dim))
    entries: list[TensorEntry] = []

    def chunks() -> Iterator[memoryview]:
        futures = [pool.submit(_prepare, t, dim or 0, algorithm) for _n, _k, t, dim in items[:2]]
        offset = 0
        for i, (pname, kind, t, tp_dim) in enumerate(items):
            prep = futures[i].result()
            if i + 2 < len(items):
                _n, _k, t2, d2 = items[i + 2]
                futures.append(pool.submit(_prepare, t2, d2 or 0, algorithm))
            entries.append(
                TensorEntry(
                    name=f"{layer}.{pname}.{kind}",
                    layer=layer,
                    param=pname,
                    kind=kind,
                    shape=tuple(t.shape),
                    dtype=str(t.dtype).removeprefix("torch."),
                    tp_dim=tp_dim,
                    offset=offset,
                    nbytes=len(prep.data),
                    sha256=tensor_digest(prep.blocks),
                    major_dim=prep.major_dim,
                    block_rows=prep.block_rows,
                    blocks=tuple(prep.blocks),
                )
            )
            offset += len(prep.data)
            yield prep.data

    try:
        if before_write is not None:
            before_write(path)
        size = storage.write(path, chunks())
    finally:
        if own_pool:
            pool.shutdown(wait=True)
    if len(entries) != len(items):
        raise CheckpointError(f"{path}: storage consumed {len(entries)} of {len(items)} tensors")
    return ShardEntry(
        path=shard_name(layer, save_id),
        size=size,
        sha256=merkle_root(e.sha256 for e in entries),
        checksum=algorithm,
        layers=(layer,),
        tensors=tuple(entries),
        writer_rank=rank,
    )


def persist_layers(
    storage: Storage,
    step: int,
    save_id: str,
    by_layer: Mapping[int, Mapping[str, ParamState]],
    *,
    rank: int = 0,
    before_write: Callable[[str], None] | None = None,
    checksum: str | None = None,
) -> ShardPart:
    """Write this rank's layers, then its part file (the signal to the committer)."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(1, thread_name_prefix="ckpt-hash") as pool:
        shards = tuple(
            persist_layer(
                storage,
                step,
                save_id,
                layer,
                by_layer[layer],
                rank=rank,
                hasher=pool,
                before_write=before_write,
                checksum=checksum,
            )
            for layer in sorted(by_layer)
        )
    part = ShardPart(
        save_id=save_id,
        step=step,
        rank=rank,
        shards=shards,
        persist_s=time.perf_counter() - t0,
    )
    data = part.model_dump_json().encode()
    storage.write(f"{step_dir(step)}/{part_name(save_id, rank)}", [data])
    return part


def commit(
    storage: Storage,
    *,
    step: int,
    save_id: str,
    writer_ranks: Sequence[int],
    globals_: TrainingGlobals,
    model: str,
    num_layers: int,
    plan_id: str = "",
    layout: str = "",
    keep: int | None = None,
    timeout_s: float = 600.0,
    poll_s: float = 0.02,
    before_marker: Callable[[], None] | None = None,
) -> CheckpointManifest:
    """Wait for every writer's part, then write manifest and marker, then apply retention."""
    d = step_dir(step)
    deadline = time.monotonic() + timeout_s
    parts: dict[int, ShardPart] = {}
    while True:
        for r in writer_ranks:
            if r in parts:
                continue
            path = f"{d}/{part_name(save_id, r)}"
            if storage.exists(path):
                parts[r] = ShardPart.model_validate_json(storage.read(path))
        if len(parts) == len(writer_ranks):
            break
        if time.monotonic() > deadline:
            missing = sorted(set(writer_ranks) - set(parts))
            raise CheckpointError(
                f"step {step} save {save_id}: no part from writer ranks {missing} "
                f"after {timeout_s:.0f}s; not committed",
                retryable=True,
            )
        time.sleep(poll_s)
    if globals_.step != step:
        raise CheckpointError(f"globals step {globals_.step} != checkpoint step {step}")
    manifest = assemble_manifest(
        parts.values(),
        step=step,
        consumed_samples=globals_.consumed_samples,
        model=model,
        num_layers=num_layers,
        save_id=save_id,
        globals_=globals_.encode(),
        created=time.time(),
        plan_id=plan_id,
        layout=layout,
    )
    raw = json.dumps(manifest.model_dump(mode="json"), indent=1).encode()
    storage.write(f"{d}/{MANIFEST}", [raw])
    if before_marker is not None:
        before_marker()
    marker = CommitMarker(
        step=step,
        save_id=save_id,
        manifest_sha256=hashlib.sha256(raw).hexdigest(),
        manifest_size=len(raw),
    )
    storage.write(f"{d}/{MARKER}", [marker.model_dump_json().encode()])
    if keep is not None:
        apply_retention(storage, keep=keep, committed_step=step)
    return manifest


def save_full(
    storage: Storage,
    params: Mapping[str, ParamState],
    globals_: TrainingGlobals,
    *,
    model: str,
    num_layers: int,
    save_id: str = "single",
    keep: int | None = None,
    plan_id: str = "",
    layout: str = "",
    checksum: str | None = None,
) -> CheckpointManifest:
    """One process holds every full parameter: write all layers and commit (tests, tools)."""
    by_layer: dict[int, dict[str, ParamState]] = {}
    for key, p in params.items():
        layer, name = split_key(key)
        by_layer.setdefault(layer, {})[name] = p
    persist_layers(storage, globals_.step, save_id, by_layer, rank=0, checksum=checksum)
    return commit(
        storage,
        step=globals_.step,
        save_id=save_id,
        writer_ranks=[0],
        globals_=globals_,
        model=model,
        num_layers=num_layers,
        plan_id=plan_id,
        layout=layout,
        keep=keep,
    )
