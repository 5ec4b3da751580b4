"""Who writes which layer, and which layers a rank loads: pure functions of a Plan.

Saving: every global layer is written exactly once, by one rank that holds it. The holders of a
layer are every TP rank of every replica group (one per pipeline) whose stage contains it; the
writes are spread over all of them, greedily by bytes, so every replica and every TP rank of
the job works in parallel and no layer is written twice. Within a replica group the TP shards
of a layer are gathered to the rank that writes it (see ``snapshot.py``).

Loading: a rank of any layout reads the layers of its own stage and slices them for its TP
rank; it needs nothing from the layout the checkpoint was saved from.

No I/O, no torch, no clock: values in, values out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from sailor.schemas.plan import Plan

__all__ = [
    "RankPlace",
    "layers_written_by",
    "layout_summary",
    "place_of",
    "writer_assignment",
    "writer_ranks",
]


@dataclass(frozen=True)
class RankPlace:
    """Where a global rank sits in a plan."""

    rank: int
    pipeline: int
    stage: int
    tp_rank: int
    tp_size: int
    layers: tuple[int, ...]
    group_ranks: tuple[int, ...]
    """Global ranks of the replica group (the TP group), in TP-rank order."""


def place_of(plan: Plan, rank: int) -> RankPlace:
    """The pipeline, stage, TP coordinates and owned layers of ``rank`` (pipeline-major order)."""
    order = plan.ranks()
    if not 0 <= rank < len(order):
        raise ValueError(f"rank={rank}: outside 0..{len(order) - 1} of plan {plan.plan_id!r}")
    pi, si, t = order[rank]
    stage = plan.pipelines[pi].stages[si]
    first = rank - t
    return RankPlace(
        rank=rank,
        pipeline=pi,
        stage=si,
        tp_rank=t,
        tp_size=stage.replica.tp,
        layers=tuple(stage.layers),
        group_ranks=tuple(range(first, first + stage.replica.tp)),
    )


def writer_assignment(plan: Plan, layer_bytes: Mapping[int, int] | None = None) -> dict[int, int]:
    """Global layer -> the global rank that writes it.

    Greedy longest-processing-time: layers in order of decreasing bytes (``layer_bytes``, or 1
    each if unknown), each to the holder rank with the fewest bytes so far; ties go to the rank
    whose replica group (its pipeline's stage: the GPUs of one node, or part of one) has
    written the fewest bytes, so the writes spread over the replicas' nodes and their
    storage, not over the TP ranks of the first replica's node; then to the rank holding
    fewer layers (it has fewer other chances to help), then the lower rank.
    Deterministic, so every rank computes the same answer without talking.
    """
    holders: dict[int, list[int]] = {layer: [] for layer in range(plan.num_layers)}
    for rank, (pi, si, _t) in enumerate(plan.ranks()):
        for layer in plan.pipelines[pi].stages[si].layers:
            holders[layer].append(rank)
    held = {
        r: plan.pipelines[pi].stages[si].num_layers for r, (pi, si, _t) in enumerate(plan.ranks())
    }
    group = {r: (pi, si) for r, (pi, si, _t) in enumerate(plan.ranks())}
    size = {layer: (layer_bytes or {}).get(layer, 1) for layer in holders}
    load = dict.fromkeys(range(len(plan.ranks())), 0)
    group_load = dict.fromkeys(group.values(), 0)
    out: dict[int, int] = {}
    for layer in sorted(holders, key=lambda x: (-size[x], x)):
        best = min(holders[layer], key=lambda r: (load[r], group_load[group[r]], held[r], r))
        out[layer] = best
        load[best] += size[layer]
        group_load[group[best]] += size[layer]
    return dict(sorted(out.items()))


def layers_written_by(
    plan: Plan, rank: int, layer_bytes: Mapping[int, int] | None = None
) -> tuple[int, ...]:
    """Layers ``rank`` writes (possibly none)."""
    return tuple(x for x, r in writer_assignment(plan, layer_bytes).items() if r == rank)


def writer_ranks(plan: Plan, layer_bytes: Mapping[int, int] | None = None) -> tuple[int, ...]:
    """Ranks that write at least one layer: the committer waits for a part from each."""
    return tuple(sorted(set(writer_assignment(plan, layer_bytes).values())))


def layout_summary(plan: Plan) -> str:
    """One line per pipeline, e.g. 'p0: [0-3]x2 [4-9]x1 mbs=2x4'."""
    lines = []
    for pi, p in enumerate(plan.pipelines):
        stages = " ".join(f"[{s.first_layer}-{s.last_layer}]tp{s.replica.tp}" for s in p.stages)
        lines.append(f"p{pi}: {stages} mbs={p.microbatch_size}x{p.num_microbatches}")
    return "; ".join(lines)
