"""What one rank does in a plan: a pure function ``(plan, rank) -> RankRole``.

Global rank order is :meth:`Plan.ranks`: pipeline-major, then stage, then tensor-parallel
rank. From that order alone every rank can derive, without talking to anyone, which
pipeline/stage/TP rank it is, which global layers it builds, which ranks it exchanges
activations with, which ranks share its tensor-parallel group and which samples of the
global batch its pipeline processes.

Pipeline p2p across a stage boundary is scatter + gather, as Megatron's
``scatter_gather_tensors_in_pipeline``, generalised to a TP-degree change
(:func:`boundary_pieces`). After a stage the activation is replicated on its ``a = tp_s``
ranks and must end up replicated on the ``b = tp_{s+1}`` ranks of the next stage. The
flattened activation is cut into ``n = lcm(a, b)`` equal chunks; sender ``i`` owns chunks
``[i*n/a, (i+1)*n/a)``, receiver ``j`` owns ``[j*n/b, (j+1)*n/b)``, and each (sender,
receiver) pair whose ranges overlap exchanges the overlap as one message. The receivers
then all-gather their slices inside their TP group (one node). So every chunk crosses the
boundary exactly once: one activation per microbatch in forward, whatever ``a`` and ``b``
(before: one full copy per receiver, ``b`` copies). The input gradient, replicated on the
receiving TP ranks, goes back along the same pairs (each receiver sends its own slice) and
the sending group all-gathers it: one gradient per microbatch (before: ``a`` copies).

This module must never import torch: it is the part of the engine that is unit-tested on
plans of every shape and reused by the adapters.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import lcm

from sailor.schemas.plan import Plan
from sailor.simulator.process_groups import rank_of, replica_ranks

__all__ = [
    "BoundaryPiece",
    "Piece",
    "RankRole",
    "boundary_pieces",
    "pipeline_sample_offsets",
    "rank_of",
    "replica_ranks",
    "role_of",
]


@dataclass(frozen=True)
class BoundaryPiece:
    """One message across a stage boundary, by TP ranks: chunks ``[lo, hi)`` of ``chunks``.

    In forward the sender's TP rank ``sender`` sends these chunks of the flattened
    activation to the receiver's TP rank ``receiver``; in backward the receiver sends the
    same chunks of the input gradient back.
    """

    sender: int
    receiver: int
    lo: int
    hi: int
    chunks: int


def boundary_pieces(tp_send: int, tp_recv: int) -> tuple[BoundaryPiece, ...]:
    """The messages of one boundary from a TP-``tp_send`` to a TP-``tp_recv`` stage (pure).

    ``n = lcm(tp_send, tp_recv)`` chunks; sender ``i`` owns ``[i*n/tp_send, (i+1)*n/tp_send)``,
    receiver ``j`` owns ``[j*n/tp_recv, (j+1)*n/tp_recv)``; one piece per overlapping pair,
    in sender-major order. The pieces partition ``[0, n)``: every chunk crosses once.
    """
    if tp_send < 1 or tp_recv < 1:
        raise ValueError(f"tp_send={tp_send}, tp_recv={tp_recv}: TP degrees must be >= 1")
    n = lcm(tp_send, tp_recv)
    per_s, per_r = n // tp_send, n // tp_recv
    out: list[BoundaryPiece] = []
    for i in range(tp_send):
        s_lo, s_hi = i * per_s, (i + 1) * per_s
        for j in range(s_lo // per_r, (s_hi - 1) // per_r + 1):
            lo, hi = max(s_lo, j * per_r), min(s_hi, (j + 1) * per_r)
            out.append(BoundaryPiece(sender=i, receiver=j, lo=lo, hi=hi, chunks=n))
    return tuple(out)


@dataclass(frozen=True)
class Piece:
    """One message of this rank across one boundary: chunks ``[lo, hi)`` with global ``peer``."""

    peer: int
    lo: int
    hi: int


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
    prev_pieces: tuple[Piece, ...]
    """With the previous stage: input-activation pieces received, input-gradient pieces sent
    (the same chunks both ways); they partition :attr:`prev_slice`. Empty on stage 0."""
    prev_chunks: int
    """Chunks the boundary with the previous stage cuts a tensor into (0 on stage 0)."""
    next_pieces: tuple[Piece, ...]
    """With the next stage: output-activation pieces sent, output-gradient pieces received;
    they partition :attr:`next_slice`. Empty on the last stage."""
    next_chunks: int
    """Chunks the boundary with the next stage cuts a tensor into (0 on the last stage)."""
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

    @property
    def prev_slice(self) -> tuple[int, int]:
        """Chunks ``[lo, hi)`` this rank receives from the previous stage (then all-gathers)."""
        per = self.prev_chunks // self.tp
        return self.tp_rank * per, (self.tp_rank + 1) * per

    @property
    def next_slice(self) -> tuple[int, int]:
        """Chunks ``[lo, hi)`` this rank sends to the next stage (and gets the gradient of)."""
        per = self.next_chunks // self.tp
        return self.tp_rank * per, (self.tp_rank + 1) * per

    @property
    def prev_peers(self) -> tuple[int, ...]:
        """Ranks of the previous stage this rank exchanges with, in chunk order."""
        return tuple(p.peer for p in self.prev_pieces)

    @property
    def next_peers(self) -> tuple[int, ...]:
        """Ranks of the next stage this rank exchanges with, in chunk order."""
        return tuple(p.peer for p in self.next_pieces)


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

    prev_pieces: tuple[Piece, ...] = ()
    prev_chunks = 0
    if si > 0:
        first = rank_of(plan, pi, si - 1, 0)
        pieces = boundary_pieces(pipe.stages[si - 1].replica.tp, tp)
        prev_chunks = pieces[0].chunks
        prev_pieces = tuple(Piece(first + p.sender, p.lo, p.hi) for p in pieces if p.receiver == t)
    next_pieces: tuple[Piece, ...] = ()
    next_chunks = 0
    if si < pipe.depth - 1:
        first = rank_of(plan, pi, si + 1, 0)
        pieces = boundary_pieces(tp, pipe.stages[si + 1].replica.tp)
        next_chunks = pieces[0].chunks
        next_pieces = tuple(Piece(first + p.receiver, p.lo, p.hi) for p in pieces if p.sender == t)

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
        prev_pieces=prev_pieces,
        prev_chunks=prev_chunks,
        next_pieces=next_pieces,
        next_chunks=next_chunks,
        recompute=stage.recompute,
    )
