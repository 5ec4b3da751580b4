"""Checkpoint manifest: every shard with its size and checksum, and the layout it came from.

A checkpoint exists for readers only once its manifest and commit marker are written.
"""

from __future__ import annotations

from pydantic import Field

from sailor.schemas._base import WireMessage

__all__ = ["CheckpointManifest", "ShardEntry", "TensorEntry"]


class TensorEntry(WireMessage):
    """One tensor inside a shard."""

    name: str = Field(description="'<layer>.<param>.<kind>' with kind in weight|exp_avg|exp_avg_sq.")
    layer: int = Field(ge=0, description="Global layer index.")
    shape: tuple[int, ...] = Field(description="Full (TP-gathered) shape.")
    dtype: str = Field(description="Torch dtype name.")
    offset: int = Field(ge=0, description="Byte offset in the shard.")
    nbytes: int = Field(ge=0, description="Bytes.")
    sha256: str = Field(description="Checksum of the tensor bytes.")


class ShardEntry(WireMessage):
    """One file of a checkpoint."""

    path: str = Field(description="Path relative to the checkpoint directory.")
    size: int = Field(ge=0, description="Bytes.")
    sha256: str = Field(description="Checksum of the whole file.")
    layers: tuple[int, ...] = Field(default=(), description="Global layers it holds.")
    tensors: tuple[TensorEntry, ...] = Field(default=(), description="Tensors it holds.")


class CheckpointManifest(WireMessage):
    """The committed description of one checkpoint."""

    step: int = Field(ge=0, description="Iterations completed.")
    consumed_samples: int = Field(ge=0, description="Global data position.")
    model: str = Field(description="Model name.")
    num_layers: int = Field(gt=0, description="Global layers (embedding + blocks + head).")
    plan_id: str = Field(default="", description="Layout it was saved from.")
    layout: str = Field(default="", description="Human-readable layout summary.")
    shards: tuple[ShardEntry, ...] = Field(description="Every shard file.")
    globals: dict[str, str] = Field(
        default_factory=dict, description="Scalars: LR schedule, RNG seeds (JSON-encoded)."
    )
    created: float = Field(ge=0, description="Unix time of the commit.")
