"""Allocation: how many pipelines of which template, and how many microbatches each.

Given the templates a set of resources can host, :func:`fill_for_time` packs pipelines
greedily by samples per GPU for a pipeline-time budget ``T`` (faster pipelines fit more
microbatches in ``T``), and :func:`min_time_allocation` finds by bisection the least ``T``
whose packing covers the global batch. :func:`cheapest_for_time` instead buys the pipelines
with the most samples per $ until the batch is covered (the cost objective).
:func:`assign_microbatches` then spreads the global batch exactly over the chosen pipelines,
one microbatch at a time to the pipeline that would finish it first (a heap: faster pipelines
take more samples), and :func:`to_plan` writes the result as a :class:`~sailor.schemas.Plan`.
The search prices allocations in closed form with
:func:`sailor.planner.fast_estimate.fast_estimate` (sync, cost), so that only the best few
are simulated.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from sailor.planner.pricing import GpuPricing, Resource
from sailor.planner.tables import Kind
from sailor.planner.templates import PipelineTemplate
from sailor.schemas import Pipeline, Plan, ReplicaGroup, Stage

__all__ = [
    "Allocation",
    "PackTable",
    "Recipe",
    "Resource",
    "assign_microbatches",
    "cheapest_for_time",
    "fill_for_time",
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
                c = count.get(k)
                if c is None:
                    first[k], count[k], most[k] = t, 1, m
                else:
                    count[k] = c + 1
                    if m > most[k]:
                        most[k] = m
            g = tuple((t, count[k], most[k]) for k, t in first.items())
            object.__setattr__(self, "_groups", g)
        out: tuple[tuple[PipelineTemplate, int, int], ...] = g
        return out

    def plan_order(self) -> list[tuple[PipelineTemplate, int]]:
        """The pipelines in the order :func:`to_plan` writes them (zone, GPU type, most
        microbatches first; stable)."""
        # the key read once per template; the index keeps the sort stable
        place: dict[int, tuple[str, str]] = {}
        rows = []
        for i, (t, m) in enumerate(self.pipelines):
            zg = place.get(id(t))
            if zg is None:
                k = t.stages[0].kind
                zg = place[id(t)] = (k.zone, k.gpu_type)
            rows.append((zg[0], zg[1], -m, i))
        rows.sort()
        return [self.pipelines[r[3]] for r in rows]

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

    def mapped(self, by_id: dict[int, PipelineTemplate], how: str) -> Allocation:
        """This allocation with every template ``t`` replaced by ``by_id[id(t)]``, one
        distinct template for each (a template re-priced in another corner: same stages'
        kinds). Its groups and plan-order runs are this one's, mapped, not recomputed."""
        out = Allocation(tuple((by_id[id(t)], m) for t, m in self.pipelines), how)
        object.__setattr__(out, "_groups", tuple((by_id[id(t)], c, m) for t, c, m in self.groups()))
        object.__setattr__(out, "_runs", tuple((by_id[id(t)], n) for t, n in self.plan_runs()))
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
        # templates of one need (interned: PipelineTemplate.need) share its row
        rows: dict[int, tuple[tuple[int, int], ...]] = {}
        needs: list[tuple[tuple[int, int], ...]] = []
        for t in ts:
            need = t.need()
            row = rows.get(id(need))
            if row is None:
                row = rows[id(need)] = tuple((res.setdefault(r, len(res)), k) for r, k in need)
            needs.append(row)
        least = [0] * len(res)
        for row in rows.values():
            for i, k in row:
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
