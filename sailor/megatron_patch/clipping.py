"""Gradient clipping by the global norm of a heterogeneous layout, equal to one process's.

After the gradient sync every holder of a parameter slice has the same (summed) gradient,
so summing every rank's local squared norms would count a slice once per holder: once per
pipeline (data-parallel replicas), once per TP rank for a replicated parameter (norms,
row-parallel biases, position embeddings), and twice for tied embeddings (the embedding and
the head's copy are one parameter of the single-process model). :func:`counts_in_norm`
picks exactly one holder of every element:

- pipeline 0 only (every pipeline holds every layer);
- a TP-sharded parameter on every TP rank of its stage (the shards partition it);
- a replicated parameter on TP rank 0 only;
- with tied embeddings, the head's ``lm_head.weight`` never (layer 0's copy counts).

:func:`clip_by_global_norm` sums the counted squares in float64, all-reduces them over the
world once, and scales every local gradient by ``min(1, max_norm / (norm + 1e-6))``, the
coefficient ``torch.nn.utils.clip_grad_norm_`` applies.

The norm is also the engine's test for non-finite gradients (``nonfinite``): it is inf or NaN
on every rank iff some rank's gradient holds an inf or NaN, its uncounted ones included (a
replicated parameter's copy on TP rank 1 is computed apart from rank 0's; a pipeline's copy
after a sync gone wrong). Those are checked with one fused max-abs pass over all of them
(``step_agreement.local_nonfinite``: no fp64 square, no bool copy) and add inf to the local
sum. A non-finite norm clips nothing (the step is skipped).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from sailor.comm import api as comm
from sailor.megatron_patch.clock import synchronize
from sailor.megatron_patch.model import GPTStage
from sailor.megatron_patch.roles import RankRole
from sailor.megatron_patch.step_agreement import local_nonfinite
from sailor.megatron_patch.tp_layers import tp_dim_of

__all__ = [
    "clip_by_global_norm",
    "counts_in_norm",
    "global_squares",
    "local_squares",
    "scale_to_norm",
]

_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s
_CHUNK = 1 << 22
"""Elements of a gradient squared at a time in fp64 for the norm (4M: 64 MB transient)."""


def counts_in_norm(
    name: str, tp_dim: int | None, role: RankRole, tied: bool, head_layer: int
) -> bool:
    """Whether this rank's gradient of parameter ``name`` enters the global norm."""
    if role.pipeline != 0:
        return False
    if tp_dim is None and role.tp_rank != 0:
        return False
    return not (tied and name == f"{head_layer}.lm_head.weight")


def local_squares(stage: GPTStage, role: RankRole, device: torch.device) -> torch.Tensor:
    """This rank's share of the global squared norm: a one-element fp64 tensor on ``device``
    (no sync), inf if a gradient it does not count holds an inf or NaN (non-finite anyway
    if a counted one does: fp64 squares of fp32 values cannot overflow)."""
    head = stage.spec.num_all_layers - 1
    tied = stage.spec.tie_embeddings
    sq = torch.zeros(1, dtype=torch.float64, device=device)
    uncounted: list[torch.Tensor] = []
    for name, p in stage.keyed_parameters():
        if p.grad is None:
            continue
        if counts_in_norm(name, tp_dim_of(p), role, tied, head):
            # in fp64, a chunk at a time: a whole 1B-element head gradient in fp64 and its
            # square would be 16 GB of transient GPU memory (a chunk is 64 MB)
            for chunk in torch.split(p.grad.detach().reshape(-1), _CHUNK):
                sq += chunk.double().pow(2).sum()
        else:
            uncounted.append(p.grad.detach())
    if uncounted:  # one fused max-abs pass, no bool copy of each gradient
        sq.masked_fill_(local_nonfinite(uncounted, device), math.inf)
    return sq


def scale_to_norm(stage: GPTStage, norm: float, max_norm: float) -> None:
    """Scale every local gradient by ``min(1, max_norm / (norm + 1e-6))`` (nothing for a
    non-finite ``norm``: that step is skipped)."""
    coef = max_norm / (norm + _EPS)
    if math.isfinite(norm) and coef < 1.0:
        for p in stage.parameters():
            if p.grad is not None:
                p.grad.mul_(coef)


def global_squares(
    stage: GPTStage, role: RankRole, device: torch.device, group: Any = None
) -> torch.Tensor:
    """The global sum of squares: :func:`local_squares` all-reduced over ``group`` (the
    world), not read (the dry run records this collective as it is)."""
    sq = local_squares(stage, role, device)
    comm.all_reduce(sq, group=group)
    return sq


def clip_by_global_norm(
    stage: GPTStage,
    role: RankRole,
    max_norm: float,
    device: torch.device,
    group: Any = None,
) -> float:
    """Scale the local gradients to a global norm of at most ``max_norm``; returns the norm
    before clipping (the same on every rank; inf or NaN, and nothing scaled, when some
    rank's gradient is). Collective over ``group`` (the world): the fp16 path's, after the
    overflow check; without a loss scaler the squares ride in the iteration's one collective
    (``step_agreement``) and the engine calls :func:`scale_to_norm` itself."""
    sq = global_squares(stage, role, device, group)
    synchronize(sq.device)  # abortable where the host waits (in-place workers)
    norm = math.sqrt(float(sq.item()))
    scale_to_norm(stage, norm, max_norm)
    return norm
