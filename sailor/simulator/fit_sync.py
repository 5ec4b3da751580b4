"""The online fit of the gradient sync's constants, ``sync_fixed_s`` and ``network_efficiency``.

``sync_fixed_s`` per GPU type (kind): the median over its ranks without a gradient all-reduce
of their sync and the rest of their step outside pipeline, sync and optimizer, less the
profiled framework time per iteration (of a tied embedding's holders only the last to arrive
counts). ``network_efficiency`` per group of stages that all-reduce together, from the rank
that arrived last; a kind's value is the geometric mean over its groups. The method, and when
each constant counts as identified, is in :mod:`sailor.simulator.online_fit`'s docstring.

Pure: values in, one value out; no I/O, no clock.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping

from sailor.schemas import Calibration, Estimate, ModelSpec, NetworkProfile, Plan
from sailor.schemas.online_calibration import FittedConstant
from sailor.simulator.fit_corners import with_all, with_constant
from sailor.simulator.fit_evidence import (
    ETA_MIN,
    RankEvidence,
    kept_constant,
    median_interval,
    robust_spread,
    stage_rows,
)

__all__: list[str] = [
    "fit_sync_constants",
    "tied_holders",
]

_SYNC_SHARE = 0.2
"""η is identified from a replica group whose all-reduces are at least this share of its sync."""


def _groups(plan: Plan) -> dict[tuple[int, int], int]:
    """(pipeline, stage) -> id of its replica group: stages that share a layer segment."""
    parent: dict[tuple[int, int], tuple[int, int]] = {}

    def find(x: tuple[int, int]) -> tuple[int, int]:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for seg in plan.segments():
        holders = list(seg.holders)
        for h in holders[1:]:
            parent[find(h)] = find(holders[0])
    for pi, p in enumerate(plan.pipelines):
        for si in range(p.depth):
            find((pi, si))
    roots = sorted({find(x) for x in parent})
    ids = {r: i for i, r in enumerate(roots)}
    return {x: ids[find(x)] for x in list(parent)}


def _eta_of(ar1: float, per_unit: float, comm: float) -> float:
    """The η at which a group's all-reduces take ``comm``: they take ``ar1`` at η = 1 and
    ``per_unit`` more per unit of ``1/η − 1`` on their links (``ar1`` itself when η applies
    on every link as read; less on links slower than those it was read on:
    ``schemas.calibration.eta_on``). Within [ETA_MIN, 1]."""
    if comm <= ar1 or per_unit <= 0:
        return 1.0
    return min(1.0, max(ETA_MIN, 1.0 / (1.0 + (comm - ar1) / per_unit)))


def _eta_interval(ar1: float, per_unit: float, comm: float, r: RankEvidence) -> tuple[float, float]:
    """The 95 % interval of one replica group's η (:func:`_eta_of` at ``comm``) from its
    last arriver's step-to-step spread of the sync: the standard error of its median sync
    over its steps (:func:`median_interval`, Student's t) moves ``comm`` by as much, and η
    the other way (a comm that could reach ``ar1`` puts the high end at 1). A lone group's
    η, with no other group to compare it with, is as uncertain as its sync; steps that do
    not vary give the point."""
    _, _, high = median_interval(r.t.sync_s, 0.0, 1, [r.t.sync_spread], r.t.steps)
    half = high - r.t.sync_s
    return _eta_of(ar1, per_unit, comm + half), _eta_of(ar1, per_unit, comm - half)


def _scales_as_read(cal: Calibration, kinds: list[str], network: NetworkProfile) -> bool:
    """Whether the all-reduces of a plan of ``kinds`` take at η their time at η = 1 over η,
    so that one simulation gives what a unit of ``1/η − 1`` adds (``per_unit`` of
    :func:`_eta_of` is the time at η = 1): no kind's efficiency was read on a link of its
    own (``GPUCalibration.efficiency_link_gbps`` None: nothing to transport, η applies on
    every link as it is) and the network profile holds no measured all-reduce of these
    kinds (a measured latency is paid once, not derated by η: ``network_model.
    ring_allreduce``). The simulation has every rank on a device of its own (the online
    fit's), where an all-reduce's time is the ring's."""
    if any(cal.for_gpu(g).efficiency_link_gbps is not None for g in kinds):
        return False
    return not any(c.endpoint.gpu_type in kinds for c in network.collectives)


def tied_holders(plan: Plan, model: ModelSpec) -> frozenset[tuple[int, int]]:
    """(pipeline, stage) of the stages in the engine's tied-embedding group when it spans
    stages: the embedding's and the head's copies are all-reduced together after the
    segments (``megatron_patch.sync_groups``), so a holder's measured sync includes waiting
    for the other copy's stage to finish its backward (in 1F1B the head's stage ends first
    and waits out the pipeline's drain). That wait is not a fixed cost of the sync."""
    if not model.tie_embeddings:
        return frozenset()
    head = plan.num_layers - 1
    holders = frozenset(
        (pi, si)
        for pi, p in enumerate(plan.pipelines)
        for si, st in enumerate(p.stages)
        if st.first_layer == 0 or st.last_layer == head
    )
    return holders if len(holders) > 1 else frozenset()


def fit_sync_constants(
    plan: Plan,
    ranks: list[RankEvidence],
    kinds: list[str],
    cal: Calibration,
    sim: Callable[[Calibration], Estimate],
    out: list[FittedConstant],
    notes: list[str],
    tied: frozenset[tuple[int, int]] = frozenset(),
    iteration_s: Mapping[str, float] | None = None,
    *,
    network: NetworkProfile,
) -> Calibration:
    iteration_s = iteration_s or {}
    rows1 = stage_rows(sim(with_all(cal, kinds, network_efficiency=1.0)))
    # and at η = 1/2 (one unit of 1/η − 1): what a unit adds on these links; where the
    # all-reduces scale as 1/η a unit adds their time at η = 1 (bit for bit: halving η
    # doubles every step exactly), and that simulation is not run
    rows2 = (
        rows1
        if _scales_as_read(cal, kinds, network)
        else stage_rows(sim(with_all(cal, kinds, network_efficiency=0.5)))
    )
    doubled = rows2 is not rows1
    lone = [
        r
        for r in ranks
        if rows1[(r.pipeline, r.stage)].grad_sync_s <= 0 and (r.pipeline, r.stage) not in tied
    ]
    # the tied copies' all-reduce is a collective of its own: its last arriver (least sync)
    # waited for no one, so its sync is the fixed cost (the tied all-reduce inside it, as
    # the calibration's tied_allreduce=False says); the others' syncs hold their waits. Only
    # where no holder also all-reduces a segment (else the order of arrival is unknown).
    holders = [r for r in ranks if (r.pipeline, r.stage) in tied]
    if holders and all(rows1[(r.pipeline, r.stage)].grad_sync_s <= 0 for r in holders):
        arrived = min(holders, key=lambda r: r.t.sync_s)
        lone.append(arrived)
        if len(holders) > 1:
            notes.append(
                f"tied embedding: rank {arrived.rank} arrived last at its all-reduce (sync "
                f"{arrived.t.sync_s:.3g} s); the {len(holders) - 1} other holder(s) waited for it "
                "(not read as sync_fixed_s)"
            )
    elif holders:
        notes.append(
            f"{len(holders)} rank(s) hold a tied embedding copy and all-reduce segments: their "
            "syncs are not read as sync_fixed_s"
        )
    fixed: dict[str, float] = {}
    kept: set[str] = set()  # kinds whose fixed[] is the calibration's c, not a measured sync

    def beyond_update(r: RankEvidence) -> float:
        """The rank's sync with the rest of its step outside pipeline, sync and optimizer,
        less its profiled update and framework time: what c is fitted from (below)."""
        st = rows1[(r.pipeline, r.stage)]
        return (
            r.t.sync_s + r.t.rest_s + r.t.optim_s - st.update_s - iteration_s.get(r.gpu_type, 0.0)
        )

    for g in kinds:
        prev = cal.for_gpu(g).sync_fixed_s
        xs = [r for r in lone if r.gpu_type == g]
        if not xs:
            out.append(
                kept_constant(g, "sync_fixed_s", prev, "every rank of this kind all-reduces")
            )
            fixed[g] = prev
            kept.add(g)
            continue
        fixed[g] = statistics.median(r.t.sync_s for r in xs)  # the sync's own: for η below
        # the iteration's fixed time beyond the framework time the profile holds: the sync
        # outside the all-reduces and the rest of the step outside the pipeline, the sync and
        # the optimizer (zeroing the gradients; the engine's loss all-reduce, which the
        # simulator adds only with loss_allreduce). The simulator adds c where the sync
        # starts: for the iteration's length, where in it the time is spent does not matter.
        frame = iteration_s.get(g, 0.0)
        # the optimizer step is not fitted: what it takes beyond its profiled time is a
        # fixed cost of the iteration too (a CPU's, not a network's)
        vals = [max(0.0, beyond_update(r)) for r in xs]
        value = statistics.median(vals)
        _, low, high = median_interval(
            value,
            robust_spread(vals),
            len(xs),
            [r.t.sync_spread for r in xs],
            sum(r.t.steps for r in xs),
        )
        out.append(
            FittedConstant(
                gpu_type=g,
                name="sync_fixed_s",
                value=value,
                low=max(0.0, low),
                high=high,
                previous=prev,
                samples=len(xs),
                fitted=True,
                evidence=(
                    f"median over {len(xs)} rank(s) without a gradient all-reduce of their sync "
                    f"and the step's rest outside pipeline, sync and optimizer, less the "
                    f"profiled framework time per iteration ({frame:.3g} s)"
                ),
            )
        )
        cal = with_constant(cal, g, sync_fixed_s=value)
    group_of = _groups(plan)
    last: dict[int, RankEvidence] = {}
    for r in ranks:
        if rows1[(r.pipeline, r.stage)].grad_sync_s <= 0:
            continue
        gid = group_of[(r.pipeline, r.stage)]
        if gid not in last or r.t.sync_s < last[gid].t.sync_s:
            last[gid] = r
    etas: dict[str, list[float]] = {g: [] for g in kinds}
    ends: dict[str, list[float]] = {g: [] for g in kinds}  # each group's interval's ends
    members: dict[int, set[str]] = {}
    for x, gid in group_of.items():
        members.setdefault(gid, set()).add(plan.pipelines[x[0]].stages[x[1]].replica.gpu_type)
    skipped = 0
    for gid, r in sorted(last.items()):
        ar1 = rows1[(r.pipeline, r.stage)].grad_sync_s
        # a measured fixed part is the lone ranks' sync alone; the calibration's c (no lone
        # rank of the kind) also holds the rest of the step and the optimizer beyond its
        # profile, so it is taken from the same sum of this rank's (a real worker reports
        # those apart from its sync: subtracting c from the sync alone left the all-reduces
        # short by them, and η too high)
        mine = beyond_update(r) if r.gpu_type in kept else r.t.sync_s
        comm = mine - fixed[r.gpu_type]
        if comm <= 0 or comm < _SYNC_SHARE * r.t.sync_s:
            skipped += 1
            continue
        per_unit = rows2[(r.pipeline, r.stage)].grad_sync_s - ar1 if doubled else ar1
        eta = _eta_of(ar1, per_unit, comm)
        lo, hi = _eta_interval(ar1, per_unit, comm, r)
        for g in members[gid]:
            etas[g].append(eta)
            ends[g].extend((lo, hi))
    if skipped:
        notes.append(f"{skipped} replica group(s) whose all-reduces were < 20% of their sync")
    for g in kinds:
        prev = cal.for_gpu(g).network_efficiency
        found = etas[g]
        if not found:
            out.append(
                kept_constant(
                    g, "network_efficiency", prev, "no replica group's all-reduce identified"
                )
            )
            continue
        # the geometric mean, within its readings (one reading: itself, not its exp(log))
        mean = math.exp(statistics.fmean(math.log(x) for x in found))
        value = min(1.0, max(found), max(min(found), mean))
        out.append(
            FittedConstant(
                gpu_type=g,
                name="network_efficiency",
                value=value,
                low=min(*found, *ends[g], value),
                high=max(*found, *ends[g], value),
                previous=prev,
                samples=len(found),
                fitted=True,
                evidence=(
                    f"geometric mean over {len(found)} replica group(s): simulated all-reduce at "
                    "η=1 over the last arriver's sync less the fixed cost; range over the "
                    "groups and each one's 95 % interval from its sync's step-to-step spread"
                ),
            )
        )
        cal = with_constant(cal, g, network_efficiency=value)
    return cal
