"""Megatron-style tensor-parallel building blocks: the two TP collectives and the two linears.

A block in TP enters the "TP region" once (:func:`copy_to_tp`: identity forward, all-reduce
of the input gradient backward), runs column-parallel matmuls whose outputs are split over
TP ranks, and leaves it through a row-parallel matmul whose partial outputs are summed
(:func:`reduce_from_tp`: all-reduce forward, identity backward). With TP size 1 both are
identities and no process group is needed, which is how the single-process reference runs
the very same code.

Every parameter carries the dimension it is sharded along (``tp_dim``; None when it is
replicated on all TP ranks). Shards are contiguous chunks of the full tensor along that
dimension, rank ``r`` of ``t`` holding chunk ``r``; the checkpoint code gathers or slices
along ``tp_dim`` and the gradient sync slices chunks of it (see ``sync_groups``).

This module never creates process groups; it is handed one in a :class:`TPContext`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from sailor.comm import api as comm

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "TPContext",
    "copy_to_tp",
    "reduce_from_tp",
    "set_tp_dim",
    "tp_dim_of",
]

_TP_DIM_ATTR = "sailor_tp_dim"


@dataclass(frozen=True)
class TPContext:
    """This rank's tensor-parallel group: its size, its rank in it and the process group."""

    size: int = 1
    rank: int = 0
    group: Any = None
    """A torch.distributed ProcessGroup when ``size > 1``."""

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"TPContext(size={self.size}, rank={self.rank}) is invalid")
        if self.size > 1 and self.group is None:
            raise ValueError(f"TPContext(size={self.size}) needs a process group")


_T = TypeVar("_T", bound=torch.Tensor)


def set_tp_dim(param: _T, dim: int | None) -> _T:
    """Record the TP-sharding dimension of ``param`` (None: replicated)."""
    setattr(param, _TP_DIM_ATTR, dim)
    return param


def tp_dim_of(param: torch.Tensor) -> int | None:
    """The TP-sharding dimension recorded on ``param`` (None if replicated or unknown)."""
    dim: int | None = getattr(param, _TP_DIM_ATTR, None)
    return dim


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, None]:
        g = grads[0].contiguous()
        comm.all_reduce(g, group=ctx.group)
        return g, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        out = x.contiguous().clone()
        comm.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grads[0], None


_AUTOCAST_DEVICES = ("cuda", "cpu")
"""Device types autocast may be on for (asking about another, e.g. ``meta``, raises)."""


def copy_to_tp(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    """Enter the TP region: identity forward, all-reduce of the gradient backward.

    Under autocast the region's input is cast to the compute dtype first, at every TP degree:
    the layers inside would each cast it and keep their own cast for the backward (three for
    the attention's query, key and value projections: ``2·s·h`` bytes per sample each, kept
    per block and microbatch in flight), and the backward all-reduce then moves 16-bit
    gradients, as Megatron's does (a normalised fp32 input, layer norm being on autocast's
    fp32 list, made it move fp32: twice the bytes)."""
    kind = x.device.type
    if x.dtype == torch.float32 and kind in _AUTOCAST_DEVICES and torch.is_autocast_enabled(kind):
        x = x.to(torch.get_autocast_dtype(kind))
    if tp.size == 1:
        return x
    out: torch.Tensor = _CopyToTP.apply(x, tp.group)  # type: ignore[no-untyped-call]
    return out


def reduce_from_tp(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    """Leave the TP region: all-reduce (sum) forward, identity backward."""
    if tp.size == 1:
        return x
    out: torch.Tensor = _ReduceFromTP.apply(x, tp.group)  # type: ignore[no-untyped-call]
    return out


def _split(n: int, tp: TPContext, what: str) -> int:
    if n % tp.size:
        raise ValueError(f"{what}={n} is not divisible by the TP degree {tp.size}")
    return n // tp.size


class ColumnParallelLinear(nn.Module):
    """``y_r = x W_r^T + b_r``: output features split over TP ranks (weight dim 0).

    The input must already be in the TP region (see :func:`copy_to_tp`); callers enter it
    once per block so q, k and v share a single backward all-reduce.
    """

    def __init__(self, in_features: int, out_features: int, tp: TPContext, bias: bool) -> None:
        super().__init__()
        local = _split(out_features, tp, "out_features")
        self.weight = set_tp_dim(nn.Parameter(torch.empty(local, in_features)), 0)
        self.bias = set_tp_dim(nn.Parameter(torch.empty(local)), 0) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """``y = sum_r x_r W_r^T + b``: input features split over TP ranks (weight dim 1).

    The bias is replicated and added after the all-reduce.
    """

    def __init__(self, in_features: int, out_features: int, tp: TPContext, bias: bool) -> None:
        super().__init__()
        local = _split(in_features, tp, "in_features")
        self.tp = tp
        self.weight = set_tp_dim(nn.Parameter(torch.empty(out_features, local)), 1)
        self.bias = set_tp_dim(nn.Parameter(torch.empty(out_features)), None) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_tp(nn.functional.linear(x, self.weight), self.tp)
        return y + self.bias if self.bias is not None else y
