"""``plan()``: co-optimize which GPUs to use and how to parallelize on them.

Estimate, then solve:

1. **Tables** (:mod:`tables`): per-layer time, size and per-link transfer times from the
   simulator's own cost functions, for every (GPU type, TP, microbatch size) of the pool.
2. **Templates** (:mod:`templates`, :mod:`template_pool`): per zone, for each stage kind (GPU
   type, TP) and each ordered pair of kinds, a DP gives the best uneven partition for every
   depth; memory prunes. Pairs of kinds in two zones give pipelines that span zones.
3. **Scenarios** (:mod:`scenarios`): which GPU types and zones to use at all. For each
   non-empty subset of GPU types and each prefix of the zones (ordered by region, then
   capacity) the search knows the ring a gradient all-reduce would run over, so it can price
   every template's sync. Scenarios are visited by their throughput upper bound
   (:mod:`upper_bound`) and skipped once the bound cannot beat the best allocation found
   (bound pruning).
4. **Allocation** (:mod:`allocate`): pipelines and microbatches per scenario: the least
   iteration time that covers the global batch (throughput), and the cheapest pipelines for
   a range of iteration times (cost).
5. **Judge** (:mod:`judge`): the best allocations by the search's own closed-form figures
   (:mod:`fast_estimate`) are turned into plans and simulated with
   :func:`sailor.simulator.simulate`; only plans the simulator says fit in memory and meet
   every constraint are returned, ranked by the simulator's figures.

This module holds the entry points (:func:`search`, :func:`plan`, :func:`search_with_tables`,
:func:`search_recipes`) and the loop over scenarios; the steps live in the modules above.

Pure: values in, values out (a progress callback may be passed). No clock: callers time it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from sailor.planner.allocate import Allocation, Recipe, Resource
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
from sailor.planner.fast_estimate import fast_estimate
from sailor.planner.job_precision import runnable_pool
from sailor.planner.judge import (
    Candidate,
    SearchResult,
    candidates,
    empty_result,
    fast_ok,
    fast_score,
    judge,
    plan_of,
    sim_score,
)
from sailor.planner.moves import moved_layers
from sailor.planner.pricing import GpuPricing
from sailor.planner.reach import PlannerReach
from sailor.planner.scenarios import (
    MIXED_ALL,
    Scenario,
    run_recipe,
    scenario_allocations,
    scenarios_of,
    sync_model,
)
from sailor.planner.tables import CostTables, Inputs
from sailor.planner.template_pool import (
    SMALL_POOL_GPUS,
    SearchState,
    shortlist,
    template_set,
)
from sailor.planner.templates import PipelineTemplate
from sailor.planner.upper_bound import pool_bound, resources_of
from sailor.schemas import (
    Calibration,
    GPUSpec,
    ModelSpec,
    NetworkProfile,
    Plan,
    Pool,
    PriceTable,
    ProfileDB,
)
from sailor.schemas.precision import Precision

__all__ = [
    "Progress",
    "plan",
    "search",
    "search_recipes",
    "search_with_tables",
]


Progress = Callable[[int, int], None]
"""Called with (steps done, steps in total) as the search advances."""


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
    reach = PlannerReach.of(
        inputs.gpu_specs,
        inputs.profiles,
        inputs.prices,
        spot=inputs.spot,
        objective=objective,
        constraints=constraints,
    )
    for e in pool.entries:
        why = reach.why_not(e.gpu_type, e.zone, e.gpus_per_node, e.spot)
        if why:
            raise PlannerInputError(why)


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
    precision: Precision | None = None,
) -> SearchResult:
    """Ranked feasible plans for ``pool`` (best first) and what the search looked at.

    ``precision``: the job's, once fixed: every plan is priced and recorded in it, and the
    pool's GPU types that cannot run it are left out (``SearchResult.left_out`` says why).
    """
    inputs = Inputs(
        model=model,
        profiles=profiles,
        network=network,
        prices=prices,
        gpu_specs=gpu_specs,
        calibration=calibration or Calibration(),
        spot=spot,
        precision=precision,
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
    precision: Precision | None = None,
) -> list[RankedPlan]:
    """Best plans first; raises :class:`NoFeasiblePlanError` (with the reason) if there is none.
    ``precision``: the job's (:func:`search`)."""
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
        precision=precision,
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
    mixed_all = MIXED_ALL if sum(caps.values()) <= SMALL_POOL_GPUS else 0
    if shortlist_only and state.shortlist:
        templates = shortlist(templates, state.shortlist)
        mixed_all = 0
    scenarios = scenarios_of(caps)
    total = len(scenarios) + simulate_top
    allocs, pruned_bound = _allocate_by_bound(
        state, templates, scenarios, objective, constraints, mixed_all, progress, total
    )
    allocs = [*extra, *allocs]
    state.shortlist = {id(t): t for a in allocs for t, _ in a.pipelines}
    cands = candidates(state, allocs)
    ok = [c for c in cands if fast_ok(c.fast, constraints, 1.15)]
    forced = {a.key for a in extra}  # a replan always judges its warm start
    ok.sort(key=lambda c: (c.alloc.key not in forced, -fast_score(objective, c)))
    top = max((fast_score(objective, x) for x in ok), default=0.0)

    enough = _enough(objective, forced, top, top_k, simulate_top, prefer_less_movement)

    def moves_of(c: Candidate) -> tuple[tuple[int, ...], int]:
        return moved_layers(previous, c.plan) if c.plan is not None else ((), 0)

    return judge(
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
    sync = sync_model(state)
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
        new = scenario_allocations(
            state, templates, scenarios[i], objective, constraints, mixed_all
        )
        for a in new:
            f = fast_estimate(a, tables, sync, state.pricing)
            best_thr = max(best_thr, 1.0 / f.iteration_s)
        allocs.extend(new)
    return allocs, pruned_bound


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
        return sim_score(objective, last) >= top - abs(top) * prefer_less_movement

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
    ctxs: dict[tuple[object, ...], Scenario | None] = {}
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
            ctxs[key] = Scenario.of(state, ts, sc)
        ctx = ctxs[key]
        if ctx is None:
            continue
        a = run_recipe(state, ctx, r, constraints)
        if a is not None:
            allocs.append(a)
    cands = candidates(state, allocs)
    ok = [c for c in cands if fast_ok(c.fast, constraints, 1.15)]
    ok.sort(key=lambda c: -fast_score(objective, c))
    top = fast_score(objective, ok[0]) if ok else 0.0
    span = abs(top) * tolerance
    moved: dict[int, tuple[tuple[int, ...], int]] = {}
    if moves_of is not None:
        close = [c for c in ok if fast_score(objective, c) >= top - span]
        for c in close:
            moved[id(c.alloc)] = moves_of(c.alloc)
        close.sort(key=lambda c: (moved[id(c.alloc)][1], -fast_score(objective, c)))
        ok = close + ok[len(close) :]

    if simulate_top == 0:
        shown = [
            Candidate(c.alloc, c.fast, plan=plan_of(state, c.alloc, f"sailor-{i + 1}"))
            for i, c in enumerate(ok[:top_k])
        ]
        reason = (
            "not simulated: closed-form candidates, for the caller to judge"
            if ok
            else "no allocation meets the constraints by the search's estimate "
            f"({len(cands)} allocations looked at)"
        )
        return empty_result(
            state, pool, objective, constraints, previous, reason, ub, shown + ok[top_k:]
        )

    def enough(judged: Sequence[Candidate], feasible: Sequence[Candidate]) -> bool:
        if len(feasible) < top_k:
            return False
        best = max(sim_score(objective, c) for c in feasible)
        return best >= top - span

    def moves(c: Candidate) -> tuple[tuple[int, ...], int]:
        hit = moved.get(id(c.alloc))
        if hit is None:
            hit = moves_of(c.alloc) if moves_of is not None else ((), 0)
        return hit

    return judge(
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
    runnable, state.left_out = runnable_pool(pool, inputs.precision, inputs.gpu_specs)
    caps = resources_of(runnable, constraints) if runnable.entries else {}
    state.pricing = GpuPricing.of(pool, inputs.prices, inputs.spot)

    def empty(reason: str, ub: float = 0.0) -> SearchResult:
        return empty_result(state, pool, objective, constraints, previous, reason, ub)

    if not runnable.entries:
        return empty("every GPU type of the pool is left out: " + "; ".join(state.left_out))
    if not caps:
        return empty("no GPU of the pool is allowed by the constraints (zones, regions, caps)")
    ub = pool_bound(tables, caps)
    if constraints.min_throughput_iter_s is not None and constraints.min_throughput_iter_s > ub:
        return empty(
            f"min_throughput={constraints.min_throughput_iter_s:.4g} it/s exceeds the pool's "
            f"upper bound {ub:.4g} it/s (perfect scaling of the fastest compute)",
            ub,
        )
    templates, computed = template_set(state, caps)
    if not templates:
        why = [f for f in (tables.failure(g, 1, 1) for (g, _z, _k) in caps) if f is not None]
        return empty(
            f"model {inputs.model.name} fits on no stage of any GPU type in the pool at any "
            "depth, TP degree and microbatch size (memory)"
            + (f"; profile lookups failed: {'; '.join(why)}" if why else ""),
            ub,
        )
    return caps, ub, templates, computed
