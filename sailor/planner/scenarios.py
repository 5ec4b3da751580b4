"""Scenarios and the allocations the search makes in each.

A scenario is which GPU types and zones a plan uses at all (:func:`scenarios_of`: every
non-empty subset of the types times every prefix of the zones, ordered by region, then
capacity). :class:`Scenario` holds one scenario's templates and their gradient-sync
overheads (the scenario fixes the ring a gradient all-reduce runs over); its recipes
(:class:`Recipe`: least time, a few large pipelines, a pipeline spanning GPU types first,
one shared partition, the cheapest pipelines for a range of iteration-time budgets) each
make an allocation (:func:`run_recipe`, :func:`scenario_allocations`).
:func:`closed_form` prices an allocation with the search's closed form (:mod:`fast_estimate`).

Pure: values in, values out, apart from the caches on the :class:`SearchState` and templates
passed in. It never simulates (:mod:`judge` does).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import combinations

from sailor.planner.allocate import (
    Allocation,
    PackTable,
    Recipe,
    Resource,
    assign_microbatches,
    cheapest_for_time,
    min_time_allocation,
)
from sailor.planner.api import Constraints, Objective
from sailor.planner.fast_estimate import FastFigures, SyncModel, fast_estimate, overheads_for
from sailor.planner.tables import Kind
from sailor.planner.template_pool import (
    SMALL_POOL_GPUS,
    SearchState,
    cuts_of,
    fits,
    rate,
)
from sailor.planner.templates import PipelineTemplate
from sailor.schemas.zones import region_of
from sailor.simulator.network_model import ring_order

__all__ = [
    "MIXED_ALL",
    "OVERHEADS_KEPT",
    "Scenario",
    "closed_form",
    "run_recipe",
    "scenario_allocations",
    "scenarios_of",
    "sync_model",
]


_MIXED_FIRST = 3
"""Above :data:`MIXED_ALL`, the pipelines spanning GPU types packed first are the best few by
steady rate, by fill time and by time to run the whole batch alone."""


MIXED_ALL = 64
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


def scenarios_of(caps: Mapping[Resource, int]) -> list[dict[Resource, int]]:
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


OVERHEADS_KEPT = 8
"""Sync overheads a template keeps, by (ring, guessed pipeline count): the last ones asked
for. A controller replans its pool for days as nodes come and go, and each pool size guesses
its own count: unbounded, the templates' dicts grew with every size seen. One dropped is
computed again when asked (the same figure)."""


def _keep(kept: dict[tuple[object, ...], float], key: tuple[object, ...], value: float) -> None:
    """``kept[key] = value``, the oldest entries dropped beyond :data:`OVERHEADS_KEPT`."""
    kept[key] = value
    while len(kept) > OVERHEADS_KEPT:
        del kept[next(iter(kept))]


@dataclass
class Scenario:
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
    ) -> Scenario | None:
        tables = state.tables
        ts = _fitting(templates, scenario)
        if not ts:
            return None
        gbs = tables.inputs.model.global_batch_size
        ring = sorted({Kind(g, 1, z, k) for (g, z, k) in scenario}, key=ring_order)
        n_guess = max(2, min(gbs, sum(scenario.values()) // max(1, min(t.gpus for t in ts))))
        # a template's sync overhead depends on the ring and the guessed pipeline count only:
        # kept on the template (a replan on a large pool finds them all)
        key = (tuple(ring), n_guess)
        kept: list[dict[tuple[object, ...], float] | None] = [t.__dict__.get("_over") for t in ts]
        if not any(d is not None and key in d for d in kept):
            # a new pipeline count (a replan): none is kept
            over = overheads_for(ts, ring, n_guess, sync_model(state), tables.grad_bytes)
            for t, d in zip(ts, kept, strict=True):
                if d is None:
                    object.__setattr__(t, "_over", {key: over[id(t)]})
                else:
                    _keep(d, key, over[id(t)])
            return cls(scenario, ts, ring, n_guess, over, gbs)
        missing = [t for t in ts if key not in t.__dict__.setdefault("_over", {})]
        if missing:
            fresh = overheads_for(missing, ring, n_guess, sync_model(state), tables.grad_bytes)
            for t in missing:
                _keep(t.__dict__["_over"], key, fresh[id(t)])
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


def scenario_allocations(
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


def _allocations(
    state: SearchState,
    templates: Sequence[PipelineTemplate],
    scenario: dict[Resource, int],
    objective: Objective,
    constraints: Constraints,
    mixed_all: int = MIXED_ALL,
    mbs: int | None = None,
) -> list[Allocation]:
    ctx = Scenario.of(state, templates, scenario)
    if ctx is None:
        return []
    out: list[Allocation] = []
    for r in _recipes(ctx, objective, constraints, mixed_all, mbs):
        a = run_recipe(state, ctx, r, constraints)
        if a is not None:
            out.append(a)
    return out


def _recipes(
    ctx: Scenario,
    objective: Objective,
    constraints: Constraints,
    mixed_all: int,
    mbs: int | None,
) -> list[Recipe]:
    """The allocations a scenario tries (see :class:`Recipe`), in the search's order."""
    ts, gbs = ctx.ts, ctx.gbs
    sc = tuple(sorted(ctx.scenario))
    out = [Recipe(sc, "least", mbs=mbs)]
    if sum(ctx.scenario.values()) <= SMALL_POOL_GPUS:
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
        by_rate = sorted(mixed, key=lambda t: -rate(t))[:_MIXED_FIRST]
        by_fill = sorted(mixed, key=lambda t: t.fill_s)[:_MIXED_FIRST]  # small batches
        alone = sorted(mixed, key=lambda t: t.pipe_time(max(1, gbs // t.mbs)))[:_MIXED_FIRST]
        mixed = list({id(t): t for t in by_rate + by_fill + alone}.values())
    out.extend(Recipe(sc, "first", first=t.key, mbs=mbs) for t in mixed)
    # the same on one shared partition: one set of sync segments (across GPU types too);
    # the best partition of each depth, best first
    best_per_depth: dict[int, list[PipelineTemplate]] = {}
    for g in ctx.partitions().values():
        d = len(cuts_of(g[0]))
        cur = best_per_depth.get(d)
        if cur is None or max(rate(t) for t in g) > max(rate(t) for t in cur):
            best_per_depth[d] = g
    ranked = sorted(best_per_depth.values(), key=lambda g: -max(rate(t) for t in g))
    groups = [g for g in ranked[:_GROUPS_PER_SCENARIO] if len(g) != len(ts)]
    out.extend(Recipe(sc, "group", cuts=cuts_of(g[0]), mbs=mbs) for g in groups)
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
                Recipe(sc, "floor", factor=f, cuts=cuts_of(g[0]), mbs=mbs)
                for g in groups
                for f in _FLOOR_T_FACTORS[:2]
            )
    return out


def _fitting(
    templates: Sequence[PipelineTemplate], caps: Mapping[Resource, int]
) -> list[PipelineTemplate]:
    """The templates that fit ``caps`` (:func:`~sailor.planner.template_pool.fits`), in
    order: templates that need the same GPUs (:meth:`PipelineTemplate.need`) are checked
    once."""
    out: list[PipelineTemplate] = []
    seen: dict[int, bool] = {}
    for t in templates:
        need = t.need()
        ok = seen.get(id(need))
        if ok is None:
            ok = seen[id(need)] = fits(t, caps)
        if ok:
            out.append(t)
    return out


def _partition_groups(
    ts: Sequence[PipelineTemplate],
) -> dict[tuple[int, ...], list[PipelineTemplate]]:
    """Single-GPU-type templates by partition (their last layers)."""
    groups: dict[tuple[int, ...], list[PipelineTemplate]] = {}
    for t in ts:
        cuts = _one_type_cuts(t)
        if cuts is not None:
            groups.setdefault(cuts, []).append(t)
    return groups


def _one_type_cuts(t: PipelineTemplate) -> tuple[int, ...] | None:
    """The template's partition (:func:`cuts_of`) if it runs on one GPU type, else None;
    kept on the template (a replan groups every template of a scenario in each corner)."""
    hit: tuple[tuple[int, ...] | None] | None = t.__dict__.get("_one_type_cuts")
    if hit is None:
        one = len({s.kind.gpu_type for s in t.stages}) == 1
        hit = (cuts_of(t) if one else None,)
        object.__setattr__(t, "_one_type_cuts", hit)
    return hit[0]


def run_recipe(
    state: SearchState, ctx: Scenario, r: Recipe, constraints: Constraints
) -> Allocation | None:
    """The allocation ``r`` makes in ``ctx`` (None if it makes none)."""
    ts, gbs, over, sc = ctx.ts, ctx.gbs, ctx.over, ctx.scenario
    picked: list[PipelineTemplate] | None
    if r.method == "least":
        picked, how = ctx.least_time(), "least time"
    elif r.method == "few":
        over = overheads_for(ts, ctx.ring, r.n_pipes, sync_model(state), state.tables.grad_bytes)
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


def _least_time(
    pipes: Sequence[PipelineTemplate], gbs: int, over: dict[int, float]
) -> float | None:
    a = assign_microbatches(pipes, gbs, over)
    if not a:
        return None
    return max(t.pipe_time(m) + over[id(t)] for t, m in a)


def sync_model(state: SearchState) -> SyncModel:
    cached = state.__dict__.get("_sync")
    if cached is None:
        cached = SyncModel(state.tables)
        state.__dict__["_sync"] = cached
    return cached


def closed_form(state: SearchState, alloc: Allocation) -> FastFigures:
    """The search's closed-form figures of ``alloc`` (templates priced by ``state``'s tables)
    on the pool ``state`` was last priced for."""
    return fast_estimate(alloc, state.tables, sync_model(state), state.pricing)
