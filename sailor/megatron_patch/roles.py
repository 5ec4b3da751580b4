"""What one rank does in a plan: a pure function ``(plan, rank) -> RankRole``.

Global rank order is :meth:`Plan.ranks`: pipeline-major, then stage, then tensor-parallel
rank. From that order alone every rank can derive, without talking to anyone, which
pipeline/stage/TP rank it is, which global layers it builds, which ranks it exchanges
activations with, which ranks share its tensor-parallel group and which samples of the
global batch its pipeline processes.

Pipeline p2p between stages of different TP degrees: after a stage the activation is
replicated on all its TP ranks, so receiver ``j`` of stage ``s+1`` takes it from sender
``j % tp_s`` of stage ``s``; in backward, sender ``i`` of stage ``s`` takes the input
gradient (replicated on all TP ranks of stage ``s+1``) from receiver ``i % tp_{s+1}``.
Every tensor is sent exactly once per receiver (the original artifact sent a TP-4 -> TP-1
boundary's activation four times).

This module must never import torch: it is the part of the engine that is unit-tested on
plans of every shape and reused by the adapters.
"""

from __future__ import annotations

from dataclasses import dataclass

from sailor.schemas.plan import Plan

__all__ = [
    "RankRole",
    "pipeline_sample_offsets",
    "rank_of",
    "replica_ranks",
    "role_of",
]


@dataclass(frozen=True)
class RankRole:
    """Everything one rank needs to know about its place in a plan."""

    rank: int
    world_size: int
    pipeline: int
    stage: int
    tp_rank: int
    tp: int
    first_layer: int
    last_layer: int
    num_stages: int
    microbatch_size: int
    num_microbatches: int
    sample_offset: int
    """First sample (within the global batch) that this rank's pipeline processes."""
    tp_group: tuple[int, ...]
    """Ranks of this stage's replica group, in TP-rank order (includes this rank)."""
    fwd_recv_from: int | None
    """Rank of the previous stage that sends this rank its input activation."""
    fwd_send_to: tuple[int, ...]
    """Ranks of the next stage this rank sends its output activation to."""
    bwd_recv_from: int | None
    """Rank of the next stage that sends this rank the gradient of its output."""
    bwd_send_to: tuple[int, ...]
    """Ranks of the previous stage this rank sends its input gradient to."""
    recompute: bool

    @property
    def layers(self) -> range:
        return range(self.first_layer, self.last_layer + 1)

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.num_stages - 1

    @property
    def pipeline_samples(self) -> int:
        return self.microbatch_size * self.num_microbatches


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


def pipeline_sample_offsets(plan: Plan) -> tuple[int, ...]:
    """First sample of the global batch each pipeline processes (pipelines in plan order).

    Sample ``i`` of a global batch belongs to the pipeline whose range holds it; each
    pipeline's microbatch ``m`` holds samples ``offset + m*mbs .. offset + (m+1)*mbs - 1``.
    """
    out: list[int] = []
    acc = 0
    for p in plan.pipelines:
        out.append(acc)
        acc += p.samples
    return tuple(out)


def role_of(plan: Plan, rank: int) -> RankRole:
    """The role of ``rank`` in ``plan``; raises ValueError if the rank is not in it."""
    order = plan.ranks()
    if not 0 <= rank < len(order):
        raise ValueError(f"rank={rank}: plan has world size {len(order)}")
    pi, si, t = order[rank]
    pipe = plan.pipelines[pi]
    stage = pipe.stages[si]
    tp = stage.replica.tp

    fwd_recv_from: int | None = None
    bwd_send_to: tuple[int, ...] = ()
    if si > 0:
        prev_tp = pipe.stages[si - 1].replica.tp
        fwd_recv_from = rank_of(plan, pi, si - 1, t % prev_tp)
        bwd_send_to = tuple(rank_of(plan, pi, si - 1, i) for i in range(prev_tp) if i % tp == t)
    fwd_send_to: tuple[int, ...] = ()
    bwd_recv_from: int | None = None
    if si < pipe.depth - 1:
        next_tp = pipe.stages[si + 1].replica.tp
        fwd_send_to = tuple(rank_of(plan, pi, si + 1, j) for j in range(next_tp) if j % tp == t)
        bwd_recv_from = rank_of(plan, pi, si + 1, t % next_tp)

    return RankRole(
        rank=rank,
        world_size=len(order),
        pipeline=pi,
        stage=si,
        tp_rank=t,
        tp=tp,
        first_layer=stage.first_layer,
        last_layer=stage.last_layer,
        num_stages=pipe.depth,
        microbatch_size=pipe.microbatch_size,
        num_microbatches=pipe.num_microbatches,
        sample_offset=pipeline_sample_offsets(plan)[pi],
        tp_group=replica_ranks(plan, pi, si),
        fwd_recv_from=fwd_recv_from,
        fwd_send_to=fwd_send_to,
        bwd_recv_from=bwd_recv_from,
        bwd_send_to=bwd_send_to,
        recompute=stage.recompute,
    )
