"""The search's closed-form estimate of an allocation: sync, iteration time and $.

:class:`SyncModel` prices a ring all-reduce of a stage's gradients over the network's link
curves as the simulator does; :func:`overheads_for` gives each template its sync overhead
for a scenario's ring (what packing in :mod:`sailor.planner.allocate` charges a pipeline);
:func:`p2p_egress` counts the bytes a pipeline sends across zones; and
:func:`fast_estimate` prices a whole allocation with the simulator's closed form, ring
all-reduce and cost model (:class:`FastFigures`), so that only the best few allocations are
simulated. Pure: it never simulates and never mutates its inputs (memos on templates aside).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import cast

from sailor.planner.allocate import Allocation
from sailor.planner.pricing import GpuPricing
from sailor.planner.tables import CostTables, Kind
from sailor.planner.templates import PipelineTemplate
from sailor.schemas import BandwidthCurve, Endpoint
from sailor.schemas.calibration import LinkEta
from sailor.simulator.network_model import BUCKET_ELEMENTS, inter_curve, ring_order

__all__ = [
    "FastFigures",
    "SyncModel",
    "fast_estimate",
    "overheads_for",
    "p2p_egress",
]


@dataclass(frozen=True)
class FastFigures:
    """The search's own prediction for an allocation (the simulator has the last word)."""

    iteration_s: float
    cost_per_iter: float
    cost_per_hour: float
    sync_s: float


class SyncModel:
    """Ring all-reduce time of a stage's gradients and cross-zone bytes, as the simulator has it."""

    def __init__(self, tables: CostTables) -> None:
        self.tables = tables
        self._curves: dict[tuple[Kind, Kind], BandwidthCurve] = {}
        self._rings: dict[tuple[tuple[Kind, ...], int, float, float], float] = {}
        self._segments: dict[tuple[object, ...], float] = {}
        self._fixed: dict[str, float] = {}
        self._effs: dict[tuple[Kind, Kind], tuple[BandwidthCurve, float]] = {}
        self._hops: dict[tuple[tuple[Kind, ...], bool], list[tuple[BandwidthCurve, float]]] = {}
        self.interned: dict[object, object] = {}
        """Templates' stage shapes and GPU types, one object per value (:func:`overheads_for`)."""
        self.per_gpu = tables.inputs.calibration.ring_links == "per_gpu"
        """Each rank's ring over a 1-GPU VM's curve with its own bytes (the original's)."""

    def node_bytes(self, tp: int, elements: float, grad_bytes: float) -> float:
        """Bytes one ring member moves: a node's TP ranks together, or one rank."""
        return elements * grad_bytes * (1 if self.per_gpu else tp)

    def _curve(self, a: Kind, b: Kind) -> BandwidthCurve:
        key = (a, b)
        curve = self._curves.get(key)
        if curve is None:
            ra, rb = a.replica(), b.replica()
            if self.per_gpu:
                ra = ra.model_copy(update={"gpus_per_node": 1, "tp": 1})
                rb = rb.model_copy(update={"gpus_per_node": 1, "tp": 1})
            curve = inter_curve(self.tables.inputs.network, ra, rb)[0]
            self._curves[key] = curve
        return curve

    def _hop(self, a: Kind, b: Kind) -> tuple[BandwidthCurve, float]:
        """The curve and efficiency of a ring hop from ``a`` to ``b``."""
        hit = self._effs.get((a, b))
        if hit is None:
            cal = self.tables.inputs.calibration
            curve = self._curve(a, b)
            eff = cal.network_link_eta(a.gpu_type, b.gpu_type).on(curve.max_gbps)
            hit = self._effs[(a, b)] = (curve, eff)
        return hit

    def fixed_s(self, gpu_type: str) -> float:
        """Time between a stage's last backward and its gradient all-reduce, as the simulator
        charges it: the calibrated fixed sync cost plus the framework's per-iteration time."""
        hit = self._fixed.get(gpu_type)
        if hit is None:
            inp = self.tables.inputs
            ft = inp.profiles.framework_time(gpu_type)
            hit = inp.calibration.for_gpu(gpu_type).sync_fixed_s + (
                ft.iteration_s if ft is not None else 0.0
            )
            self._fixed[gpu_type] = hit
        return hit

    def ring_time(self, ring: Sequence[Kind], n: int, node_bytes: float, elements: float) -> float:
        """``n`` holders of the kinds in ``ring`` (zone-sorted distinct kinds)."""
        if n <= 1 or node_bytes <= 0:
            return 0.0
        kinds = tuple(ring)
        memo = (kinds, n, node_bytes, elements)
        hit = self._rings.get(memo)
        if hit is not None:
            return hit
        buckets = max(1, math.ceil(elements / BUCKET_ELEMENTS))
        chunk = node_bytes / buckets / n
        # the ring's hops depend on its kinds and on whether every kind has one member
        # only (computed once per ring: a replan prices ~1,000 distinct stage shapes)
        one_each = len(kinds) == 1 or n <= len(kinds)
        hops = self._hops.get((kinds, one_each))
        if hops is None:
            pairs = {(a, kinds[(i + 1) % len(kinds)]) for i, a in enumerate(kinds)}
            if not one_each:
                pairs |= {(a, a) for a in kinds}
            # hops of equal curve and efficiency take equal time: each priced once (the
            # step is their maximum, whatever the order)
            hops = list(dict.fromkeys(self._hop(a, b) for a, b in pairs))
            self._hops[(kinds, one_each)] = hops
        step = 0.0
        for curve, eff in hops:
            step = max(step, curve.transfer_time(chunk) / eff)
        out = 2.0 * (n - 1) * step * buckets
        self._rings[memo] = out
        return out

    def segment_ring(
        self,
        runs: Sequence[tuple[Kind, int]],
        node_bytes: float,
        elements: float,
        efficiency: LinkEta,
    ) -> float:
        """:func:`sailor.simulator.network_model.ring_allreduce` over nodes given as runs of
        (endpoint, nodes) in plan order: the ring sorts them by zone, then GPU type and node
        shape (so the plan's order does not matter), a step lasts as long as its slowest hop
        (the ring's lowest efficiency on that hop's link), and a measured all-reduce latency of the
        endpoint kind, when every node is of one kind, replaces the per-step link latency."""
        n = sum(c for _, c in runs)
        if n <= 1 or node_bytes <= 0:
            return 0.0
        merged: list[tuple[Kind, int]] = []
        for k, c in sorted(runs, key=lambda kc: ring_order(kc[0])):
            if merged and merged[-1][0] == k:
                merged[-1] = (k, merged[-1][1] + c)
            else:
                merged.append((k, c))
        pairs: set[tuple[Kind, Kind]] = set()
        for i, (k, c) in enumerate(merged):
            if c > 1:
                pairs.add((k, k))
            pairs.add((k, merged[(i + 1) % len(merged)][0]))
        memo = (frozenset(pairs), n, node_bytes, elements, efficiency)
        hit = self._segments.get(memo)
        if hit is not None:
            return hit
        measured = None
        if len(merged) == 1 and not self.per_gpu:  # one endpoint kind: measured latency
            k = merged[0][0]
            end = Endpoint(zone=k.zone, gpu_type=k.gpu_type, gpus_per_node=k.gpus_per_node)
            # the nodes of a ring are distinct nodes: only an inter-node measurement applies
            measured = self.tables.inputs.network.collective_latency(end, n, "inter_node")
        buckets = max(1, math.ceil(elements / BUCKET_ELEMENTS))
        chunk = node_bytes / buckets / n
        step = 0.0
        # hops over equal curves take equal time: each curve priced once (the step is
        # their maximum, whatever the order)
        for curve in dict.fromkeys(self._curve(a, b) for a, b in pairs):
            per_step = curve.transfer_time(chunk)
            if measured is not None:
                per_step -= curve.latency_s  # paid once per all-reduce, as measured
            step = max(step, per_step / efficiency.on(curve.max_gbps))
        out = 2.0 * (n - 1) * step * buckets + (0.0 if measured is None else measured * buckets)
        self._segments[memo] = out
        return out


def _endpoint(k: Kind) -> Kind:
    """The node a stage of kind ``k`` runs on, as a network endpoint (TP does not matter)."""
    return k if k.tp == 1 else Kind(k.gpu_type, 1, k.zone, k.gpus_per_node)


def overheads_for(
    templates: Iterable[PipelineTemplate],
    ring: Sequence[Kind],
    n_pipes: int,
    sync: SyncModel,
    param_bytes: int,
) -> dict[int, float]:
    """Per template: fixed sync cost + its all-reduces + its slowest optimizer step.

    Every pipeline holds every layer, so each layer segment's ring waits for all pipelines
    and the segments' all-reduces run one after the other (the simulator's order): the sync
    of a plan is the sum over segments, not the maximum over stages.
    """
    out: dict[int, float] = {}
    cal = sync.tables.inputs.calibration
    # ring and count are fixed here: a stage's all-reduce depends on its TP degree and
    # parameters only, and the fixed cost on its GPU type (a replan prices thousands of
    # stages of a few hundred distinct shapes; the sums below are the same additions).
    # Templates of one partition and TP on other GPU types have equal stage shapes: their
    # sum is added up once (the shapes are interned, so an id is a value here)
    rings: dict[tuple[int, float], float] = {}
    sums: dict[int, float] = {}
    fixed_of: dict[int, float] = {}
    for t in templates:
        shapes, gpu_types, update = _sync_shape(t, sync.interned)
        ar = sums.get(id(shapes))
        if ar is None:
            ar = 0.0
            for key in shapes:
                hit = rings.get(key)
                if hit is None:
                    tp, params = key
                    nb = sync.node_bytes(tp, params, param_bytes)
                    hit = rings[key] = sync.ring_time(ring, n_pipes, nb, params)
                ar += hit
            sums[id(shapes)] = ar
        fixed = fixed_of.get(id(gpu_types))
        if fixed is None:
            fixed = -math.inf
            for g in gpu_types:
                fixed = max(fixed, cal.for_gpu(g).sync_fixed_s)
            fixed_of[id(gpu_types)] = fixed
        out[id(t)] = fixed + ar + update
    return out


_SyncShape = tuple[tuple[tuple[int, float], ...], tuple[str, ...], float]


def _sync_shape(t: PipelineTemplate, interned: dict[object, object]) -> _SyncShape:
    """What :func:`overheads_for` reads of a template, kept on it: its stages' (TP degree,
    parameters) in order, its GPU types, and its slowest optimizer step. The first two are
    interned in ``interned`` (equal values, one object), so that callers may key on their
    ids while the templates hold them."""
    hit: _SyncShape | None = t.__dict__.get("_sync_shape")
    if hit is None:
        shapes = tuple((s.kind.tp, s.params) for s in t.stages)
        types = tuple(dict.fromkeys(s.kind.gpu_type for s in t.stages))
        hit = (
            cast(tuple[tuple[int, float], ...], interned.setdefault(shapes, shapes)),
            cast(tuple[str, ...], interned.setdefault(types, types)),
            max(s.update_s for s in t.stages),
        )
        object.__setattr__(t, "_sync_shape", hit)
    return hit


def p2p_egress(t: PipelineTemplate, tables: CostTables) -> tuple[tuple[str, str, float], ...]:
    """Bytes per microbatch a pipeline sends across zones, as the simulator counts them:
    forward the sender's output plus one attention mask per TP rank, backward the output."""
    hit: tuple[tuple[str, str, float], ...] | None = t.__dict__.get("_egress")
    if hit is None:
        rows: list[tuple[str, str, float]] = []
        for a, b in itertools.pairwise(t.stages):
            if a.kind.zone == b.kind.zone:
                continue
            arr = tables.arrays(a.kind.gpu_type, a.kind.tp, t.mbs)
            out = t.mbs * float(arr.out_layer[a.last_layer]) if arr is not None else 0.0
            cp = tables.p2p_copies(a.kind, b.kind) or (1, 1)
            rows.append((a.kind.zone, b.kind.zone, cp[0] * out + a.kind.tp * tables.mask_bytes))
            rows.append((b.kind.zone, a.kind.zone, cp[1] * out))
        hit = tuple(rows)
        object.__setattr__(t, "_egress", hit)
    return hit


def fast_estimate(
    alloc: Allocation,
    tables: CostTables,
    sync: SyncModel,
    pricing: GpuPricing | None = None,
) -> FastFigures:
    """Closed-form iteration time and $ of an allocation (GPUs at ``pricing``'s rates, cheapest
    first; else the tables' uniform rate).

    The time follows the simulator's schedule: each pipeline's 1F1B closed form, then one
    ring all-reduce per layer segment of the common refinement of the partitions, in reverse
    layer order, each starting once every stage holding the segment is ready (the rings of
    segments held by different stages run side by side), then each stage's optimizer step.
    Pipelines of one template are alike, so the work is per template, not per pipeline.
    """
    groups = alloc.groups()
    n = len(alloc.pipelines)
    pb = tables.grad_bytes
    cal = tables.inputs.calibration
    index = {id(t): i for i, (t, _, _) in enumerate(groups)}
    runs = [(index[id(t)], c) for t, c in alloc.plan_runs()]
    firsts = [[s.first_layer for s in t.stages] for t, _, _ in groups]
    ready = [
        [t.pipe_time(most) + sync.fixed_s(s.kind.gpu_type) for s in t.stages]
        for t, _, most in groups
    ]
    cuts = sorted({f for fs in firsts for f in fs})
    bounds = [*cuts, groups[0][0].stages[-1].last_layer + 1]
    ar_total = 0.0
    for a, b in reversed(list(itertools.pairwise(bounds))):
        at = [bisect.bisect_right(fs, a) - 1 for fs in firsts]
        node_bytes = 0.0
        elements = 0.0
        types: list[str] = []
        for (t, _, _), si in zip(groups, at, strict=True):
            st = t.stages[si]
            arr = tables.arrays(st.kind.gpu_type, st.kind.tp, t.mbs)
            el = float(arr.params[b] - arr.params[a]) if arr is not None else st.params
            node_bytes = max(node_bytes, sync.node_bytes(st.kind.tp, el, pb))
            elements = max(elements, el)
            types.append(st.kind.gpu_type)
        ring = [(_endpoint(groups[g][0].stages[at[g]].kind), c) for g, c in runs]
        ar = sync.segment_ring(ring, node_bytes, elements, cal.network_link_eta(*types))
        start = max(ready[g][si] for g, si in enumerate(at))
        for g, si in enumerate(at):
            ready[g][si] = start + ar
        ar_total += ar
    it = max(
        r + s.update_s
        for (t, _, _), row in zip(groups, ready, strict=True)
        for s, r in zip(t.stages, row, strict=True)
    )
    use = alloc.gpus_by_resource()
    if pricing is not None:
        per_s = pricing.per_s(use)
    else:
        per_s = sum(tables.price_per_s(g, z) * k for (g, z, _), k in use.items())
    zones = sorted({s.kind.zone for t, _, _ in groups for s in t.stages})
    egress = 0.0
    prices = tables.inputs.prices
    if any(p2p_egress(t, tables) for t, _, _ in groups):
        for t, m in alloc.pipelines:  # pipelines whose stages span zones
            for src, dst, nbytes in p2p_egress(t, tables):
                egress += m * nbytes / 1e9 * prices.egress_per_gb(src, dst)
    if len(zones) > 1 and n > 1:
        total_params = float(tables.inputs.model.total_params)
        per_crossing = 2.0 * (n - 1) / n * total_params * pb
        for i, z in enumerate(zones):
            egress += per_crossing / 1e9 * prices.egress_per_gb(z, zones[(i + 1) % len(zones)])
    return FastFigures(
        iteration_s=it,
        cost_per_iter=per_s * it + egress,
        cost_per_hour=per_s * 3600,
        sync_s=ar_total,
    )
