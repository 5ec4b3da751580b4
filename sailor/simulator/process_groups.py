"""The process groups of Sailor's engine for a plan: who is in which group, decided from the
plan alone.

Pure (no torch): the engine (``megatron_patch.groups``) creates exactly the groups
:func:`engine_group_ranks` lists, and the simulator counts a rank's communicators
(:func:`engine_communicators`) from the same list, so the memory it prices for them follows
the engine's layout. Global rank order is :meth:`Plan.ranks` (pipeline-major, then stage,
then TP rank; :func:`rank_of`).

Gradients are synchronized per **layer segment** (``Plan.segments()``: the
common refinement of every pipeline's partition). For a segment held by replica groups of
TP degrees ``t_1..t_k`` with ``T = max t_i``, every TP-sharded parameter is cut along its TP
dimension into ``T`` equal chunks. Chunk ``c`` is all-reduced in a **chunk group** made of
one rank per holder: the rank of a TP-``t`` replica with ``tp_rank = c // (T // t)``. A rank
of a TP-``t`` replica therefore sits in ``T // t`` chunk groups of that segment and reduces
its local shard as ``T // t`` contiguous sub-chunks. (The same scheme as the original
artifact, which slices gradients along each tensor's TP dimension per group.) The full
tensor layout must make any contiguous chunk along the TP dim a valid shard; the model
keeps q, k, v (and swiglu's gate and up) as separate matrices for that reason.

Parameters replicated across TP ranks (norms, row-parallel biases, position embeddings):
when every holder has the same TP degree they ride along in chunk group ``c = tp_rank``
(the classic per-stage data-parallel group). With mixed TP they are all-reduced in one
**replicated group** of all holder ranks, each rank contributing ``grad / tp``: TP ranks hold
bitwise-identical copies and ``tp`` is a power of two, so the division is exact and the
sum is the plain sum over replicas.

With tied embeddings, layer 0's ``wte.weight`` and the head's ``lm_head.weight`` are two
copies kept equal, both split by vocabulary rows over their stage's TP ranks (tp_dim 0).
They are left out of their segments' groups and reduced in **tied groups**, chunked like the
segments' groups over every replica holding layer 0 or the head (``T`` = the largest TP
degree among them): tied group ``c`` has the rank of each such replica whose shard holds
row chunk ``c`` of ``T``, and each rank contributes the sum of the tied gradients it holds
(one copy, or both on a stage holding the whole model) of that chunk; both copies take the
result.

Weighting by samples is done by the loss scale (each microbatch's mean loss is multiplied
by ``microbatch_size / global_batch_size``), so every group does a plain SUM.

Every rank computes the same ordered list of groups; all ranks create the process groups
in that order, and each rank runs its collectives in that order, which rules out deadlock
between overlapping groups.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Literal

from sailor.schemas.plan import Plan

__all__ = [
    "SyncGroup",
    "SyncItem",
    "SyncKind",
    "engine_communicators",
    "engine_group_ranks",
    "rank_of",
    "rank_sync_items",
    "replica_ranks",
    "sync_groups",
]

SyncKind = Literal["chunk", "replicated", "tied"]


@dataclass(frozen=True)
class SyncGroup:
    """One all-reduce group of the plan (the same list on every rank)."""

    index: int
    kind: SyncKind
    ranks: tuple[int, ...]
    first_layer: int
    last_layer: int
    chunk: int = 0
    num_chunks: int = 1
    uniform_tp: bool = True
    """All holders of the segment have the same TP degree."""


@dataclass(frozen=True)
class SyncItem:
    """What one rank contributes to one group for the parameters of one layer range.

    For ``chunk`` groups the rank contributes, of every TP-sharded parameter, sub-chunk
    ``sub_chunk`` of ``num_sub_chunks`` of its local shard along the parameter's TP dim (and,
    if ``with_replicated``, its replicated parameters whole). For ``replicated`` groups it
    contributes its replicated parameters scaled by ``scale``; for ``tied`` groups sub-chunk
    ``sub_chunk`` of ``num_sub_chunks`` (along the vocabulary rows) of its tied embedding/head
    gradients, summed.
    """

    group: SyncGroup
    sub_chunk: int = 0
    num_sub_chunks: int = 1
    with_replicated: bool = False
    scale: float = 1.0


def rank_of(plan: Plan, pipeline: int, stage: int, tp_rank: int) -> int:
    """Global rank of (pipeline, stage, tp rank) in :meth:`Plan.ranks` order."""
    rank = 0
    for pi, p in enumerate(plan.pipelines):
        for si, s in enumerate(p.stages):
            if (pi, si) == (pipeline, stage):
                if not 0 <= tp_rank < s.replica.tp:
                    raise ValueError(f"tp_rank={tp_rank}: outside 0..{s.replica.tp - 1}")
                return rank + tp_rank
            rank += s.replica.tp
    raise ValueError(f"(pipeline={pipeline}, stage={stage}): not in the plan")


def replica_ranks(plan: Plan, pipeline: int, stage: int) -> tuple[int, ...]:
    """Global ranks of one replica group (one stage of one pipeline), in TP-rank order."""
    tp = plan.pipelines[pipeline].stages[stage].replica.tp
    first = rank_of(plan, pipeline, stage, 0)
    return tuple(range(first, first + tp))


def _first_ranks(plan: Plan) -> dict[tuple[int, int], int]:
    """Global rank of TP rank 0 of every (pipeline, stage): :func:`rank_of` for a whole plan
    at once (a plan of thousands of stages would otherwise walk it once per lookup)."""
    out: dict[tuple[int, int], int] = {}
    rank = 0
    for pi, p in enumerate(plan.pipelines):
        for si, s in enumerate(p.stages):
            out[(pi, si)] = rank
            rank += s.replica.tp
    return out


def engine_group_ranks(plan: Plan, tie_embeddings: bool) -> tuple[tuple[int, ...], ...]:
    """The rank sets of every process group the engine creates besides the world group, in
    the order it creates them: the TP group of every replica with TP > 1, then every
    gradient-sync group (:func:`sync_groups`), each rank set once (sorted): groups with the
    same ranks are one group. Every rank creates every group (``new_group`` is collective
    over the world); a rank has a communicator of each group it is in."""
    first = _first_ranks(plan)
    out: dict[tuple[int, ...], None] = {}
    for pi, p in enumerate(plan.pipelines):
        for si, s in enumerate(p.stages):
            if s.replica.tp > 1:
                r0 = first[(pi, si)]
                out.setdefault(tuple(range(r0, r0 + s.replica.tp)), None)
    for g in sync_groups(plan, tie_embeddings):
        out.setdefault(tuple(sorted(g.ranks)), None)
    return tuple(out)


def engine_communicators(plan: Plan, tie_embeddings: bool) -> tuple[int, ...]:
    """Per global rank, how many NCCL communicators it holds under the engine: the world
    group's (pipeline p2p and the first collective use it: ``batch_isend_irecv`` takes the
    group's own communicator, not a 2-rank one per peer) and one per group of
    :func:`engine_group_ranks` it is in."""
    count: Counter[int] = Counter()
    for ranks in engine_group_ranks(plan, tie_embeddings):
        count.update(ranks)
    return tuple(1 + count[r] for r in range(plan.num_gpus))


def sync_groups(plan: Plan, tie_embeddings: bool) -> list[SyncGroup]:
    """Every gradient-sync group of the plan, in the order all ranks create and use them.

    Groups of a single rank are left out (nothing to reduce).
    """
    first = _first_ranks(plan)
    out: list[SyncGroup] = []
    for seg in plan.segments():
        if len(seg.holders) < 2:
            continue
        tps = [plan.pipelines[p].stages[s].replica.tp for p, s in seg.holders]
        big = max(tps)
        uniform = len(set(tps)) == 1
        for c in range(big):
            ranks = tuple(
                first[(p, s)] + c // (big // t) for (p, s), t in zip(seg.holders, tps, strict=True)
            )
            out.append(
                SyncGroup(
                    index=len(out),
                    kind="chunk",
                    ranks=ranks,
                    first_layer=seg.first_layer,
                    last_layer=seg.last_layer,
                    chunk=c,
                    num_chunks=big,
                    uniform_tp=uniform,
                )
            )
        if not uniform:
            ranks = tuple(
                first[(p, s)] + t
                for (p, s), tp in zip(seg.holders, tps, strict=True)
                for t in range(tp)
            )
            out.append(
                SyncGroup(
                    index=len(out),
                    kind="replicated",
                    ranks=ranks,
                    first_layer=seg.first_layer,
                    last_layer=seg.last_layer,
                    uniform_tp=False,
                )
            )
    if tie_embeddings:
        out.extend(_tied_groups(plan, len(out), first))
    return out


def _tied_groups(
    plan: Plan, first_index: int, first: dict[tuple[int, int], int]
) -> list[SyncGroup]:
    """The tied embedding's chunk groups over every replica holding layer 0 or the head."""
    head = plan.num_layers - 1
    holders = [
        (pi, si, s.replica.tp)
        for pi, p in enumerate(plan.pipelines)
        for si, s in enumerate(p.stages)
        if s.first_layer == 0 or s.last_layer == head
    ]
    if len(holders) < 2:
        return []  # one replica holds both copies: its ranks sum them locally
    big = max(t for _, _, t in holders)
    return [
        SyncGroup(
            index=first_index + c,
            kind="tied",
            ranks=tuple(sorted(first[(pi, si)] + c // (big // t) for pi, si, t in holders)),
            first_layer=0,
            last_layer=head,
            chunk=c,
            num_chunks=big,
            uniform_tp=False,
        )
        for c in range(big)
    ]


def rank_sync_items(plan: Plan, groups: list[SyncGroup], rank: int) -> list[SyncItem]:
    """The groups ``rank`` takes part in, in group order, with what it contributes."""
    pi, si, t = plan.ranks()[rank]
    tp = plan.pipelines[pi].stages[si].replica.tp
    out: list[SyncItem] = []
    for g in groups:
        if rank not in g.ranks:
            continue
        if g.kind in ("chunk", "tied"):
            per = g.num_chunks // tp
            first = t * per
            if not first <= g.chunk < first + per:
                raise ValueError(f"rank {rank} listed in chunk group {g.index} it cannot hold")
            out.append(
                SyncItem(
                    group=g,
                    sub_chunk=g.chunk - first,
                    num_sub_chunks=per,
                    with_replicated=g.kind == "chunk" and g.uniform_tp,
                )
            )
        else:
            out.append(SyncItem(group=g, scale=1.0 / tp))
    return out
