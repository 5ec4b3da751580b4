"""The end of an iteration: gradient all-reduces after the last backward, and the loss one.

Step 4 of the model (docs/simulator-model.md): after its last backward every stage pays the
fixed sync cost and the framework's per-iteration time, then all-reduces each of its layer
segments with the other holders (a segment's ring starts when all its holders are ready),
then the tied embedding gradient if the calibration says the framework reduces it
separately; a loss all-reduce over all ranks follows the optimizer step if the calibration
says the framework runs one. Their cross-zone bytes are added to the egress.

Pure: reads the simulation's inputs and the pipelines' runs, returns values; no I/O, no
clock, no globals.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from sailor.schemas import Calibration, ModelSpec, Pipeline, Plan, ReplicaGroup
from sailor.schemas.precision import GRAD_ALLREDUCE_BYTES
from sailor.simulator.network_model import AllReduce, guessed_link, ring_allreduce
from sailor.simulator.pipeline_kinds import PipelineKind
from sailor.simulator.rank_timing import PipelineRuns, RankTiming, StageRef
from sailor.simulator.sim_inputs import SimInputs

__all__: list[str] = [
    "gradient_sync",
    "loss_allreduce_time",
]

_LOSS_BYTES = 8
"""The loss all-reduce of megatron_patch: one float64."""


def gradient_sync(
    plan: Plan,
    inp: SimInputs,
    kinds: list[PipelineKind],
    runs: PipelineRuns,
    slowdown: float,
    ranks: RankTiming,
    egress_bytes: dict[tuple[str, str], float],
) -> tuple[dict[StageRef, float], dict[StageRef, float]]:
    """When each stage is ready for its optimizer step, and its time in gradient all-reduces.

    After its last backward a stage pays the fixed sync cost and the framework's
    per-iteration time (``slowdown`` times), then all-reduces each layer segment with its
    other holders, then the tied embedding; adds their cross-zone bytes to ``egress_bytes``.
    """
    pipelines = plan.pipelines
    cal = inp.cal
    fixed_of: dict[str, float] = {}
    ready: dict[StageRef, float] = {}
    for pi, p in enumerate(pipelines):
        ends = runs.stage_end_s[pi]
        for si, s in enumerate(p.stages):
            g = s.replica.gpu_type
            fixed = fixed_of.get(g)
            if fixed is None:
                fixed = inp.gcal(g).sync_fixed_s + slowdown * inp.framework(g).iteration_s
                fixed_of[g] = fixed
            ready[(pi, si)] = ends[si] + fixed
    sync_of: dict[StageRef, float] = dict.fromkeys(ready, 0.0)

    def reduce(holders: list[StageRef], ar: AllReduce, node_bytes: float, chains: bool) -> None:
        inp.notes.add(*ar.notes)
        inp.uses_estimates |= any(guessed_link(n) for n in ar.notes)
        took = ranks.grad_allreduce_s(ar, holders, node_bytes, chains=chains)
        start = max(ready[h] for h in holders)
        for h in holders:
            ready[h] = start + took
            sync_of[h] += took
        for src, dst, nbytes in ar.cross_zone_bytes:
            egress_bytes[(src, dst)] = egress_bytes.get((src, dst), 0.0) + nbytes

    sizes_by_tp = inp.sizes_by_tp
    grad_bytes = _grad_bytes(inp.model, cal)
    per_gpu_of: dict[int, ReplicaGroup] = {}
    # DeepSpeed reduces the stage's gradients after the last backward; segments go in
    # reverse layer order, as gradients become available in backward
    for lo, hi, holders in reversed(_segments(plan, kinds)):
        groups = [pipelines[pi].stages[si].replica for pi, si in holders]
        node_bytes = 0.0
        elements = 0.0
        for tp in dict.fromkeys(r.tp for r in groups):  # each TP degree once, first seen first
            n_el = sum(sizes_by_tp[tp][layer].params for layer in range(lo, hi + 1))
            node_bytes = max(node_bytes, tp * n_el * grad_bytes)
            elements = max(elements, float(n_el))
        eff = inp.cal.network_link_eta(*(r.gpu_type for r in groups))
        if cal.ring_links == "per_gpu":
            groups, node_bytes = _per_gpu(groups, per_gpu_of), elements * grad_bytes
        ar = ring_allreduce(inp.links.network, groups, node_bytes, elements, eff, links=inp.links)
        reduce(holders, ar, node_bytes, True)
    tied = _tied_allreduce(plan, inp.model, inp) if cal.tied_allreduce else None
    if tied is not None:
        reduce(*tied, False)
    return ready, sync_of


def loss_allreduce_time(inp: SimInputs, pipelines: Sequence[Pipeline], ranks: RankTiming) -> float:
    """The loss all-reduce over every rank after the optimizer step, if the calibration says
    the framework runs one: it is the iteration's barrier."""
    if not inp.cal.loss_allreduce:
        return 0.0
    everyone = [s.replica for p in pipelines for s in p.stages for _ in range(s.replica.tp)]
    eff = inp.cal.network_link_eta(*(r.gpu_type for r in everyone))
    loss_ar = ring_allreduce(inp.links.network, everyone, _LOSS_BYTES, 1.0, eff, links=inp.links)
    inp.notes.add(*loss_ar.notes)
    return ranks.loss_allreduce_s(loss_ar, len(everyone), _LOSS_BYTES)


def _segments(
    plan: Plan, kinds: list[PipelineKind]
) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """``plan.segments()`` as (first layer, last layer, holders), from the distinct pipelines.

    The common refinement of the partitions: every stage starts a segment, and a segment
    lies inside one stage of each pipeline.
    """
    cuts: set[int] = set()
    for kind in {id(k): k for k in kinds}.values():
        cuts.update(
            i
            for i, si in enumerate(kind.stage_of_layer)
            if i == 0 or si != kind.stage_of_layer[i - 1]
        )
    bounds = [*sorted(cuts), plan.num_layers]
    return [
        (a, b - 1, [(pi, kind.stage_of_layer[a]) for pi, kind in enumerate(kinds)])
        for a, b in itertools.pairwise(bounds)
    ]


def _tied_allreduce(
    plan: Plan, model: ModelSpec, inp: SimInputs
) -> tuple[list[tuple[int, int]], AllReduce, float] | None:
    """The tied embedding gradient's all-reduce among the stages holding the embedding or the
    head (megatron_patch's last sync group): its holders, its time and the bytes per node;
    None without one.

    With ``vocab_parallel`` the ``vocab x hidden`` matrix is split over a stage's TP ranks and
    reduced in ``T`` chunk groups (``T`` the largest TP degree among the holders), one
    ``V·h/T`` chunk per rank each, as a segment's TP-sharded parameters are: a node moves the
    whole matrix once, and a GPU of a TP-``t`` holder ``V·h/t``. Without it the matrix is
    replicated on the TP ranks of a stage, each reducing it whole. The ring is modelled over
    the stages' nodes, as for a segment.
    """
    if not model.tie_embeddings:
        return None
    head = model.num_all_layers - 1
    holders = [
        (pi, si)
        for pi, p in enumerate(plan.pipelines)
        for si, s in enumerate(p.stages)
        if s.first_layer == 0 or s.last_layer == head
    ]
    if len(holders) < 2:
        return None  # one stage holds both copies: a local sum
    groups = [plan.pipelines[pi].stages[si].replica for pi, si in holders]
    n_el = float(model.vocab_size * model.hidden_size)
    if inp.cal.vocab_parallel:
        node_bytes = n_el * _grad_bytes(model, inp.cal)
        # a TP-t holder's GPU takes part in T/t chunk groups in turn: V·h/t elements, the
        # most on the smallest TP degree (what a per-GPU ring moves)
        n_el /= min(g.tp for g in groups)
    else:
        node_bytes = max(g.tp for g in groups) * n_el * _grad_bytes(model, inp.cal)
    eff = inp.cal.network_link_eta(*(r.gpu_type for r in groups))
    if inp.cal.ring_links == "per_gpu":
        groups, node_bytes = _per_gpu(groups, {}), n_el * _grad_bytes(model, inp.cal)
    return (
        holders,
        ring_allreduce(inp.links.network, groups, node_bytes, n_el, eff, links=inp.links),
        node_bytes,
    )


def _grad_bytes(model: ModelSpec, cal: Calibration) -> int:
    """Bytes per gradient element in the gradient all-reduces: the engine reduces its fp32
    gradients (autocast); DeepSpeed's FP16_Optimizer reduces the 16-bit ones."""
    if cal.grad_allreduce_bytes is not None:
        return cal.grad_allreduce_bytes
    if cal.mixed_precision == "autocast":
        return GRAD_ALLREDUCE_BYTES
    return model.param_bytes()


def _per_gpu(groups: list[ReplicaGroup], memo: dict[int, ReplicaGroup]) -> list[ReplicaGroup]:
    """``groups`` as 1-GPU VMs of their type and zone (``Calibration.ring_links='per_gpu'``,
    the original artifact's ring: each rank's ring over a 1-GPU VM's link curve)."""
    out = []
    for r in groups:
        one = memo.get(id(r))
        if one is None:
            one = memo[id(r)] = r.model_copy(update={"gpus_per_node": 1, "tp": 1})
        out.append(one)
    return out
