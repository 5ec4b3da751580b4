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

import heapq
import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from sailor.planner.pricing import GpuPricing, Resource
from sailor.planner.tables import CostTables, Kind
from sailor.planner.templates import PipelineTemplate
from sailor.schemas import Pipeline, Plan, ReplicaGroup, Stage
from sailor.simulator.network_model import BUCKET_ELEMENTS, inter_curve

__all__ = [
    "Allocation",
    "FastFigures",
    "Resource",
    "assign_microbatches",
    "cheapest_for_time",
    "fast_estimate",
    "min_time_allocation",
    "to_plan",
]


@dataclass(frozen=True)
class Allocation:
    """Pipelines (template, microbatches), one entry per pipeline."""

    pipelines: tuple[tuple[PipelineTemplate, int], ...]
    how: str

    def gpus_by_resource(self) -> dict[Resource, int]:
        out: dict[Resource, int] = {}
        for t, _ in self.pipelines:
            for r, n in t.gpus_by_resource().items():
                out[r] = out.get(r, 0) + n
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


def _pack(
    order: Sequence[PipelineTemplate], caps: dict[Resource, int], limit: int | None = None
) -> list[PipelineTemplate]:
    """Take pipelines of each template in ``order`` while resources last."""
    left = dict(caps)
    out: list[PipelineTemplate] = []
    for t in order:
        need = t.gpus_by_resource()
        n = min(left.get(r, 0) // k for r, k in need.items())
        if limit is not None:
            n = min(n, limit - len(out))
        if n <= 0:
            continue
        for r, k in need.items():
            left[r] -= n * k
        out.extend([t] * n)
        if limit is not None and len(out) >= limit:
            break
    return out


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
    scored: list[tuple[float, int, PipelineTemplate]] = []
    per: dict[int, int] = {}  # samples one pipeline of the template covers
    for i, t in enumerate(templates):
        m = t.max_microbatches(t_budget - overhead[id(t)])
        if m > 0:
            per[id(t)] = m * t.mbs
            # with a cap on pipelines, the pipelines that cover the most samples go first
            gain = m * t.mbs if limit is not None else m * t.mbs / t.gpus
            scored.append((-math.inf if t is first else -gain, i, t))
    scored.sort(key=lambda x: (x[0], x[1]))
    chosen = _pack([t for *_, t in scored], caps, limit)
    samples = sum(per[id(t)] for t in chosen)
    return chosen, samples


def min_time_allocation(
    templates: Sequence[PipelineTemplate],
    caps: dict[Resource, int],
    gbs: int,
    overhead: dict[int, float],
    t_max: float | None = None,
    first: PipelineTemplate | None = None,
    limit: int | None = None,
) -> list[PipelineTemplate] | None:
    """Least budget (bisection, 0.2 %) whose packing of at most ``limit`` pipelines covers
    ``gbs`` samples; its pipelines."""
    if not templates:
        return None
    lo = min(t.fill_s + overhead[id(t)] for t in templates)
    hi = max(lo, 1e-6) * 2
    for _ in range(60):
        chosen, s = fill_for_time(templates, caps, hi, overhead, first, limit)
        if s >= gbs:
            break
        if t_max is not None and hi > t_max:
            return None
        hi *= 2
    else:
        return None
    best = chosen
    while hi - lo > 0.002 * hi:
        mid = (lo + hi) / 2
        chosen, s = fill_for_time(templates, caps, mid, overhead, first, limit)
        if s >= gbs:
            hi, best = mid, chosen
        else:
            lo = mid
    return best


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
    a microbatch are dropped.
    """
    if not pipes:
        return None
    sizes = sorted({t.mbs for t in pipes})
    if gbs % math.gcd(*sizes):
        return None
    counts = [0] * len(pipes)
    heap = [(t.fill_s + overhead[id(t)], i) for i, t in enumerate(pipes)]
    heapq.heapify(heap)
    left = gbs
    parked: list[tuple[float, int]] = []
    while left > 0:
        if not heap:
            return None
        end, i = heapq.heappop(heap)
        t = pipes[i]
        if t.mbs > left:
            parked.append((end, i))
            continue
        counts[i] += 1
        left -= t.mbs
        heapq.heappush(heap, (end + t.period_s, i))
        if parked and left > 0:
            for p in parked:
                heapq.heappush(heap, p)
            parked.clear()
    if left:
        return None
    return [(t, c) for t, c in zip(pipes, counts, strict=True) if c > 0]


class SyncModel:
    """Ring all-reduce time of a stage's gradients and cross-zone bytes, as the simulator has it."""

    def __init__(self, tables: CostTables) -> None:
        self.tables = tables
        self._curves: dict[tuple[Kind, Kind], object] = {}
        self._rings: dict[tuple[tuple[Kind, ...], int, float, float], float] = {}

    def _step(self, a: Kind, b: Kind, chunk: float) -> float:
        key = (a, b)
        curve = self._curves.get(key)
        if curve is None:
            curve = inter_curve(self.tables.inputs.network, a.replica(), b.replica())[0]
            self._curves[key] = curve
        cal = self.tables.inputs.calibration
        eff = min(
            cal.for_gpu(a.gpu_type).network_efficiency, cal.for_gpu(b.gpu_type).network_efficiency
        )
        return float(curve.transfer_time(chunk)) / eff  # type: ignore[attr-defined]

    def ring_time(self, ring: Sequence[Kind], n: int, node_bytes: float, elements: float) -> float:
        """``n`` holders of the kinds in ``ring`` (zone-sorted distinct kinds)."""
        if n <= 1 or node_bytes <= 0:
            return 0.0
        memo = (tuple(ring), n, node_bytes, elements)
        hit = self._rings.get(memo)
        if hit is not None:
            return hit
        buckets = max(1, math.ceil(elements / BUCKET_ELEMENTS))
        chunk = node_bytes / buckets / n
        step = 0.0
        kinds = list(ring)
        pairs = set()
        for i, a in enumerate(kinds):
            pairs.add((a, a))
            pairs.add((a, kinds[(i + 1) % len(kinds)]))
        if len(kinds) == 1 or n <= len(kinds):
            pairs = {(a, kinds[(i + 1) % len(kinds)]) for i, a in enumerate(kinds)}
        for a, b in pairs:
            step = max(step, self._step(a, b, chunk))
        out = 2.0 * (n - 1) * step * buckets
        self._rings[memo] = out
        return out


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
    for t in templates:
        ar = sum(
            sync.ring_time(ring, n_pipes, s.kind.tp * s.params * param_bytes, s.params)
            for s in t.stages
        )
        fixed = max(cal.for_gpu(s.kind.gpu_type).sync_fixed_s for s in t.stages)
        out[id(t)] = fixed + ar + max(s.update_s for s in t.stages)
    return out


def ring_of(pipes: Iterable[PipelineTemplate]) -> list[Kind]:
    kinds = {s.kind for t in pipes for s in t.stages}
    return sorted(kinds, key=lambda k: (k.zone, k.gpu_type, k.tp, k.gpus_per_node))


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
            rows.append((a.kind.zone, b.kind.zone, out + a.kind.tp * tables.mask_bytes))
            rows.append((b.kind.zone, a.kind.zone, out))
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
    first; else the tables' uniform rate)."""
    pipes = [t for t, _ in alloc.pipelines]
    ring = ring_of(pipes)
    n = len(pipes)
    pb = tables.inputs.model.param_bytes()
    cal = tables.inputs.calibration
    distinct = {id(t): t for t in pipes}
    cuts = sorted({s.first_layer for t in distinct.values() for s in t.stages})
    n_layers = pipes[0].stages[-1].last_layer + 1
    bounds = [*cuts, n_layers]
    ar_total = 0.0
    for a, b in itertools.pairwise(bounds):
        node_bytes = 0.0
        elements = 0.0
        for t in distinct.values():
            st = next(s for s in t.stages if s.first_layer <= a <= s.last_layer)
            arr = tables.arrays(st.kind.gpu_type, st.kind.tp, t.mbs)
            el = float(arr.params[b] - arr.params[a]) if arr is not None else st.params
            node_bytes = max(node_bytes, st.kind.tp * el * pb)
            elements = max(elements, el)
        ar_total += sync.ring_time(ring, n, node_bytes, elements)
    upd = max(s.update_s for t in distinct.values() for s in t.stages)
    it = (
        max(
            t.pipe_time(m) + max(cal.for_gpu(s.kind.gpu_type).sync_fixed_s for s in t.stages)
            for t, m in alloc.pipelines
        )
        + ar_total
        + upd
    )
    use = alloc.gpus_by_resource()
    if pricing is not None:
        per_s = pricing.per_s(use)
    else:
        per_s = sum(tables.price_per_s(g, z) * k for (g, z, _), k in use.items())
    zones = sorted({k.zone for k in ring})
    egress = 0.0
    prices = tables.inputs.prices
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
    return Plan(
        plan_id=plan_id,
        model=model_name,
        global_batch_size=gbs,
        pipelines=tuple(
            Pipeline(
                stages=stages[(id(t), tuple(flags[pi]))], microbatch_size=t.mbs, num_microbatches=m
            )
            for pi, (t, m) in enumerate(pipes)
        ),
    )
