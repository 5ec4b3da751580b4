"""Sample-weighted gradient synchronization across pipelines, per layer segment.

Applies the groups that :mod:`~sailor.megatron_patch.sync_groups` describes to the local
gradients of a :class:`~sailor.megatron_patch.model.GPTStage`: for each group (in the global
order) it flattens what this rank contributes into one buffer, all-reduces it (SUM) and
copies the result back. Weighting by samples is already in the gradients (the loss of each
microbatch is scaled by ``microbatch_size / global_batch_size``), so after the sum every
replica holds the gradient of the mean loss over the whole global batch.

The flat layout of a group's buffer is identical on all its ranks: parameters in global
layer order, then module order, and for TP-sharded parameters the chunk the group owns,
which has the same shape whatever the holder's TP degree.

The reduction runs in :data:`GRAD_REDUCE_DTYPE` (fp32, as Megatron reduces bf16 runs' gradients
by default): gradients live in fp32 next to the fp32 master weights, and summing them in
half precision over many replicas would lose the small contributions. The simulator prices
the same dtype. Buffers are on the gradients' device (the rank's device).
"""

from __future__ import annotations

from typing import Any

import torch

from sailor.comm import api as comm
from sailor.megatron_patch.model import GPTStage
from sailor.megatron_patch.state import key_layer
from sailor.megatron_patch.sync_groups import SyncItem
from sailor.megatron_patch.tp_layers import tp_dim_of

__all__ = ["GRAD_REDUCE_DTYPE", "sync_gradients", "tied_names"]

GRAD_REDUCE_DTYPE = torch.float32
"""The dtype gradients are all-reduced in (and priced at by the simulator)."""


def tied_names(stage: GPTStage) -> tuple[str, str]:
    """Names of the two copies of a tied embedding matrix (embedding, LM head)."""
    return "0.wte.weight", f"{stage.spec.num_all_layers - 1}.lm_head.weight"


def _grad(p: torch.nn.Parameter) -> torch.Tensor:
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    return p.grad


def _views(stage: GPTStage, item: SyncItem, skip: set[str]) -> list[torch.Tensor]:
    g = item.group
    out: list[torch.Tensor] = []
    for name, p in stage.keyed_parameters():
        layer = key_layer(name)
        if not g.first_layer <= layer <= g.last_layer or name in skip:
            continue
        dim = tp_dim_of(p)
        if g.kind == "chunk":
            if dim is not None:
                out.append(_grad(p).chunk(item.num_sub_chunks, dim=dim)[item.sub_chunk])
            elif item.with_replicated:
                out.append(_grad(p))
        elif dim is None:
            out.append(_grad(p))
    return out


def _all_reduce_views(views: list[torch.Tensor], scale: float, group: Any) -> None:
    if not views:
        return
    flat = torch.cat([v.reshape(-1).to(GRAD_REDUCE_DTYPE) for v in views])
    if scale != 1.0:
        flat.mul_(scale)
    comm.all_reduce(flat, group=group)
    off = 0
    for v in views:
        n = v.numel()
        v.copy_(flat[off : off + n].view(v.shape))
        off += n


@torch.no_grad()
def sync_gradients(stage: GPTStage, sync: list[tuple[SyncItem, Any]]) -> None:
    """All-reduce this rank's gradients in every group it belongs to, in group order.

    Collective: every rank of the plan must call it after its backward passes.
    """
    tie = stage.spec.tie_embeddings
    names = tied_names(stage)
    params = dict(stage.keyed_parameters())
    tied_local = [params[n] for n in names if n in params] if tie else []
    skip = set(names) if tie else set()
    had_tied_group = False
    for item, pg in sync:
        if item.group.kind == "tied":
            had_tied_group = True
            views = [_grad(p).chunk(item.num_sub_chunks, dim=0)[item.sub_chunk] for p in tied_local]
            buf = torch.stack([v.to(GRAD_REDUCE_DTYPE) for v in views]).sum(0)
            comm.all_reduce(buf, group=pg)
            for v in views:
                v.copy_(buf)
            continue
        _all_reduce_views(_views(stage, item, skip), item.scale, pg)
    if tie and not had_tied_group and len(tied_local) == 2:
        # One rank holds both copies and nobody else holds either: a local sum.
        total = _grad(tied_local[0]) + _grad(tied_local[1])
        for p in tied_local:
            _grad(p).copy_(total)
