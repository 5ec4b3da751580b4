"""Checkpoint manifest: every shard with its size and checksum, and the layout it came from.

A checkpoint exists for readers only once its manifest and commit marker are written. Shard
files hold nothing but raw tensor bytes, back to back; everything needed to read them (name,
shape, dtype, byte offset, checksum, tensor-parallel dimension) lives here, so a reader of any
layout can find, check and slice the tensors of the layers it owns without opening other files.

Checksums (``sailor/checkpoint/blocks.py``): a tensor is stored cut along its TP dim
(``major_dim``; tiles in its own dim order if ``tiled``, else that dim moved first) and
checksummed per block of ``block_rows`` rows of that dim (``blocks``, with
the shard's ``checksum`` algorithm), so a rank reading only its TP slice checks only the
blocks it reads. ``TensorEntry.sha256`` is then the SHA-256 over the raw block digests.
Checkpoints written before blocks existed have ``block_rows == 0``, ``major_dim == 0`` and
``TensorEntry.sha256`` = SHA-256 of the whole tensor (the field name is kept so they parse).
``ShardEntry.sha256`` is the SHA-256 of the concatenated raw digests of its tensors in file
order (a one-level Merkle root): it changes if any tensor byte changes, and costs no second
pass over the data.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from sailor.schemas._base import Frozen, WireMessage, field_error
from sailor.schemas.data_identity import DataIdentity

__all__ = [
    "TENSOR_KINDS",
    "CheckpointManifest",
    "CommitMarker",
    "ShardEntry",
    "ShardPart",
    "TensorEntry",
    "TensorKind",
]

TensorKind = Literal["weight", "exp_avg", "exp_avg_sq"]
TENSOR_KINDS: tuple[TensorKind, ...] = ("weight", "exp_avg", "exp_avg_sq")
"""What is stored per parameter: fp32 master weight and both AdamW moments."""


class TensorEntry(Frozen):
    """One full (TP-gathered) tensor inside a shard."""

    name: str = Field(
        description="'<layer>.<param>.<kind>' with kind in weight|exp_avg|exp_avg_sq."
    )
    layer: int = Field(ge=0, description="Global layer index.")
    param: str = Field(default="", description="Parameter name inside the layer.")
    kind: TensorKind = Field(default="weight", description="weight, exp_avg or exp_avg_sq.")
    shape: tuple[int, ...] = Field(description="Full (TP-gathered) shape.")
    dtype: str = Field(description="Torch dtype name, e.g. 'float32'.")
    tp_dim: int | None = Field(
        default=None, description="Dimension split by tensor parallelism; None if replicated."
    )
    offset: int = Field(ge=0, description="Byte offset in the shard.")
    nbytes: int = Field(ge=0, description="Bytes.")
    sha256: str = Field(
        description="Hex tensor digest: SHA-256 over the raw block digests if block_rows > 0, "
        "else SHA-256 of the tensor bytes (checkpoints written before blocks)."
    )
    major_dim: int = Field(
        default=0,
        ge=0,
        description="Stored bytes are the tensor with this dim moved first "
        "(movedim(major_dim, 0)); 0 = plain row-major.",
    )
    block_rows: int = Field(
        default=0,
        ge=0,
        description="Rows of major_dim per checksummed block; 0 = one whole-tensor SHA-256.",
    )
    blocks: tuple[str, ...] = Field(
        default=(), description="Hex digest of each block, with the shard's checksum algorithm."
    )
    tiled: bool = Field(
        default=False,
        description="If major_dim > 0: each block is stored as a tile in the tensor's own dim "
        "order (t.narrow(major_dim, first row, block rows), contiguous), tiles back to back. "
        "False: the whole tensor is stored as movedim(major_dim, 0) (older checkpoints).",
    )

    @model_validator(mode="after")
    def _dim(self) -> TensorEntry:
        if self.tp_dim is not None and not 0 <= self.tp_dim < max(len(self.shape), 1):
            raise field_error("tp_dim", self.tp_dim, f"outside the dims of shape {self.shape}")
        if not 0 <= self.major_dim < max(len(self.shape), 1):
            raise field_error(
                "major_dim", self.major_dim, f"outside the dims of shape {self.shape}"
            )
        if self.block_rows:
            rows = self.shape[self.major_dim] if self.shape else 1
            want = -(-rows // self.block_rows)
            if len(self.blocks) != want:
                raise field_error(
                    "blocks",
                    len(self.blocks),
                    f"expected {want} for {rows} rows / {self.block_rows}",
                )
        elif self.blocks:
            raise field_error("blocks", len(self.blocks), "given without block_rows")
        if self.tiled and not self.block_rows:
            raise field_error("tiled", self.tiled, "needs block_rows > 0 (tiles are blocks)")
        return self

    @property
    def key(self) -> str:
        """'<layer>.<param>': the key the training framework uses."""
        return f"{self.layer}.{self.param}"


_SHARD_NAME = re.compile(r"layer-\d{5,}-[^/\\\x00]+\.bin")
"""What the writer names a shard (``checkpoint.format.shard_name``, unchanged since the first
release): ``layer-<layer, 5 digits or more>-<save id>.bin``, a file of the step directory."""


class ShardEntry(Frozen):
    """One file of a checkpoint: every tensor of one global layer."""

    path: str = Field(
        description="Path relative to the checkpoint (step) directory: the shard's file name, "
        "layer-NNNNN-<save id>.bin (no '/', no backslash: it never leaves the directory)."
    )
    size: int = Field(ge=0, description="Bytes.")
    sha256: str = Field(description="Hex SHA-256 over the raw digests of its tensors, in order.")
    checksum: str = Field(
        default="sha256",
        description="Algorithm of its block digests (or whole-tensor digests if blocks are "
        "absent): sha256 or xxh3_128.",
    )
    layers: tuple[int, ...] = Field(default=(), description="Global layers it holds.")
    tensors: tuple[TensorEntry, ...] = Field(default=(), description="Tensors it holds.")
    writer_rank: int = Field(default=-1, description="Global rank that wrote it (-1: unknown).")

    @field_validator("path")
    @classmethod
    def _in_its_step_directory(cls, v: str) -> str:
        # a manifest is data read back from storage: a path such as ../../x.bin would
        # have a load or `ckpt verify` read (and report on) a file outside the checkpoint
        if not _SHARD_NAME.fullmatch(v):
            raise field_error(
                "path",
                v,
                "not a shard file name of its step directory (layer-NNNNN-<save id>.bin, as "
                "the writer names them): no '/', backslash or '..'",
            )
        return v

    @model_validator(mode="after")
    def _extent(self) -> ShardEntry:
        end = max((t.offset + t.nbytes for t in self.tensors), default=0)
        if end > self.size:
            raise field_error("size", self.size, f"smaller than its tensors' extent {end}")
        return self


class ShardPart(WireMessage):
    """What one writer rank reports after its shards are durable (input to the commit)."""

    save_id: str = Field(min_length=1, description="Identifier of the save attempt.")
    step: int = Field(ge=0, description="Step being saved.")
    rank: int = Field(ge=0, description="Writer rank (index among the writers).")
    shards: tuple[ShardEntry, ...] = Field(default=(), description="Shards it wrote.")
    persist_s: float = Field(default=0.0, ge=0, description="Seconds it spent persisting.")
    refused: str = Field(
        default="",
        description="Why this writer refused the step (a non-finite tensor), '' if it did "
        "not: the committer then commits nothing and raises it, without waiting for the rest.",
    )


class CheckpointManifest(WireMessage):
    """The committed description of one checkpoint."""

    step: int = Field(ge=0, description="Iterations completed.")
    consumed_samples: int = Field(ge=0, description="Global data position.")
    model: str = Field(description="Model name.")
    num_layers: int = Field(gt=0, description="Global layers (embedding + blocks + head).")
    plan_id: str = Field(default="", description="Layout it was saved from.")
    layout: str = Field(default="", description="Human-readable layout summary.")
    save_id: str = Field(default="", description="Identifier of the save attempt.")
    shards: tuple[ShardEntry, ...] = Field(description="Every shard file.")
    globals: dict[str, str] = Field(
        default_factory=dict, description="Scalars: LR schedule, RNG seeds (JSON-encoded)."
    )
    created: float = Field(ge=0, description="Unix time of the commit.")
    data: DataIdentity | None = Field(
        default=None,
        description="Identity of the training data its consumed_samples index (wire version "
        "9); None: saved before it was recorded, or by a trainer that does not say.",
    )

    @model_validator(mode="after")
    def _layers_once(self) -> CheckpointManifest:
        seen: dict[int, str] = {}
        for s in self.shards:
            for layer in s.layers:
                if layer in seen:
                    raise field_error(
                        "shards[*].layers", layer, f"in both {seen[layer]} and {s.path}"
                    )
                if layer >= self.num_layers:
                    raise field_error("shards[*].layers", layer, f">= num_layers={self.num_layers}")
                seen[layer] = s.path
        return self

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(sorted(layer for s in self.shards for layer in s.layers))

    @property
    def total_bytes(self) -> int:
        return sum(s.size for s in self.shards)

    def shard_of(self, layer: int) -> ShardEntry:
        for s in self.shards:
            if layer in s.layers:
                return s
        raise field_error("layer", layer, f"not in the checkpoint of step {self.step}")


class CommitMarker(WireMessage):
    """Written last: names the manifest's checksum so a torn manifest is never trusted."""

    step: int = Field(ge=0, description="Step committed.")
    save_id: str = Field(description="Save attempt committed.")
    manifest_sha256: str = Field(description="Hex SHA-256 of manifest.json's bytes.")
    manifest_size: int = Field(ge=0, description="Bytes of manifest.json.")
