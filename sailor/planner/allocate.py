"""Allocation: how many pipelines of which template, and how many microbatches each.

Given the templates a set of resources can host, :func:`fill_for_time` packs pipelines
greedily by samples per GPU for a pipeline-time budget ``T`` (faster pipelines fit more
microbatches in ``T``), and :func:`min_time_allocation` finds by bisection the least ``T``
whose packing covers the global batch. :func:`cheapest_for_time` instead buys the pipelines
with the most samples per $ until the batch is covered (the cost objective).
:func:`assign_microbatches` then spreads the global batch exactly over the chosen pipelines,
one microbatch at a time to the pipeline that would finish it first (a heap: faster pipelines
take more samples), and :func:`fast_estimate` prices the result with the simulator's closed
form, ring all-reduce and cost model, so that only the best few allocations are simulated.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from sailor.planner.pricing import GpuPricing, Resource
from sailor.planner.tables import CostTables, Kind
from sailor.planner.templates import PipelineTemplate
from sailor.schemas import BandwidthCurve, Endpoint, Pipeline, Plan, ReplicaGroup, Stage
from sailor.simulator.network_model import BUCKET_ELEMENTS, inter_curve

__all__ = [
    "Allocation",
    "FastFigures",
    "PackTable",
    "Recipe",
    "Resource",
    "assign_microbatches",
    "cheapest_for_time",
    "fast_estimate",
    "min_time_allocation",
    "to_plan",
]


@dataclass(frozen=True)
class Recipe:
    """How an allocation was made, so that a replan can make it again on a changed pool.

    ``scenario``: the resources it may use; ``method``: ``least`` (least time over every
    template), ``few`` (least time with at most ``n_pipes`` pipelines), ``first`` (least time
    with template ``first`` packed first), ``group`` (least time on the partition ``cuts``),
    ``cheapest`` (cheapest pipelines within ``factor`` times the least time), ``floor``
    (cheapest pipelines within ``factor`` times the time a throughput floor allows); ``mbs``: only
    templates of this microbatch size (one microbatch size per plan).
    """

    scenario: tuple[Resource, ...]
    method: str
    n_pipes: int = 0
    first: tuple[object, ...] | None = None
    cuts: tuple[int, ...] = ()
    factor: float = 0.0
    mbs: int | None = None


@dataclass(frozen=True)
class Allocation:
    """Pipelines (template, microbatches), one entry per pipeline."""

    pipelines: tuple[tuple[PipelineTemplate, int], ...]
    how: str
    recipe: Recipe | None = None

    def groups(self) -> tuple[tuple[PipelineTemplate, int, int], ...]:
        """(template, pipelines, most microbatches) per distinct template, first seen first."""
        g = self.__dict__.get("_groups")
        if g is None:
            first: dict[int, PipelineTemplate] = {}
            count: dict[int, int] = {}
            most: dict[int, int] = {}
            for t, m in self.pipelines:
                k = id(t)
                if k not in first:
                    first[k], count[k], most[k] = t, 0, m
                count[k] += 1
                most[k] = max(most[k], m)
            g = tuple((t, count[k], most[k]) for k, t in first.items())
            object.__setattr__(self, "_groups", g)
        out: tuple[tuple[PipelineTemplate, int, int], ...] = g
        return out

    def plan_order(self) -> list[tuple[PipelineTemplate, int]]:
        """The pipelines in the order :func:`to_plan` writes them (zone, GPU type, most
        microbatches first; stable)."""
        return sorted(
            self.pipelines,
            key=lambda tm: (tm[0].stages[0].kind.zone, tm[0].stages[0].kind.gpu_type, -tm[1]),
        )

    def plan_runs(self) -> tuple[tuple[PipelineTemplate, int], ...]:
        """:meth:`plan_order` as runs of one template: (template, pipelines in the run)."""
        r = self.__dict__.get("_runs")
        if r is None:
            runs: list[tuple[PipelineTemplate, int]] = []
            for t, _ in self.plan_order():
                if runs and runs[-1][0] is t:
                    runs[-1] = (t, runs[-1][1] + 1)
                else:
                    runs.append((t, 1))
            r = tuple(runs)
            object.__setattr__(self, "_runs", r)
        out: tuple[tuple[PipelineTemplate, int], ...] = r
        return out

    def gpus_by_resource(self) -> dict[Resource, int]:
        out: dict[Resource, int] = {}
        for t, c, _ in self.groups():
            for r, n in t.gpus_by_resource().items():
                out[r] = out.get(r, 0) + n * c
        return out

    @property
    def key(self) -> tuple[object, ...]:
        """Identity of the allocation up to pipeline order (templates are shared objects)."""
        k = self.__dict__.get("_key")
        if k is None:
            counts: dict[tuple[int, int], int] = {}
            for t, m in self.pipelines:
                counts[(id(t), m)] = counts.get((id(t), m), 0) + 1
            k = tuple(sorted(counts.items()))
            object.__setattr__(self, "_key", k)
        return k


@dataclass(frozen=True)
class FastFigures:
    """The search's own prediction for an allocation (the simulator has the last word)."""

    iteration_s: float
    cost_per_iter: float
    cost_per_hour: float
    sync_s: float


@dataclass(frozen=True, eq=False)
class PackTable:
    """What packing reads of a template list, for fixed resources and sync overheads: the
    per-template figures as arrays, and each template's GPU needs on list indices. Built
    once for the recipes of a scenario that share them (:func:`min_time_allocation`)."""

    templates: list[PipelineTemplate]
    fill: np.ndarray
    period: np.ndarray
    over: np.ndarray
    mbs: np.ndarray
    gpus: np.ndarray
    needs: list[tuple[tuple[int, int], ...]]
    """Per template: (resource index, GPUs) of each resource it uses."""
    left0: list[int]
    """GPUs of each resource index the pool has."""
    least: list[int]
    """Per resource index, the fewest GPUs of it a template needs: once no resource has that
    many left, no later template fits (most of a long order lies past that point)."""

    @classmethod
    def of(
        cls,
        templates: Sequence[PipelineTemplate],
        caps: dict[Resource, int],
        overhead: dict[int, float],
    ) -> PackTable:
        ts = list(templates)
        # resources as list indices: the packing loop runs ~50,000 times per robust search,
        # and a (type, zone, shape) key hashes its tuple at every dict lookup
        res: dict[Resource, int] = {}
        needs = [
            tuple((res.setdefault(r, len(res)), k) for r, k in t.gpus_by_resource().items())
            for t in ts
        ]
        least = [0] * len(res)
        for need in needs:
            for i, k in need:
                if least[i] == 0 or k < least[i]:
                    least[i] = k
        return cls(
            templates=ts,
            fill=np.array([t.fill_s for t in ts]),
            period=np.array([t.period_s for t in ts]),
            over=np.array([overhead[id(t)] for t in ts]),
            mbs=np.array([float(t.mbs) for t in ts]),
            gpus=np.array([float(t.gpus) for t in ts]),
            needs=needs,
            left0=[caps.get(r, 0) for r in res],
            least=least,
        )


class _Packer:
    """:func:`fill_for_time` for one template list at many budgets: a budget costs a few
    numpy operations plus the packing loop."""

    def __init__(self, table: PackTable, first: PipelineTemplate | None, limit: int | None) -> None:
        self.table = table
        self.limit = limit
        n = len(table.templates)
        self.first = (
            np.zeros(n, dtype=bool)
            if first is None
            else np.array([t is first for t in table.templates], dtype=bool)
        )
        self.index = np.arange(n)

    def order(self, t_budget: float) -> tuple[np.ndarray, np.ndarray]:
        """Templates that fit a microbatch in ``t_budget``, best first; samples per pipeline."""
        tab = self.table
        t = t_budget - tab.over
        ok = t >= tab.fill
        # PipelineTemplate.max_microbatches, vectorized
        m = np.where(ok, np.floor((t - tab.fill) / tab.period * (1 + 1e-12)) + 1, 0.0)
        per = m * tab.mbs
        # with a cap on pipelines, the pipelines that cover the most samples go first
        gain = per if self.limit is not None else per / tab.gpus
        key = np.where(self.first, -np.inf, -gain)
        sel = self.index[ok & (m > 0)]
        # by key, ties in template order (sel is ascending: a stable sort keeps it)
        return sel[np.argsort(key[sel], kind="stable")], per

    def fill_for_time(
        self, t_budget: float, enough: float | None = None
    ) -> tuple[list[PipelineTemplate], float]:
        """The pipelines packed within ``t_budget`` and the samples they cover; with
        ``enough``, stop packing once that many samples are covered."""
        order, per = self.order(t_budget)
        out: list[PipelineTemplate] = []
        samples = 0.0
        tab = self.table
        left = list(tab.left0)
        needs, least, limit = tab.needs, tab.least, self.limit
        taken = 0
        # as many pipelines of each template in ``order`` as the resources (and the limit)
        # allow, on list indices
        for i in order.tolist():
            need = needs[i]
            n = -1
            for r, k in need:
                v = left[r] // k
                if n < 0 or v < n:
                    n = v
                    if n <= 0:
                        break
            if limit is not None:
                n = min(n, limit - taken)
            if n <= 0:
                continue
            for r, k in need:
                left[r] -= n * k
            taken += n
            out.extend([tab.templates[i]] * n)
            samples += n * float(per[i])
            if enough is not None and samples >= enough:
                break
            if limit is not None and taken >= limit:
                break
            if all(lv < lk for lv, lk in zip(left, least, strict=True)):
                break
        return out, samples


def fill_for_time(
    templates: Sequence[PipelineTemplate],
    caps: dict[Resource, int],
    t_budget: float,
    overhead: dict[int, float],
    first: PipelineTemplate | None = None,
    limit: int | None = None,
) -> tuple[list[PipelineTemplate], int]:
    """Pipelines packed by samples per GPU within ``t_budget`` (``first`` before all others;
    at most ``limit`` pipelines), and the samples they cover."""
    packer = _Packer(PackTable.of(templates, caps, overhead), first, limit)
    chosen, samples = packer.fill_for_time(t_budget)
    return chosen, round(samples)


def min_time_allocation(
    templates: Sequence[PipelineTemplate],
    caps: dict[Resource, int],
    gbs: int,
    overhead: dict[int, float],
    t_max: float | None = None,
    first: PipelineTemplate | None = None,
    limit: int | None = None,
    table: PackTable | None = None,
) -> list[PipelineTemplate] | None:
    """Least budget (bisection, 0.2 %) whose packing of at most ``limit`` pipelines covers
    ``gbs`` samples; its pipelines. ``table``: ``PackTable.of(templates, caps, overhead)``
    if the caller has it."""
    if not templates:
        return None
    packer = _Packer(table or PackTable.of(templates, caps, overhead), first, limit)
    lo = float(np.min(packer.table.fill + packer.table.over))
    hi = max(lo, 1e-6) * 2
    for _ in range(60):
        _, s = packer.fill_for_time(hi, gbs)
        if s >= gbs:
            break
        if t_max is not None and hi > t_max:
            return None
        hi *= 2
    else:
        return None
    while hi - lo > 0.002 * hi:
        mid = (lo + hi) / 2
        _, s = packer.fill_for_time(mid, gbs)
        if s >= gbs:
            hi = mid
        else:
            lo = mid
    return packer.fill_for_time(hi)[0]


def cheapest_for_time(
    templates: Sequence[PipelineTemplate],
    caps: dict[Resource, int],
    gbs: int,
    t_budget: float,
    overhead: dict[int, float],
    price_per_s: dict[int, float],
) -> list[PipelineTemplate] | None:
    """Pipelines bought by samples per $ until they cover ``gbs`` within ``t_budget``."""
    scored: list[tuple[float, int, PipelineTemplate, int]] = []
    for i, t in enumerate(templates):
        m = t.max_microbatches(t_budget - overhead[id(t)])
        if m > 0:
            scored.append((-(m * t.mbs) / price_per_s[id(t)], i, t, m * t.mbs))
    scored.sort(key=lambda x: (x[0], x[1]))
    left = dict(caps)
    out: list[PipelineTemplate] = []
    covered = 0
    for _, _, t, s in scored:
        need = t.gpus_by_resource()
        n = min(left.get(r, 0) // k for r, k in need.items())
        n = min(n, math.ceil((gbs - covered) / s))
        if n <= 0:
            continue
        for r, k in need.items():
            left[r] -= n * k
        out.extend([t] * n)
        covered += n * s
        if covered >= gbs:
            return out
    return None


def assign_microbatches(
    pipes: Sequence[PipelineTemplate], gbs: int, overhead: dict[int, float]
) -> list[tuple[PipelineTemplate, int]] | None:
    """Spread ``gbs`` samples exactly: each microbatch to the pipeline that finishes it first.

    Returns None when the microbatch sizes cannot add up to ``gbs``. Pipelines left without
    a microbatch are dropped. Pipelines of one template finish their microbatches together,
    so the merge runs over templates (ties: the template whose first pipeline comes first),
    and a template that cannot take its next microbatches on all its pipelines gives them
    to its first ones; one whose microbatch exceeds what is left never takes another.
    """
    if not pipes:
        return None
    sizes = sorted({t.mbs for t in pipes})
    if gbs % math.gcd(*sizes):
        return None
    group_of: dict[int, int] = {}
    reps: list[PipelineTemplate] = []
    members: list[list[int]] = []
    for i, t in enumerate(pipes):
        g = group_of.get(id(t))
        if g is None:
            g = group_of[id(t)] = len(reps)
            reps.append(t)
            members.append([])
        members[g].append(i)
    level = [0] * len(reps)  # microbatches every pipeline of the group has
    partial: dict[int, int] = {}  # group -> its first pipelines that took one more
    heap = [(t.fill_s + overhead[id(t)], members[g][0], g) for g, t in enumerate(reps)]
    heapq.heapify(heap)
    left = gbs
    while left > 0:
        if not heap:
            return None
        end, first, g = heapq.heappop(heap)
        t = reps[g]
        if t.mbs > left:
            continue  # what is left only shrinks: this template is done
        n = len(members[g])
        if n * t.mbs <= left:
            level[g] += 1
            left -= n * t.mbs
            heapq.heappush(heap, (end + t.period_s, first, g))
        else:
            partial[g] = left // t.mbs
            left -= partial[g] * t.mbs
    if left:
        return None
    counts = [0] * len(pipes)
    for g, ms in enumerate(members):
        extra = partial.get(g, 0)
        for j, i in enumerate(ms):
            counts[i] = level[g] + (1 if j < extra else 0)
    return [(t, c) for t, c in zip(pipes, counts, strict=True) if c > 0]


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
            eff = min(
                cal.for_gpu(a.gpu_type).network_efficiency,
                cal.for_gpu(b.gpu_type).network_efficiency,
            )
            hit = self._effs[(a, b)] = (self._curve(a, b), eff)
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
            hops = self._hops[(kinds, one_each)] = [self._hop(a, b) for a, b in pairs]
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
        efficiency: float,
    ) -> float:
        """:func:`sailor.simulator.network_model.ring_allreduce` over nodes given as runs of
        (endpoint, nodes) in plan order: the ring sorts them by zone (stable), a step lasts as
        long as its slowest hop (one efficiency, the ring's lowest), and a measured all-reduce
        latency of the endpoint kind, when every node is of one kind, replaces the per-step
        link latency."""
        n = sum(c for _, c in runs)
        if n <= 1 or node_bytes <= 0:
            return 0.0
        merged: list[tuple[Kind, int]] = []
        for k, c in sorted(runs, key=lambda kc: kc[0].zone):
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
        for a, b in pairs:
            curve = self._curve(a, b)
            per_step = curve.transfer_time(chunk)
            if measured is not None:
                per_step -= curve.latency_s  # paid once per all-reduce, as measured
            step = max(step, per_step / efficiency)
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
    # stages of a few hundred distinct shapes; the sums below are the same additions)
    rings: dict[tuple[int, float], float] = {}
    fixed_of: dict[str, float] = {}
    for t in templates:
        shapes, gpu_types, update = _sync_shape(t)
        ar = 0.0
        for key in shapes:
            hit = rings.get(key)
            if hit is None:
                tp, params = key
                nb = sync.node_bytes(tp, params, param_bytes)
                hit = rings[key] = sync.ring_time(ring, n_pipes, nb, params)
            ar += hit
        fixed = -math.inf
        for g in gpu_types:
            f = fixed_of.get(g)
            if f is None:
                f = fixed_of[g] = cal.for_gpu(g).sync_fixed_s
            fixed = max(fixed, f)
        out[id(t)] = fixed + ar + update
    return out


def _sync_shape(
    t: PipelineTemplate,
) -> tuple[tuple[tuple[int, float], ...], tuple[str, ...], float]:
    """What :func:`overheads_for` reads of a template, kept on it: its stages' (TP degree,
    parameters) in order, its GPU types, and its slowest optimizer step."""
    hit: tuple[tuple[tuple[int, float], ...], tuple[str, ...], float] | None
    hit = t.__dict__.get("_sync_shape")
    if hit is None:
        hit = (
            tuple((s.kind.tp, s.params) for s in t.stages),
            tuple(dict.fromkeys(s.kind.gpu_type for s in t.stages)),
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
        eff = math.inf
        for (t, _, _), si in zip(groups, at, strict=True):
            st = t.stages[si]
            arr = tables.arrays(st.kind.gpu_type, st.kind.tp, t.mbs)
            el = float(arr.params[b] - arr.params[a]) if arr is not None else st.params
            node_bytes = max(node_bytes, sync.node_bytes(st.kind.tp, el, pb))
            elements = max(elements, el)
            eff = min(eff, cal.for_gpu(st.kind.gpu_type).network_efficiency)
        ring = [(_endpoint(groups[g][0].stages[at[g]].kind), c) for g, c in runs]
        ar = sync.segment_ring(ring, node_bytes, elements, eff)
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


def to_plan(
    alloc: Allocation,
    model_name: str,
    gbs: int,
    plan_id: str = "",
    pricing: GpuPricing | None = None,
) -> Plan:
    """The allocation as a Plan (pipelines ordered by zone, then GPU type).

    With ``pricing``, every replica group carries the spot flag of the GPUs it rents
    (cheapest first, as :meth:`GpuPricing.per_s` charges them)."""
    pipes = sorted(
        alloc.pipelines,
        key=lambda tm: (tm[0].stages[0].kind.zone, tm[0].stages[0].kind.gpu_type, -tm[1]),
    )
    flags: list[list[bool | None]] = [[None] * t.depth for t, _ in pipes]
    if pricing is not None:
        slots: dict[Resource, list[tuple[int, int, int]]] = {}
        for pi, (t, _) in enumerate(pipes):
            for si, s in enumerate(t.stages):
                k = s.kind
                slots.setdefault((k.gpu_type, k.zone, k.gpus_per_node), []).append((pi, si, k.tp))
        for r, rows in slots.items():
            got = pricing.flags(r, [tp for *_, tp in rows])
            for (pi, si, _), flag in zip(rows, got, strict=True):
                flags[pi][si] = flag
    replicas: dict[tuple[Kind, bool | None], ReplicaGroup] = {}
    stages: dict[tuple[int, tuple[bool | None, ...]], tuple[Stage, ...]] = {}
    for pi, (t, _) in enumerate(pipes):
        key = (id(t), tuple(flags[pi]))
        if key in stages:
            continue
        row: list[Stage] = []
        for s, f in zip(t.stages, flags[pi], strict=True):
            rk = (s.kind, f)
            if rk not in replicas:
                base = s.kind.replica()
                replicas[rk] = base if f is None else base.model_copy(update={"spot": f})
            row.append(
                Stage(first_layer=s.first_layer, last_layer=s.last_layer, replica=replicas[rk])
            )
        stages[key] = tuple(row)
    # One Pipeline per distinct (template, spot flags, microbatches): a large plan is a few
    # hundred copies of a handful of pipelines (340 of ~6 at 512 nodes), and building and
    # validating each copy was ~3 ms of a replan. Frozen values, so sharing them is safe.
    built: dict[tuple[int, tuple[bool | None, ...], int], Pipeline] = {}
    out: list[Pipeline] = []
    for pi, (t, m) in enumerate(pipes):
        skey = (id(t), tuple(flags[pi]))
        p = built.get((*skey, m))
        if p is None:
            p = built[(*skey, m)] = Pipeline(
                stages=stages[skey], microbatch_size=t.mbs, num_microbatches=m
            )
        out.append(p)
    return Plan(plan_id=plan_id, model=model_name, global_batch_size=gbs, pipelines=tuple(out))
