"""``plan()``: co-optimize which GPUs to use and how to parallelize on them.

Estimate, then solve:

1. **Tables** (:mod:`tables`): per-layer time, size and per-link transfer times from the
   simulator's own cost functions, for every (GPU type, TP, microbatch size) of the pool.
2. **Templates** (:mod:`templates`): per zone, for each stage kind (GPU type, TP) and each
   ordered pair of kinds, a DP gives the best uneven partition for every depth; memory prunes.
   Pairs of kinds in two zones give pipelines that span zones (:func:`_cross_zone`).
3. **Scenarios**: which GPU types and zones to use at all. For each non-empty subset of GPU
   types and each prefix of the zones (ordered by region, then capacity) the search knows the
   ring a gradient all-reduce would run over, so it can price every template's sync.
   Scenarios are visited by their throughput upper bound (:mod:`upper_bound`) and skipped
   once the bound cannot beat the best allocation found (bound pruning).
4. **Allocation** (:mod:`allocate`): pipelines and microbatches per scenario: the least
   iteration time that covers the global batch (throughput), and the cheapest pipelines for
   a range of iteration times (cost).
5. **Judge**: the best allocations by the search's own closed-form figures
   (:mod:`fast_estimate`) are turned into plans and simulated with
   :func:`sailor.simulator.simulate`; only plans the simulator says fit in memory and meet
   every constraint are returned, ranked by the simulator's figures.

Pure: values in, values out (a progress callback may be passed). No clock: callers time it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import combinations

from sailor.planner.allocate import (
    Allocation,
    PackTable,
    Recipe,
    Resource,
    assign_microbatches,
    cheapest_for_time,
    min_time_allocation,
    to_plan,
)
from sailor.planner.api import (
    OBJECTIVES,
    Constraints,
    NoFeasiblePlanError,
    Objective,
    PlannerInputError,
    RankedPlan,
    SearchStats,
)
from sailor.planner.collector import collector_paused
from sailor.planner.fast_estimate import FastFigures, SyncModel, fast_estimate, overheads_for
from sailor.planner.moves import moved_layers
from sailor.planner.pricing import GpuPricing
from sailor.planner.tables import CostTables, Inputs, Kind
from sailor.planner.templates import (
    PipelineTemplate,
    best_partitions_many,
    fixed_kinds,
    with_cuts,
)
from sailor.planner.upper_bound import (
    mbs_candidates,
    pool_bound,
    resources_of,
    tp_candidates,
)
from sailor.schemas import (
    Calibration,
    Estimate,
    GPUSpec,
    ModelSpec,
    NetworkProfile,
    Plan,
    Pool,
    PriceTable,
    ProfileDB,
)
from sailor.schemas.device_kind import spec_of
from sailor.schemas.zones import region_of
from sailor.simulator import ProfileLookupError, simulate

__all__ = [
    "Candidate",
    "Progress",
    "SearchResult",
    "SearchState",
    "closed_form",
    "objective_score",
    "plan",
    "search",
    "search_recipes",
    "search_with_tables",
]

Progress = Callable[[int, int], None]
"""Called with (steps done, steps in total) as the search advances."""

_MIXED_FIRST = 3
"""Above :data:`_MIXED_ALL`, the pipelines spanning GPU types packed first are the best few by
steady rate, by fill time and by time to run the whole batch alone."""

_SMALL_POOL_GPUS = 16
"""Pools up to this size pack every pipeline spanning GPU types first once (each GPU matters);
larger pools only the best few."""

_MIXED_ALL = 64
"""Up to this many pipelines spanning GPU types in a scenario, every one is packed first once
(a replan, which starts from a good allocation, packs only the best few first)."""

_GROUPS_PER_SCENARIO = 6
"""Shared partitions (the best of a depth each) per scenario on which the least-time
allocation is also computed."""

_FLOOR_T_FACTORS = (1.0, 0.95, 0.9, 0.8)
"""Iteration-time budgets, as fractions of the time a throughput floor allows, at which the
cost objective also buys the cheapest pipelines: under a floor the cheapest plan is often
the slowest one that meets it, which the budgets relative to the least time (the whole
pool's) may not reach (:data:`_COST_T_FACTORS`)."""

_COST_T_FACTORS = (1.0, 1.15, 1.35, 1.6, 2.0, 2.5, 3.2, 4.0, 6.0, 8.0)
"""Iteration-time budgets, as multiples of the scenario's least time, at which the cost
objective buys the cheapest pipelines: slower plans on fewer GPUs can cost less per iteration
(less sync) or more (fixed costs): the search looks at both sides."""


@dataclass(frozen=True)
class Candidate:
    """An allocation the search kept, with its figures (simulated if ``estimate`` is set)."""

    alloc: Allocation
    fast: FastFigures
    estimate: Estimate | None = None
    plan: Plan | None = None
    violations: tuple[str, ...] = ()


@dataclass
class SearchState:
    """What a replan reuses: the cost tables and every template computed so far."""

    tables: CostTables
    templates: dict[tuple[object, ...], list[PipelineTemplate]] = field(default_factory=dict)
    pruned_memory: int = 0
    shortlist: dict[int, PipelineTemplate] = field(default_factory=dict)
    """Templates used by any allocation of the last search: where a replan looks first."""
    pricing: GpuPricing | None = None
    """Prices of the pool being searched (each entry's spot flag); set per search."""
    template_sets: dict[tuple[object, ...], list[PipelineTemplate]] = field(default_factory=dict)
    """Templates (dominated ones dropped) per pool shape: see :func:`_template_set`."""


@dataclass(frozen=True)
class SearchResult:
    """Ranked plans (best first), or none with the reason."""

    plans: tuple[RankedPlan, ...]
    reason: str
    objective: Objective
    constraints: Constraints
    upper_bound_iter_s: float
    candidates: tuple[Candidate, ...]
    stats: SearchStats
    state: SearchState
    pool: Pool
    previous: Plan | None = None
    allocations: tuple[Allocation, ...] = ()
    """The allocation behind each ranked plan (same order): what a replan warm-starts from."""


# -- inputs ----------------------------------------------------------------------------------


def _check_inputs(
    inputs: Inputs, pool: Pool, objective: Objective, constraints: Constraints
) -> None:
    """Refuse a pool the search cannot plan: empty, of an unknown GPU type, without a price,
    or, for a search that ranks or caps by cost, with a GPU at $0/h (samples per $ and
    iterations per $ of a free GPU are infinite, and ratios of them undefined)."""
    if not pool.entries or pool.total_gpus == 0:
        raise PlannerInputError("pool is empty: it has no GPUs to plan with")
    if inputs.profiles.model != inputs.model.name:
        raise PlannerInputError(
            f"profiles.model={inputs.profiles.model!r} does not match model={inputs.model.name!r}"
        )
    prices_cost = (
        objective != "throughput"
        or constraints.max_cost_per_iter_usd is not None
        or constraints.max_cost_per_hour_usd is not None
    )
    known = set(inputs.gpu_specs) | set(inputs.profiles.gpu_types())
    for e in pool.entries:
        if e.gpu_type not in known and spec_of(inputs.gpu_specs, e.gpu_type) is None:
            raise PlannerInputError(
                f"pool GPU type {e.gpu_type!r} is unknown: no profile and no spec "
                f"(known: {', '.join(sorted(known))})"
            )
        spot = e.spot if inputs.spot is None else inputs.spot
        try:
            price = inputs.prices.gpu_hour(e.gpu_type, e.zone, spot)
        except KeyError as exc:
            raise PlannerInputError(f"pool GPU type {e.gpu_type!r} has no price") from exc
        if prices_cost and price <= 0:
            why = f"objective={objective!r}" if objective != "throughput" else "a cost limit"
            raise PlannerInputError(
                f"pool entry {e.gpu_type} in {e.zone} (spot={spot}) costs $0/h: {why} needs "
                "a price above 0 for every GPU (for hardware you own, give its amortized "
                "$/GPU-hour; or plan for throughput without a cost limit)"
            )


# -- templates -------------------------------------------------------------------------------


def _templates(
    state: SearchState, caps: Mapping[Resource, int], stats: dict[str, int]
) -> list[PipelineTemplate]:
    tables = state.tables
    inputs = tables.inputs
    by_zone: dict[str, list[Resource]] = {}
    for r in caps:
        by_zone.setdefault(r[1], []).append(r)
    out: list[PipelineTemplate] = []

    def prefetch(keys: Sequence[tuple[tuple[Kind, ...], int]]) -> None:
        """Run the DPs of ``keys`` not yet computed together (:func:`best_partitions_many`)."""
        todo = list(dict.fromkeys(k for k in keys if k not in state.templates))
        for key, (hit, pruned) in zip(todo, best_partitions_many(tables, todo), strict=True):
            state.templates[key] = hit
            state.pruned_memory += pruned
            stats["computed"] += 1

    def get(kinds: tuple[Kind, ...], b: int) -> list[PipelineTemplate]:
        key = (kinds, b)
        if key not in state.templates:
            prefetch([key])
        return state.templates[key]

    zones: list[tuple[str, list[Resource], dict[Resource, list[Kind]], dict[str, list[int]]]] = []
    for zone, rs in sorted(by_zone.items()):
        kinds_by_r = {
            r: [Kind(r[0], tp, zone, r[2]) for tp in tp_candidates(r[2])] for r in sorted(rs)
        }
        mbs_by_type = {r[0]: mbs_candidates(inputs, r[0]) for r in rs}
        zones.append((zone, rs, kinds_by_r, mbs_by_type))
    # every zone's DPs of one kind and of two, each set in one batch (the loops below ask
    # for exactly these)
    prefetch(
        [
            ((k,), b)
            for _, rs, kinds_by_r, mbs_by_type in zones
            for r, ks in kinds_by_r.items()
            for k in ks
            for b in mbs_by_type[r[0]]
        ]
    )
    prefetch(
        [
            ((k1, k2), b)
            for _, rs, kinds_by_r, mbs_by_type in zones
            for ra, rb in combinations(sorted(rs), 2)
            for r1, r2 in ((ra, rb), (rb, ra))
            for k1 in kinds_by_r[r1]
            for k2 in kinds_by_r[r2]
            for b in sorted(set(mbs_by_type[r1[0]]) & set(mbs_by_type[r2[0]]))
        ]
    )
    singles_of: dict[Resource, list[PipelineTemplate]] = {}
    for _zone, rs, kinds_by_r, mbs_by_type in zones:
        singles: list[PipelineTemplate] = []
        for r, ks in kinds_by_r.items():
            for k in ks:
                for b in mbs_by_type[r[0]]:
                    fit = [t for t in get((k,), b) if _fits(t, caps)]
                    singles.extend(fit)
                    singles_of.setdefault(r, []).extend(fit)
        out.extend(singles)
        if len(rs) > 1:
            out.extend(_aligned(state, singles, kinds_by_r, mbs_by_type, caps))
        for ra, rb in combinations(sorted(rs), 2):
            for r1, r2 in ((ra, rb), (rb, ra)):
                common = sorted(set(mbs_by_type[r1[0]]) & set(mbs_by_type[r2[0]]))
                for k1 in kinds_by_r[r1]:
                    for k2 in kinds_by_r[r2]:
                        for b in common:
                            found = get((k1, k2), b)
                            out.extend(t for t in found if _fits(t, caps))
                            out.extend(_split_to_fit(state, found, k1, k2, b, caps))
    if len(by_zone) > 1:
        out.extend(_cross_zone(state, caps, singles_of, get, prefetch))
    return out


_CROSS_ZONE_KINDS = 1
"""Per resource that hosts whole pipelines in its own zone, the (TP, microbatch size) of its
best few single-zone templates (by samples per GPU-second) are the stage kinds it offers to
pipelines that span zones. A resource that hosts no whole pipeline offers every TP degree and
microbatch size: spanning zones is then the only way to use it."""


def _cross_zone(
    state: SearchState,
    caps: Mapping[Resource, int],
    singles_of: Mapping[Resource, list[PipelineTemplate]],
    get: Callable[[tuple[Kind, ...], int], list[PipelineTemplate]],
    prefetch: Callable[[Sequence[tuple[tuple[Kind, ...], int]]], None],
) -> list[PipelineTemplate]:
    """Pipelines whose first stages run in one zone and the rest in another.

    They pay off when a zone's GPUs cannot hold a whole pipeline (a model that needs more
    stages than one zone has nodes of its type) or a zone has leftover GPUs that can join a
    pipeline as stages; the hop between the two zones runs over the cross-zone link curve
    (:meth:`CostTables.link`) and its bytes pay egress both ways (:func:`p2p_egress`).
    Pools up to :data:`_SMALL_POOL_GPUS` pair every kind; larger ones only the best kinds of
    each resource, which keeps the DPs to a few per ordered pair of resources.
    """
    inputs = state.tables.inputs
    small = sum(caps.values()) <= _SMALL_POOL_GPUS
    offer: dict[Resource, list[tuple[int, int]]] = {}
    for r in sorted(caps):
        ts = sorted(singles_of.get(r, []), key=lambda t: -_rate(t))
        every = [(tp, b) for tp in tp_candidates(r[2]) for b in mbs_candidates(inputs, r[0])]
        if small or not ts:
            offer[r] = every
            continue
        best: list[tuple[int, int]] = []
        for t in ts:
            tb = (t.stages[0].kind.tp, t.mbs)
            if tb not in best:
                best.append(tb)
            if len(best) >= _CROSS_ZONE_KINDS:
                break
        offer[r] = best
    todo: dict[tuple[Kind, Kind, int], None] = {}
    for r1 in sorted(caps):
        for r2 in sorted(caps):
            if r1[1] == r2[1]:
                continue
            both = set(mbs_candidates(inputs, r1[0])) & set(mbs_candidates(inputs, r2[0]))
            for tp1, b1 in offer[r1]:
                for tp2, b2 in offer[r2]:
                    k1, k2 = Kind(r1[0], tp1, r1[1], r1[2]), Kind(r2[0], tp2, r2[1], r2[2])
                    for b in sorted({b1, b2} & both):
                        todo.setdefault((k1, k2, b))
    prefetch([((k1, k2), b) for k1, k2, b in todo])  # one batch of DPs
    out: list[PipelineTemplate] = []
    for k1, k2, b in todo:
        found = get((k1, k2), b)
        out.extend(t for t in found if _fits(t, caps))
        out.extend(_split_to_fit(state, found, k1, k2, b, caps))
    return out


_SPLIT_ALL = 8
"""When the pool holds at most this many stages of two kinds, every split of every depth
between them is evaluated (small pools: each GPU matters)."""


def _split_to_fit(
    state: SearchState,
    found: Sequence[PipelineTemplate],
    k1: Kind,
    k2: Kind,
    b: int,
    caps: Mapping[Resource, int],
) -> list[PipelineTemplate]:
    """Where a depth's optimum needs more GPUs of a type than the pool has, the best
    partition for every split of that depth between the two types that does fit."""
    r1 = (k1.gpu_type, k1.zone, k1.gpus_per_node)
    r2 = (k2.gpu_type, k2.zone, k2.gpus_per_node)
    max1, max2 = caps.get(r1, 0) // k1.tp, caps.get(r2, 0) // k2.tp
    out: list[PipelineTemplate] = []
    n = state.tables.inputs.model.num_all_layers
    unfit = {t.depth for t in found if not _fits(t, caps)}
    small = max1 + max2 <= _SPLIT_ALL
    for depth in range(2, min(n, max1 + max2) + 1):
        if not small and depth not in unfit:
            continue
        lo, hi = max(1, depth - max2), min(max1, depth - 1)
        # small pools: every split; otherwise the two extremes that fit (as many stages of
        # either type as the pool holds), which bound the rest
        splits = range(lo, hi + 1) if small else sorted({lo, hi} if lo <= hi else set())
        for a in splits:
            seq = (k1,) * a + (k2,) * (depth - a)
            key = ("split", seq, b)
            hit = state.templates.get(key)
            if hit is None:
                one = fixed_kinds(state.tables, seq, b)
                hit = [one] if one is not None else []
                state.templates[key] = hit
            out.extend(t for t in hit if _fits(t, caps))
    return out


_LEADERS_PER_DEPTH = 2
"""Partitions per depth that every other stage kind of the zone is also evaluated on."""


def _cuts(t: PipelineTemplate) -> tuple[int, ...]:
    return tuple(s.last_layer for s in t.stages)


def _rate(t: PipelineTemplate) -> float:
    """Samples per GPU-second in steady state."""
    return t.mbs / (t.period_s * t.gpus)


def _aligned(
    state: SearchState,
    singles: Sequence[PipelineTemplate],
    kinds_by_r: Mapping[Resource, list[Kind]],
    mbs_by_type: Mapping[str, list[int]],
    caps: Mapping[Resource, int],
) -> list[PipelineTemplate]:
    """Templates of every kind on the best partitions of each depth (shared sync segments)."""
    by_depth: dict[int, list[PipelineTemplate]] = {}
    for t in singles:
        if t.depth > 1:
            by_depth.setdefault(t.depth, []).append(t)
    out: list[PipelineTemplate] = []
    for ts in by_depth.values():
        ts.sort(key=lambda t: -_rate(t))
        leaders: list[tuple[int, ...]] = []
        for t in ts:
            c = _cuts(t)
            if c not in leaders:
                leaders.append(c)
            if len(leaders) >= _LEADERS_PER_DEPTH:
                break
        for cuts in leaders:
            for r, ks in kinds_by_r.items():
                for k in ks:
                    for b in mbs_by_type[r[0]]:
                        key = ("cuts", k, b, cuts)
                        hit = state.templates.get(key)
                        if hit is None:
                            one = with_cuts(state.tables, k, b, cuts)
                            hit = [one] if one is not None else []
                            state.templates[key] = hit
                        out.extend(t for t in hit if _fits(t, caps))
    return out


def _fits(t: PipelineTemplate, caps: Mapping[Resource, int]) -> bool:
    # a loop, not all() over a generator: a replan asks for every template of each corner
    for r, n in t.gpus_by_resource().items():  # noqa: SIM110
        if caps.get(r, 0) < n:
            return False
    return True


def _prune_dominated(ts: Sequence[PipelineTemplate]) -> list[PipelineTemplate]:
    """Drop a template if another with the same microbatch size uses no more GPUs of any
    resource and is no slower in period and fill."""
    groups: dict[tuple[object, ...], list[PipelineTemplate]] = {}
    for t in ts:
        sig = (t.mbs, tuple(sorted(t.gpus_by_resource())))
        groups.setdefault(sig, []).append(t)
    out: list[PipelineTemplate] = []
    for g in groups.values():
        g.sort(key=lambda t: (t.gpus, t.period_s, t.fill_s))
        kept: list[PipelineTemplate] = []
        for t in g:
            use = t.gpus_by_resource()
            if any(
                k.period_s <= t.period_s
                and k.fill_s <= t.fill_s
                and all(n <= use[r] for r, n in k.gpus_by_resource().items())
                for k in kept
            ):
                continue
            kept.append(t)
        out.extend(kept)
    return out


_SHORTLIST_PER_GROUP = 4
"""Templates per (microbatch size, resource set) a replan adds to the last search's."""


def _shortlist(
    templates: Sequence[PipelineTemplate], used: Mapping[int, PipelineTemplate]
) -> list[PipelineTemplate]:
    keys = {t.key for t in used.values()}
    groups: dict[tuple[object, ...], list[PipelineTemplate]] = {}
    for t in templates:
        groups.setdefault((t.mbs, tuple(sorted(t.gpus_by_resource()))), []).append(t)
    out = [t for t in templates if t.key in keys]
    for g in groups.values():
        g.sort(key=lambda t: -_rate(t))
        out.extend(t for t in g[:_SHORTLIST_PER_GROUP] if t.key not in keys)
    return out


# -- scenarios -------------------------------------------------------------------------------


def _zone_order(caps: Mapping[Resource, int]) -> list[str]:
    zone_cap: dict[str, int] = {}
    for (_g, z, _k), n in caps.items():
        zone_cap[z] = zone_cap.get(z, 0) + n
    region_cap: dict[str, int] = {}
    for z, n in zone_cap.items():
        reg = region_of(z)
        region_cap[reg] = region_cap.get(reg, 0) + n

    def key(z: str) -> tuple[int, str, int, str]:
        reg = region_of(z)
        return (-region_cap[reg], reg, -zone_cap[z], z)

    return sorted(zone_cap, key=key)


def _scenarios(caps: Mapping[Resource, int]) -> list[dict[Resource, int]]:
    types = sorted({r[0] for r in caps})
    zones = _zone_order(caps)
    out: list[dict[Resource, int]] = []
    seen: set[tuple[Resource, ...]] = set()
    for n in range(1, len(types) + 1):
        for ts in combinations(types, n):
            for i in range(1, len(zones) + 1):
                zs = set(zones[:i])
                sc = {r: c for r, c in caps.items() if r[0] in ts and r[1] in zs}
                key = tuple(sorted(sc))
                if sc and key not in seen:
                    seen.add(key)
                    out.append(sc)
    return out


def objective_score(objective: Objective, thr: float, cost_iter: float, cost_hour: float) -> float:
    """The objective as one number, larger is better (shared with the baselines)."""
    if objective == "throughput":
        return thr
    if objective == "cost":
        return -cost_iter
    return thr / cost_hour if cost_hour > 0 else 0.0


def _fast_score(objective: Objective, c: Candidate) -> float:
    return objective_score(
        objective, 1.0 / c.fast.iteration_s, c.fast.cost_per_iter, c.fast.cost_per_hour
    )


def _fast_ok(f: FastFigures, c: Constraints, slack: float) -> bool:
    if c.max_cost_per_iter_usd is not None and f.cost_per_iter > c.max_cost_per_iter_usd * slack:
        return False
    if c.max_cost_per_hour_usd is not None and f.cost_per_hour > c.max_cost_per_hour_usd * (
        1 + 1e-9
    ):
        return False
    return not (
        c.min_throughput_iter_s is not None
        and 1.0 / f.iteration_s < c.min_throughput_iter_s / slack
    )


@dataclass
class _Scenario:
    """One scenario's templates and their sync overheads, shared by its recipes."""

    scenario: dict[Resource, int]
    ts: list[PipelineTemplate]
    ring: list[Kind]
    n_guess: int
    over: dict[int, float]
    gbs: int
    least: list[PipelineTemplate] | None = None
    least_done: bool = False
    groups: dict[tuple[int, ...], list[PipelineTemplate]] | None = None
    table: PackTable | None = None

    @classmethod
    def of(
        cls,
        state: SearchState,
        templates: Sequence[PipelineTemplate],
        scenario: dict[Resource, int],
    ) -> _Scenario | None:
        tables = state.tables
        ts = [t for t in templates if _fits(t, scenario)]
        if not ts:
            return None
        gbs = tables.inputs.model.global_batch_size
        ring = sorted(
            {Kind(g, 1, z, k) for (g, z, k) in scenario},
            key=lambda k: (k.zone, k.gpu_type, k.gpus_per_node),
        )
        n_guess = max(2, min(gbs, sum(scenario.values()) // max(1, min(t.gpus for t in ts))))
        # a template's sync overhead depends on the ring and the guessed pipeline count only:
        # kept on the template (a replan on a large pool finds them all)
        key = (tuple(ring), n_guess)
        missing = [t for t in ts if key not in t.__dict__.setdefault("_over", {})]
        if missing:
            fresh = overheads_for(missing, ring, n_guess, _sync_model(state), tables.grad_bytes)
            for t in missing:
                t.__dict__["_over"][key] = fresh[id(t)]
        over = {id(t): t.__dict__["_over"][key] for t in ts}
        return cls(scenario, ts, ring, n_guess, over, gbs)

    def partitions(self) -> dict[tuple[int, ...], list[PipelineTemplate]]:
        """:func:`_partition_groups` of the scenario's templates (computed once)."""
        if self.groups is None:
            self.groups = _partition_groups(self.ts)
        return self.groups

    def packing(self) -> PackTable:
        """The packing table of the scenario's templates and overheads (built once: the
        ``least`` and ``first`` recipes share it)."""
        if self.table is None:
            self.table = PackTable.of(self.ts, self.scenario, self.over)
        return self.table

    def least_time(self) -> list[PipelineTemplate] | None:
        if not self.least_done:
            self.least = min_time_allocation(
                self.ts, self.scenario, self.gbs, self.over, table=self.packing()
            )
            self.least_done = True
        return self.least


def _recipes(
    ctx: _Scenario,
    objective: Objective,
    constraints: Constraints,
    mixed_all: int,
    mbs: int | None,
) -> list[Recipe]:
    """The allocations a scenario tries (see :class:`Recipe`), in the search's order."""
    ts, gbs = ctx.ts, ctx.gbs
    sc = tuple(sorted(ctx.scenario))
    out = [Recipe(sc, "least", mbs=mbs)]
    if sum(ctx.scenario.values()) <= _SMALL_POOL_GPUS:
        # the sync guess assumes many pipelines; in a small pool one or two large
        # pipelines (fewer ring hops, across zones too) may win: price and pack those too
        for n_pipes in (1, 2):
            if n_pipes >= ctx.n_guess:
                break
            out.append(Recipe(sc, "few", n_pipes=n_pipes, mbs=mbs))
    # a pipeline that spans GPU types packs worse by samples per GPU alone (it may be the
    # only way to use a type that cannot hold a stage by itself): also pack the best few first
    mixed = [t for t in ts if len(t.gpus_by_resource()) > 1]
    if len(mixed) > mixed_all:
        by_rate = sorted(mixed, key=lambda t: -_rate(t))[:_MIXED_FIRST]
        by_fill = sorted(mixed, key=lambda t: t.fill_s)[:_MIXED_FIRST]  # small batches
        alone = sorted(mixed, key=lambda t: t.pipe_time(max(1, gbs // t.mbs)))[:_MIXED_FIRST]
        mixed = list({id(t): t for t in by_rate + by_fill + alone}.values())
    out.extend(Recipe(sc, "first", first=t.key, mbs=mbs) for t in mixed)
    # the same on one shared partition: one set of sync segments (across GPU types too);
    # the best partition of each depth, best first
    best_per_depth: dict[int, list[PipelineTemplate]] = {}
    for g in ctx.partitions().values():
        d = len(_cuts(g[0]))
        cur = best_per_depth.get(d)
        if cur is None or max(_rate(t) for t in g) > max(_rate(t) for t in cur):
            best_per_depth[d] = g
    ranked = sorted(best_per_depth.values(), key=lambda g: -max(_rate(t) for t in g))
    groups = [g for g in ranked[:_GROUPS_PER_SCENARIO] if len(g) != len(ts)]
    out.extend(Recipe(sc, "group", cuts=_cuts(g[0]), mbs=mbs) for g in groups)
    want_cost = (
        objective != "throughput"
        or constraints.max_cost_per_iter_usd is not None
        or constraints.max_cost_per_hour_usd is not None
    )
    if want_cost:
        out.extend(Recipe(sc, "cheapest", factor=f, mbs=mbs) for f in _COST_T_FACTORS)
        if constraints.min_throughput_iter_s is not None:
            out.extend(Recipe(sc, "floor", factor=f, mbs=mbs) for f in _FLOOR_T_FACTORS)
            # and on each shared partition: the fewest of its pipelines that meet the floor
            # (the group recipe above uses as many as the batch can keep busy)
            out.extend(
                Recipe(sc, "floor", factor=f, cuts=_cuts(g[0]), mbs=mbs)
                for g in groups
                for f in _FLOOR_T_FACTORS[:2]
            )
    return out


def _partition_groups(
    ts: Sequence[PipelineTemplate],
) -> dict[tuple[int, ...], list[PipelineTemplate]]:
    """Single-GPU-type templates by partition (their last layers)."""
    groups: dict[tuple[int, ...], list[PipelineTemplate]] = {}
    for t in ts:
        if len({s.kind.gpu_type for s in t.stages}) == 1:
            groups.setdefault(_cuts(t), []).append(t)
    return groups


def _run_recipe(
    state: SearchState, ctx: _Scenario, r: Recipe, constraints: Constraints
) -> Allocation | None:
    """The allocation ``r`` makes in ``ctx`` (None if it makes none)."""
    ts, gbs, over, sc = ctx.ts, ctx.gbs, ctx.over, ctx.scenario
    picked: list[PipelineTemplate] | None
    if r.method == "least":
        picked, how = ctx.least_time(), "least time"
    elif r.method == "few":
        over = overheads_for(ts, ctx.ring, r.n_pipes, _sync_model(state), state.tables.grad_bytes)
        picked = min_time_allocation(ts, sc, gbs, over, limit=r.n_pipes)
        how = f"least time, at most {r.n_pipes} pipelines"
    elif r.method == "first":
        first = next((t for t in ts if t.key == r.first), None)
        if first is None:
            return None
        picked = min_time_allocation(ts, sc, gbs, over, first=first, table=ctx.packing())
        how = "least time, a pipeline spanning GPU types first"
    elif r.method == "group":
        g = ctx.partitions().get(r.cuts)
        if not g:
            return None
        picked = min_time_allocation(g, sc, gbs, over)
        how = f"least time on one partition {list(r.cuts)}"
    elif r.method in ("cheapest", "floor"):
        t_max = (
            1.0 / constraints.min_throughput_iter_s
            if constraints.min_throughput_iter_s is not None
            else None
        )
        if r.method == "floor":
            if t_max is None:
                return None
            budget = t_max * r.factor
            how = f"cheapest within {r.factor:g}x the floor's time"
            if r.cuts:
                g = ctx.partitions().get(r.cuts)
                if not g:
                    return None
                ts = g
                how += f" on one partition {list(r.cuts)}"
        else:
            chosen = ctx.least_time()
            if not chosen:
                return None
            alone = chosen[0].pipe_time(1) + over[id(chosen[0])]
            base = max(
                min(t.fill_s + over[id(t)] for t in ts), _least_time(chosen, gbs, over) or alone
            )
            budget = base * r.factor
            if t_max is not None and budget > t_max * 1.05:
                return None
            how = f"cheapest within {r.factor:g}x least time"
        pricing = state.pricing
        tables = state.tables
        price = {
            id(t): sum(
                (pricing.cheapest_per_s(rs) if pricing else tables.price_per_s(rs[0], rs[1])) * n
                for rs, n in t.gpus_by_resource().items()
            )
            for t in ts
        }
        picked = cheapest_for_time(ts, sc, gbs, budget, over, price)
    else:
        raise ValueError(f"recipe method {r.method!r}")
    if not picked:
        return None
    a = assign_microbatches(picked, gbs, over)
    return Allocation(tuple(a), how, r) if a else None


def _allocations(
    state: SearchState,
    templates: Sequence[PipelineTemplate],
    scenario: dict[Resource, int],
    objective: Objective,
    constraints: Constraints,
    mixed_all: int = _MIXED_ALL,
    mbs: int | None = None,
) -> list[Allocation]:
    ctx = _Scenario.of(state, templates, scenario)
    if ctx is None:
        return []
    out: list[Allocation] = []
    for r in _recipes(ctx, objective, constraints, mixed_all, mbs):
        a = _run_recipe(state, ctx, r, constraints)
        if a is not None:
            out.append(a)
    return out


def _least_time(
    pipes: Sequence[PipelineTemplate], gbs: int, over: dict[int, float]
) -> float | None:
    a = assign_microbatches(pipes, gbs, over)
    if not a:
        return None
    return max(t.pipe_time(m) + over[id(t)] for t, m in a)


def _sync_model(state: SearchState) -> SyncModel:
    cached = state.__dict__.get("_sync")
    if cached is None:
        cached = SyncModel(state.tables)
        state.__dict__["_sync"] = cached
    return cached


def closed_form(state: SearchState, alloc: Allocation) -> FastFigures:
    """The search's closed-form figures of ``alloc`` (templates priced by ``state``'s tables)
    on the pool ``state`` was last priced for."""
    return fast_estimate(alloc, state.tables, _sync_model(state), state.pricing)


# -- the search ------------------------------------------------------------------------------


@collector_paused
def search(
    model: ModelSpec,
    profiles: ProfileDB,
    pool: Pool,
    network: NetworkProfile,
    prices: PriceTable,
    objective: Objective = "throughput",
    constraints: Constraints | None = None,
    *,
    gpu_specs: Mapping[str, GPUSpec],
    calibration: Calibration | None = None,
    spot: bool | None = None,
    top_k: int = 5,
    simulate_top: int = 8,
    progress: Progress | None = None,
) -> SearchResult:
    """Ranked feasible plans for ``pool`` (best first) and what the search looked at."""
    inputs = Inputs(
        model=model,
        profiles=profiles,
        network=network,
        prices=prices,
        gpu_specs=gpu_specs,
        calibration=calibration or Calibration(),
        spot=spot,
    )
    state = SearchState(tables=CostTables(inputs))
    return search_with_tables(
        state,
        pool,
        objective,
        constraints or Constraints(),
        top_k=top_k,
        simulate_top=simulate_top,
        progress=progress,
    )


def plan(
    model: ModelSpec,
    profiles: ProfileDB,
    pool: Pool,
    network: NetworkProfile,
    prices: PriceTable,
    objective: Objective = "throughput",
    constraints: Constraints | None = None,
    *,
    gpu_specs: Mapping[str, GPUSpec],
    calibration: Calibration | None = None,
    spot: bool | None = None,
    top_k: int = 5,
) -> list[RankedPlan]:
    """Best plans first; raises :class:`NoFeasiblePlanError` (with the reason) if there is none."""
    res = search(
        model,
        profiles,
        pool,
        network,
        prices,
        objective,
        constraints,
        gpu_specs=gpu_specs,
        calibration=calibration,
        spot=spot,
        top_k=top_k,
    )
    if not res.plans:
        raise NoFeasiblePlanError(res.reason)
    return list(res.plans)


def search_with_tables(
    state: SearchState,
    pool: Pool,
    objective: Objective,
    constraints: Constraints,
    *,
    top_k: int = 5,
    simulate_top: int = 8,
    progress: Progress | None = None,
    previous: Plan | None = None,
    extra: Sequence[Allocation] = (),
    prefer_less_movement: float = 0.0,
    shortlist_only: bool = False,
) -> SearchResult:
    """The search on given (possibly warm) tables; :func:`replan` calls it too (``full``).

    ``extra`` allocations (a replan's warm start) are always simulated first.
    ``shortlist_only``: allocate only over the templates the last search used plus the best
    few per resource set by steady rate.
    """
    prep = _prepare(state, pool, objective, constraints, top_k, previous)
    if isinstance(prep, SearchResult):
        return prep
    caps, ub, templates, computed = prep
    mixed_all = _MIXED_ALL if sum(caps.values()) <= _SMALL_POOL_GPUS else 0
    if shortlist_only and state.shortlist:
        templates = _shortlist(templates, state.shortlist)
        mixed_all = 0
    scenarios = _scenarios(caps)
    total = len(scenarios) + simulate_top
    allocs, pruned_bound = _allocate_by_bound(
        state, templates, scenarios, objective, constraints, mixed_all, progress, total
    )
    allocs = [*extra, *allocs]
    state.shortlist = {id(t): t for a in allocs for t, _ in a.pipelines}
    cands = _candidates(state, allocs)
    ok = [c for c in cands if _fast_ok(c.fast, constraints, 1.15)]
    forced = {a.key for a in extra}  # a replan always judges its warm start
    ok.sort(key=lambda c: (c.alloc.key not in forced, -_fast_score(objective, c)))
    top = max((_fast_score(objective, x) for x in ok), default=0.0)

    enough = _enough(objective, forced, top, top_k, simulate_top, prefer_less_movement)

    def moves_of(c: Candidate) -> tuple[tuple[int, ...], int]:
        return moved_layers(previous, c.plan) if c.plan is not None else ((), 0)

    return _judge(
        state,
        pool,
        objective,
        constraints,
        ok,
        len(cands),
        enough,
        6 * simulate_top,
        moves_of,
        previous,
        prefer_less_movement,
        top_k,
        ub,
        SearchStats(
            templates=len(templates),
            allocations=len(cands),
            pruned_memory=state.pruned_memory,
            pruned_bound=pruned_bound,
            notes=(f"{computed} template DPs run, {len(scenarios)} scenarios",),
        ),
        progress=(lambda k: progress(len(scenarios) + min(k, simulate_top), total))
        if progress is not None
        else None,
        done=(lambda: progress(total, total)) if progress is not None else None,
    )


def _allocate_by_bound(
    state: SearchState,
    templates: Sequence[PipelineTemplate],
    scenarios: list[dict[Resource, int]],
    objective: Objective,
    constraints: Constraints,
    mixed_all: int,
    progress: Progress | None,
    total: int,
) -> tuple[list[Allocation], int]:
    """Allocations of every scenario, the most promising (highest bound) first; a
    throughput search without a cost limit skips a scenario whose bound is below the best
    fast estimate so far. Returns the allocations and how many scenarios were skipped."""
    tables = state.tables
    scen_bounds = sorted(
        ((pool_bound(tables, s), i) for i, s in enumerate(scenarios)), reverse=True
    )
    sync = _sync_model(state)
    best_thr = 0.0
    pruned_bound = 0
    allocs: list[Allocation] = []
    for step, (bnd, i) in enumerate(scen_bounds):
        if progress is not None:
            progress(step, total)
        if (
            objective == "throughput"
            and bnd < best_thr
            and constraints.max_cost_per_iter_usd is None
        ):
            pruned_bound += 1
            continue
        new = _scenario_allocations(
            state, templates, scenarios[i], objective, constraints, mixed_all
        )
        for a in new:
            f = fast_estimate(a, tables, sync, state.pricing)
            best_thr = max(best_thr, 1.0 / f.iteration_s)
        allocs.extend(new)
    return allocs, pruned_bound


def _scenario_allocations(
    state: SearchState,
    templates: Sequence[PipelineTemplate],
    scenario: dict[Resource, int],
    objective: Objective,
    constraints: Constraints,
    mixed_all: int,
) -> list[Allocation]:
    """One scenario's allocations (with one microbatch size: per size, over its templates)."""
    if not constraints.one_microbatch_size:
        return _allocations(state, templates, scenario, objective, constraints, mixed_all)
    return [
        a
        for b in sorted({t.mbs for t in templates})
        for a in _allocations(
            state,
            [t for t in templates if t.mbs == b],
            scenario,
            objective,
            constraints,
            mixed_all,
            b,
        )
    ]


def _enough(
    objective: Objective,
    forced: set[tuple[object, ...]],
    top: float,
    top_k: int,
    simulate_top: int,
    prefer_less_movement: float,
) -> Callable[[Sequence[Candidate], Sequence[Candidate]], bool]:
    """When the search has simulated enough candidates (``judged``, of which ``feasible``)."""

    def enough(judged: Sequence[Candidate], feasible: Sequence[Candidate]) -> bool:
        if len(feasible) >= top_k and len(judged) >= simulate_top:
            return True
        last = judged[-1] if judged else None
        if last is None or not feasible or last is not feasible[-1]:
            return False
        if last.alloc.key not in forced or prefer_less_movement <= 0:
            return False
        # the warm start is within the tolerance of the best estimate: it moves the least
        # state, so nothing else would be preferred; stop simulating
        return _sim_score(objective, last) >= top - abs(top) * prefer_less_movement

    return enough


def search_recipes(
    state: SearchState,
    pool: Pool,
    objective: Objective,
    constraints: Constraints,
    recipes: Sequence[Recipe],
    *,
    extra: Sequence[Allocation] = (),
    previous: Plan | None = None,
    moves_of: Callable[[Allocation], tuple[tuple[int, ...], int]] | None = None,
    tolerance: float = 0.02,
    top_k: int = 1,
    simulate_top: int = 4,
) -> SearchResult:
    """A replan's search: the allocations ``recipes`` make on ``pool``, plus ``extra``.

    Each recipe runs on its scenario restricted to the resources the pool still has, over
    the templates a full search of the pool would use (cached per pool shape). Candidates are
    ranked by the closed form, which follows the simulator; among those within ``tolerance``
    of the best, the one that moves the fewest layer replicas (``moves_of``) is simulated
    first. Simulation stops once ``top_k`` plans are feasible and the best simulated one is
    within ``tolerance`` of the best estimate (or after ``simulate_top`` simulations).

    ``simulate_top=0`` simulates nothing: the result has no plans, and its candidates are
    the closed-form ranking above, the first ``top_k`` with their plans built, for a caller
    that judges them itself (:func:`sailor.planner.robust.robust_replan`).
    """
    prep = _prepare(state, pool, objective, constraints, top_k, previous)
    if isinstance(prep, SearchResult):
        return prep
    caps, ub, templates, computed = prep
    ctxs: dict[tuple[object, ...], _Scenario | None] = {}
    allocs: list[Allocation] = list(extra)
    done: set[Recipe] = set()
    for r in recipes:
        sc = {res: caps[res] for res in r.scenario if res in caps}
        if not sc:
            continue
        r = replace(r, scenario=tuple(sorted(sc)))
        if r in done:
            continue
        done.add(r)
        key = (r.scenario, r.mbs)
        if key not in ctxs:
            ts = [t for t in templates if r.mbs is None or t.mbs == r.mbs]
            ctxs[key] = _Scenario.of(state, ts, sc)
        ctx = ctxs[key]
        if ctx is None:
            continue
        a = _run_recipe(state, ctx, r, constraints)
        if a is not None:
            allocs.append(a)
    cands = _candidates(state, allocs)
    ok = [c for c in cands if _fast_ok(c.fast, constraints, 1.15)]
    ok.sort(key=lambda c: -_fast_score(objective, c))
    top = _fast_score(objective, ok[0]) if ok else 0.0
    span = abs(top) * tolerance
    moved: dict[int, tuple[tuple[int, ...], int]] = {}
    if moves_of is not None:
        close = [c for c in ok if _fast_score(objective, c) >= top - span]
        for c in close:
            moved[id(c.alloc)] = moves_of(c.alloc)
        close.sort(key=lambda c: (moved[id(c.alloc)][1], -_fast_score(objective, c)))
        ok = close + ok[len(close) :]

    if simulate_top == 0:
        shown = [
            Candidate(c.alloc, c.fast, plan=_plan_of(state, c.alloc, f"sailor-{i + 1}"))
            for i, c in enumerate(ok[:top_k])
        ]
        reason = (
            "not simulated: closed-form candidates, for the caller to judge"
            if ok
            else "no allocation meets the constraints by the search's estimate "
            f"({len(cands)} allocations looked at)"
        )
        return _empty(state, pool, objective, constraints, previous, reason, ub, shown + ok[top_k:])

    def enough(judged: Sequence[Candidate], feasible: Sequence[Candidate]) -> bool:
        if len(feasible) < top_k:
            return False
        best = max(_sim_score(objective, c) for c in feasible)
        return best >= top - span

    def moves(c: Candidate) -> tuple[tuple[int, ...], int]:
        hit = moved.get(id(c.alloc))
        if hit is None:
            hit = moves_of(c.alloc) if moves_of is not None else ((), 0)
        return hit

    return _judge(
        state,
        pool,
        objective,
        constraints,
        ok,
        len(cands),
        enough,
        simulate_top,
        moves,
        previous,
        tolerance if moves_of is not None else 0.0,
        top_k,
        ub,
        SearchStats(
            templates=len(templates),
            allocations=len(cands),
            pruned_memory=state.pruned_memory,
            notes=(f"{computed} template DPs run, {len(done)} recipes re-run",),
        ),
    )


def _prepare(
    state: SearchState,
    pool: Pool,
    objective: Objective,
    constraints: Constraints,
    top_k: int,
    previous: Plan | None,
) -> tuple[dict[Resource, int], float, list[PipelineTemplate], int] | SearchResult:
    """Checked inputs, allowed resources, upper bound and templates; or the empty result."""
    if objective not in OBJECTIVES:
        raise PlannerInputError(f"objective={objective!r}: use one of {', '.join(OBJECTIVES)}")
    if top_k < 1:
        raise PlannerInputError(f"top_k={top_k}: must be >= 1")
    tables = state.tables
    inputs = tables.inputs
    _check_inputs(inputs, pool, objective, constraints)
    caps = resources_of(pool, constraints)
    state.pricing = GpuPricing.of(pool, inputs.prices, inputs.spot)

    def empty(reason: str, ub: float = 0.0) -> SearchResult:
        return _empty(state, pool, objective, constraints, previous, reason, ub)

    if not caps:
        return empty("no GPU of the pool is allowed by the constraints (zones, regions, caps)")
    ub = pool_bound(tables, caps)
    if constraints.min_throughput_iter_s is not None and constraints.min_throughput_iter_s > ub:
        return empty(
            f"min_throughput={constraints.min_throughput_iter_s:.4g} it/s exceeds the pool's "
            f"upper bound {ub:.4g} it/s (perfect scaling of the fastest compute)",
            ub,
        )
    templates, computed = _template_set(state, caps)
    if not templates:
        why = [f for f in (tables.failure(g, 1, 1) for (g, _z, _k) in caps) if f is not None]
        return empty(
            f"model {inputs.model.name} fits on no stage of any GPU type in the pool at any "
            "depth, TP degree and microbatch size (memory)"
            + (f"; profile lookups failed: {'; '.join(why)}" if why else ""),
            ub,
        )
    return caps, ub, templates, computed


def _empty(
    state: SearchState,
    pool: Pool,
    objective: Objective,
    constraints: Constraints,
    previous: Plan | None,
    reason: str,
    ub: float = 0.0,
    cands: Sequence[Candidate] = (),
) -> SearchResult:
    return SearchResult(
        plans=(),
        reason=reason,
        objective=objective,
        constraints=constraints,
        upper_bound_iter_s=ub,
        candidates=tuple(cands),
        stats=SearchStats(pruned_memory=state.pruned_memory),
        state=state,
        pool=pool,
        previous=previous,
    )


def _template_set(
    state: SearchState, caps: Mapping[Resource, int]
) -> tuple[list[PipelineTemplate], int]:
    """The pool's templates, dominated ones dropped, and the number of DPs run for them.

    Cached per pool shape: a template needs at most ``layers x GPUs per node`` GPUs of a
    resource, and no rule that picks templates looks further (see :func:`_saturated`), so
    pools that differ only above that count share one list (a replan after nodes join or
    leave a large pool finds it ready).
    """
    n = state.tables.inputs.model.num_all_layers
    key = tuple(sorted((r, min(c, _saturated(r, n))) for r, c in caps.items()))
    hit = state.template_sets.get(key)
    if hit is not None:
        return hit, 0
    tstats = {"computed": 0}
    out = _prune_dominated(_templates(state, dict(key), tstats))
    state.template_sets[key] = out
    return out, tstats["computed"]


def _saturated(r: Resource, n_layers: int) -> int:
    """GPUs of ``r`` above which the template rules see no difference: every template fits
    (at most ``n_layers`` stages of at most a node each), every split of a depth between two
    kinds fits, and neither the small-pool rules (:data:`_SMALL_POOL_GPUS`, :data:`_SPLIT_ALL`)
    apply."""
    return max(r[2] * n_layers, _SMALL_POOL_GPUS + 1, r[2] * (_SPLIT_ALL + 1))


def _candidates(state: SearchState, allocs: Sequence[Allocation]) -> list[Candidate]:
    sync = _sync_model(state)
    seen: set[tuple[object, ...]] = set()
    out: list[Candidate] = []
    for a in allocs:
        if a.key in seen:
            continue
        seen.add(a.key)
        out.append(Candidate(alloc=a, fast=fast_estimate(a, state.tables, sync, state.pricing)))
    return out


def _plan_of(state: SearchState, alloc: Allocation, plan_id: str) -> Plan:
    """``alloc`` as the plan the simulator is given (the model's precision on each GPU)."""
    inputs = state.tables.inputs
    gbs = inputs.model.global_batch_size
    p = to_plan(alloc, inputs.model.name, gbs, plan_id=plan_id, pricing=state.pricing)
    return p.with_precision(inputs.gpu_specs, inputs.model.precision)


def _simulate_candidate(
    state: SearchState, c: Candidate, constraints: Constraints, plan_id: str
) -> Candidate:
    """``c`` with its plan, the simulator's estimate and the constraints it breaks."""
    inputs = state.tables.inputs
    p = _plan_of(state, c.alloc, plan_id)
    try:
        est = simulate(
            p,
            inputs.model,
            inputs.profiles,
            inputs.network,
            inputs.prices,
            calibration=inputs.calibration,
            gpu_specs=inputs.gpu_specs,
            spot=bool(inputs.spot),
        )
    except (ProfileLookupError, KeyError, ValueError) as exc:
        return Candidate(c.alloc, c.fast, None, p, (f"simulator: {exc}",))
    viol = list(constraints.violations(est, c.fast.cost_per_hour))
    if not est.fits_in_memory:
        viol.append(f"peak memory {est.peak_memory_bytes / 2**30:.2f} GiB exceeds a GPU")
    return Candidate(c.alloc, c.fast, est, p, tuple(viol))


def _sim_score(objective: Objective, c: Candidate) -> float:
    assert c.estimate is not None
    return objective_score(
        objective, c.estimate.throughput_iter_s, c.estimate.cost_per_iter_usd, c.fast.cost_per_hour
    )


def _judge(
    state: SearchState,
    pool: Pool,
    objective: Objective,
    constraints: Constraints,
    ok: Sequence[Candidate],
    n_cands: int,
    enough: Callable[[Sequence[Candidate], Sequence[Candidate]], bool],
    limit: int,
    moves_of: Callable[[Candidate], tuple[tuple[int, ...], int]],
    previous: Plan | None,
    prefer_less_movement: float,
    top_k: int,
    ub: float,
    stats: SearchStats,
    progress: Callable[[int], None] | None = None,
    done: Callable[[], None] | None = None,
) -> SearchResult:
    """Simulate ``ok`` in order until ``enough`` (at most ``limit``), then rank the feasible
    plans by the simulator's figures (within ``prefer_less_movement`` of the best, by the
    layer replicas they move from ``previous``)."""
    judged: list[Candidate] = []
    feasible: list[Candidate] = []
    idx = 0
    while idx < len(ok) and idx < limit:
        cand = _simulate_candidate(state, ok[idx], constraints, f"sailor-{idx + 1}")
        idx += 1
        judged.append(cand)
        if cand.estimate is not None and not cand.violations:
            feasible.append(cand)
        if progress is not None:
            progress(idx)
        if enough(judged, feasible):
            break
    if done is not None:
        done()
    kept = judged + list(ok[idx:])
    if not feasible:
        if not ok:
            reason = (
                "no allocation meets the constraints by the search's estimate "
                f"({n_cands} allocations looked at)"
            )
        else:
            reasons = sorted({v for c in judged for v in c.violations})
            reason = "no simulated plan is feasible: " + "; ".join(reasons[:5])
        return _empty(state, pool, objective, constraints, previous, reason, ub, kept)

    feasible.sort(key=lambda c: -_sim_score(objective, c))
    moves = {id(c): moves_of(c) for c in feasible}
    if previous is not None and prefer_less_movement > 0:
        top = _sim_score(objective, feasible[0])
        span = abs(top) * prefer_less_movement
        close = [c for c in feasible if _sim_score(objective, c) >= top - span]
        rest = [c for c in feasible if _sim_score(objective, c) < top - span]
        close.sort(key=lambda c: (moves[id(c)][1], -_sim_score(objective, c)))
        feasible = close + rest
    ranked: list[RankedPlan] = []
    for r, c in enumerate(feasible[:top_k]):
        assert c.estimate is not None and c.plan is not None
        mv = moves[id(c)]
        ranked.append(
            RankedPlan(
                rank=r + 1,
                plan=c.plan.model_copy(update={"plan_id": f"sailor-{r + 1}"}),
                estimate=c.estimate,
                cost_per_hour_usd=c.fast.cost_per_hour,
                upper_bound_fraction=c.estimate.throughput_iter_s / ub if ub > 0 else 0.0,
                moved_layers=mv[0],
                moved_layer_replicas=mv[1],
                explain=_explain(c, ub),
            )
        )
    return SearchResult(
        allocations=tuple(c.alloc for c in feasible[:top_k]),
        plans=tuple(ranked),
        reason="",
        objective=objective,
        constraints=constraints,
        upper_bound_iter_s=ub,
        candidates=tuple(kept),
        stats=replace(stats, simulated=len(judged)),
        state=state,
        pool=pool,
        previous=previous,
    )


def explain_candidate(c: Candidate, ub: float) -> tuple[str, ...]:
    """How the search built ``c`` and what the simulator said of it (``--explain``)."""
    return _explain(c, ub)


def _explain(c: Candidate, ub: float) -> tuple[str, ...]:
    # Pipelines grouped by template key, in first-seen order, each group described by its
    # last template. A key is looked up once per template object, not once per pipeline:
    # hashing it (its stage kinds are dataclasses) 700 times was ~2 ms of a 512-node replan.
    group_of: dict[int, int] = {}
    number: dict[tuple[object, ...], int] = {}
    groups: list[list[int]] = []
    temps: list[PipelineTemplate] = []
    for t, m in c.alloc.pipelines:
        g = group_of.get(id(t))
        if g is None:
            g = group_of[id(t)] = number.setdefault(t.key, len(number))
            if g == len(groups):
                groups.append([])
                temps.append(t)
        groups[g].append(m)
        temps[g] = t
    lines = [f"allocation: {c.alloc.how}"]
    for t, ms in zip(temps, groups, strict=True):
        stages = ", ".join(
            f"{s.kind.gpu_type} tp{s.kind.tp}@{s.kind.zone} L{s.first_layer}-{s.last_layer}"
            for s in t.stages
        )
        lines.append(
            f"{len(ms)} x pipeline [{stages}] mbs {t.mbs}, microbatches {min(ms)}-{max(ms)}, "
            f"period {t.period_s * 1e3:.1f} ms, fill {t.fill_s * 1e3:.1f} ms"
        )
    e = c.estimate
    if e is not None:
        tb = e.time
        lines.append(
            f"simulated: {e.iteration_time_s:.3f} s/iter = compute {tb.compute_s:.3f} + p2p "
            f"{tb.p2p_s:.3f} + bubble {tb.bubble_s:.3f} + sync {tb.grad_sync_s:.3f} + update "
            f"{tb.update_s:.3f}; search estimate {c.fast.iteration_s:.3f} s"
        )
        if ub > 0:
            lines.append(f"{e.throughput_iter_s / ub:.1%} of the upper bound {ub:.3f} it/s")
    return tuple(lines)
