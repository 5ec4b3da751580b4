"""On-storage layout of a checkpoint: names, and assembling a manifest from writers' parts.

```
ROOT/
  step-000000120/
    layer-00003-<save_id>.bin     raw tensor bytes of one global layer, nothing else
    parts/<save_id>-rank00004.json what writer rank 4 wrote (ShardPart), once durable
    manifest.json                 CheckpointManifest: every shard, size, checksums
    COMMITTED                     CommitMarker: the manifest's size and SHA-256; written last
```

A step directory without a valid ``COMMITTED`` does not exist for readers. The save id in
shard names keeps a retried save of the same step from mixing with a crashed attempt's files.

Pure: names and values only, no I/O.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable

from sailor.schemas.checkpoint import CheckpointManifest, ShardEntry, ShardPart
from sailor.schemas.data_identity import DataIdentity

__all__ = [
    "MANIFEST",
    "MARKER",
    "PARTS",
    "assemble_manifest",
    "merkle_root",
    "parse_step_dir",
    "part_name",
    "shard_name",
    "step_dir",
]

MANIFEST = "manifest.json"
MARKER = "COMMITTED"
PARTS = "parts"
_STEP_RE = re.compile(r"^step-(\d{9}|[1-9]\d{9,})$")
"""What :func:`step_dir` makes: nine digits, zero-padded, or more without a leading zero
(step 1_000_000_000 on). Nine only, before: such a commit was no step to the listing
(``latest_step`` named an older one, retention and gc never saw it)."""


def step_dir(step: int) -> str:
    return f"step-{step:09d}"


def parse_step_dir(name: str) -> int | None:
    """The step of a step directory name, or None for anything else."""
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def shard_name(layer: int, save_id: str) -> str:
    return f"layer-{layer:05d}-{save_id}.bin"


def part_name(save_id: str, rank: int) -> str:
    return f"{PARTS}/{save_id}-rank{rank:05d}.json"


def merkle_root(digests: Iterable[str]) -> str:
    """A shard's checksum: SHA-256 over its tensors' raw digests, in file order."""
    h = hashlib.sha256()
    for d in digests:
        h.update(bytes.fromhex(d))
    return h.hexdigest()


def assemble_manifest(
    parts: Iterable[ShardPart],
    *,
    step: int,
    consumed_samples: int,
    model: str,
    num_layers: int,
    save_id: str,
    globals_: dict[str, str],
    created: float,
    plan_id: str = "",
    layout: str = "",
    data: DataIdentity | None = None,
) -> CheckpointManifest:
    """The manifest of a complete save; raises if any layer is missing or written twice."""
    shards: list[ShardEntry] = []
    for p in sorted(parts, key=lambda x: x.rank):
        if p.save_id != save_id or p.step != step:
            raise ValueError(
                f"part of rank {p.rank} is for save {p.save_id!r} step {p.step}, "
                f"expected {save_id!r} step {step}"
            )
        shards.extend(p.shards)
    shards.sort(key=lambda s: (min(s.layers, default=-1), s.path))
    have = sorted(layer for s in shards for layer in s.layers)
    missing = sorted(set(range(num_layers)) - set(have))
    if missing:
        raise ValueError(f"layers {missing} of 0..{num_layers - 1} were not written")
    return CheckpointManifest(
        step=step,
        consumed_samples=consumed_samples,
        model=model,
        num_layers=num_layers,
        plan_id=plan_id,
        layout=layout,
        save_id=save_id,
        shards=tuple(shards),
        globals=globals_,
        created=created,
        data=data,
    )
