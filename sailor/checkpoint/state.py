"""The plain data a checkpoint is made of, and how TP shards map to full tensors.

The training framework hands the checkpointer, per rank, ``{"<layer>.<param>": ParamState}``
(its local TP shard of the fp32 master weight and both AdamW moments, with the dimension TP
splits, or None if replicated) and a ``TrainingGlobals``. Nothing here knows about the
framework's modules or optimizers; the framework adapts to this, not the other way around.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from sailor.checkpoint.errors import CorruptCheckpointError, ReshardError
from sailor.schemas.checkpoint import TENSOR_KINDS, TensorKind
from sailor.schemas.data_identity import DataIdentity
from sailor.schemas.json_text import JsonTooDeepError, load_json

__all__ = [
    "ParamState",
    "TrainingGlobals",
    "layer_of",
    "split_key",
    "tp_slice",
]


@dataclass(frozen=True)
class ParamState:
    """One parameter: master weight and AdamW moments, all the same shape (a shard or full)."""

    weight: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    tp_dim: int | None = None

    def tensor(self, kind: TensorKind) -> torch.Tensor:
        t: torch.Tensor = getattr(self, kind)
        return t

    def map(self, fn: Any) -> ParamState:
        """The same parameter with ``fn`` applied to each of its tensors."""
        return ParamState(fn(self.weight), fn(self.exp_avg), fn(self.exp_avg_sq), self.tp_dim)

    @property
    def nbytes(self) -> int:
        return sum(self.tensor(k).numel() * self.tensor(k).element_size() for k in TENSOR_KINDS)


@dataclass(frozen=True)
class TrainingGlobals:
    """Job-wide values restored on resume. ``extra`` holds JSON-able values (LR schedule, seeds).

    Never per-rank data-loader state: the data position is ``consumed_samples``, which any
    layout can turn into its own per-pipeline offsets.
    """

    step: int
    consumed_samples: int
    extra: Mapping[str, Any] = field(default_factory=dict)
    data: DataIdentity | None = None
    """The data ``consumed_samples`` indexes (the manifest's ``data``); None: not said."""

    def encode(self) -> dict[str, str]:
        """The manifest's ``globals``: each value JSON-encoded."""
        return {k: json.dumps(v, sort_keys=True) for k, v in sorted(self.extra.items())}

    @classmethod
    def decode(
        cls,
        step: int,
        consumed_samples: int,
        enc: Mapping[str, str],
        data: DataIdentity | None = None,
        *,
        where: str = "manifest",
    ) -> TrainingGlobals:
        """The globals of a manifest's ``globals`` (each value JSON text, :meth:`encode`).

        A value that does not parse (a syntax error, or nested past the parser's depth
        limit: ``load_json``) is a ``CorruptCheckpointError`` naming ``where`` (the
        manifest's path) and its key, not debris: this release's writer encodes every value
        it saves, so the manifest was written or altered by hand; an operator judges it."""
        extra: dict[str, Any] = {}
        for k, v in enc.items():
            field = f"{where}: globals[{k!r}]"
            try:
                extra[k] = load_json(v, field)
            except JsonTooDeepError as exc:
                raise CorruptCheckpointError(str(exc), path=where, debris=False) from None
            except ValueError as exc:
                raise CorruptCheckpointError(
                    f"{field}: not JSON ({exc}): {v[:80]!r}", path=where, debris=False
                ) from None
        return cls(step, consumed_samples, extra, data)


def split_key(key: str) -> tuple[int, str]:
    """'12.attn.qkv.weight' -> (12, 'attn.qkv.weight')."""
    head, sep, rest = key.partition(".")
    if not sep or not head.isdigit() or not rest:
        raise ValueError(f"key={key!r}: expected '<global layer>.<param name>'")
    return int(head), rest


def layer_of(key: str) -> int:
    return split_key(key)[0]


def tp_slice(full: torch.Tensor, dim: int | None, tp_rank: int, tp_size: int) -> torch.Tensor:
    """The contiguous slice TP rank ``tp_rank`` of ``tp_size`` holds (all of it if dim None)."""
    if dim is None or tp_size == 1:
        return full
    n = full.shape[dim]
    if n % tp_size:
        raise ReshardError(
            f"cannot split dim {dim} of size {n} (shape {tuple(full.shape)}) over tp={tp_size}"
        )
    step = n // tp_size
    return full.narrow(dim, tp_rank * step, step).contiguous()
