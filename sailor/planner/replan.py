"""Incremental replanning: a new pool, the previous search's tables, recipes and plan.

When nodes join or leave, the GPU types, zones and VM shapes rarely change, so every cost
table and pipeline template of the previous search is still valid (they never depend on node
counts), and so is the template list of a large pool (cached per pool shape). What changes
is how many pipelines fit. :func:`replan` therefore

1. adapts the current allocation (the **warm start**: pipelines the new pool cannot host
   dropped, slowest first; pipelines of its templates added on GPUs that joined);
2. re-runs the **recipes** of the previous search's best allocations (which scenario, which
   packing rule: :class:`~sailor.planner.allocate.Recipe`) on the new pool's counts, plus
   the least-time packing of the whole pool;
3. ranks them by the closed form, which follows the simulator's schedule, and simulates the
   one that moves the fewest layer replicas among those within ``tolerance`` of the best
   (:mod:`moves`); the returned plan always carries the simulator's figures.

``full=True`` runs the whole allocation search instead (every scenario and rule).

``running`` names the plan that runs now when it is not the previous search's best (a robust
plan another corner's search found: :func:`sailor.planner.robust.robust_replan`): its
allocation, re-priced with this search's tables, is the warm start, and moves are counted
from it.
"""

from __future__ import annotations

import numpy as np

from sailor.planner.allocate import Allocation, Recipe, assign_microbatches
from sailor.planner.collector import collector_paused
from sailor.planner.job_precision import runnable_pool
from sailor.planner.judge import SearchResult
from sailor.planner.search import search_recipes, search_with_tables
from sailor.planner.templates import PipelineTemplate, repriced
from sailor.planner.upper_bound import resources_of
from sailor.schemas import Plan, Pool

__all__ = ["replan", "repriced_allocation", "warm_start"]

_RECIPES = 6
"""Recipes of the previous search's best allocations a replan re-runs. The previous search
ranked them on a pool that differs by a few nodes; its best few are where the new best is.
On the benchmark pools (64-2,048 nodes) the winner was always among the first three."""

_SIMULATE_TOP = 4
"""Plans a replan simulates at most by default (``replan``'s ``simulate_top``)."""


def warm_start(
    alloc: Allocation, caps: dict[tuple[str, str, int], int], gbs: int
) -> Allocation | None:
    """``alloc`` adapted to new capacities: drop pipelines that no longer fit (slowest first),
    add pipelines of its fastest templates on GPUs that joined, and re-spread microbatches."""
    left = dict(caps)
    kept: list[PipelineTemplate] = []
    for t, _ in sorted(alloc.pipelines, key=lambda tm: -tm[1] * tm[0].mbs):
        need = t.gpus_by_resource()
        if all(left.get(r, 0) >= k for r, k in need.items()):
            for r, k in need.items():
                left[r] -= k
            kept.append(t)
    templates = sorted((t for t, _, _ in alloc.groups()), key=lambda t: t.period_s / t.mbs)
    for t in templates:
        need = t.gpus_by_resource()
        while all(left.get(r, 0) >= k for r, k in need.items()):
            for r, k in need.items():
                left[r] -= k
            kept.append(t)
    zero = {id(t): 0.0 for t in kept}
    a = assign_microbatches(kept, gbs, zero)
    return Allocation(tuple(a), "warm start: current plan adapted to the new pool") if a else None


_Holders = dict[tuple[str, str], "np.ndarray"]


def _holders(alloc: Allocation, n_layers: int) -> _Holders:
    """Per (GPU type, zone), how many stages hold each layer (:func:`moves.moved_layers`
    counts the same on plans; here per template, not per pipeline)."""
    out: _Holders = {}
    for t, count, _ in alloc.groups():
        for s in t.stages:
            key = (s.kind.gpu_type, s.kind.zone)
            row = out.get(key)
            if row is None:
                row = out[key] = np.zeros(n_layers, dtype=np.int64)
            row[s.first_layer : s.last_layer + 1] += count
    return out


def _moved(before: _Holders, after: _Holders) -> tuple[tuple[int, ...], int]:
    layers: set[int] = set()
    replicas = 0
    for key, row in after.items():
        old = before.get(key)
        extra = row if old is None else np.maximum(row - old, 0)
        replicas += int(extra.sum())
        layers.update(int(i) for i in np.flatnonzero(extra))
    return tuple(sorted(layers)), replicas


def _recipes_of(previous: SearchResult, limit: int) -> list[Recipe]:
    """The recipes of the previous plans' allocations, then of its other candidates, best
    first (the search ranked them by the closed form, which follows the simulator)."""
    out: list[Recipe] = []
    allocs = [*previous.allocations, *(c.alloc for c in previous.candidates)]
    for a in allocs:
        r = a.recipe
        if r is not None and r not in out:
            out.append(r)
            if len(out) >= limit:
                break
    return out


def repriced_allocation(alloc: Allocation, previous: SearchResult) -> Allocation | None:
    """``alloc`` (templates of any corner's search) with every template re-priced by
    ``previous``'s tables; None if one cannot be priced there."""
    tables = previous.state.tables
    by_id: dict[int, PipelineTemplate] = {}
    for t, _, _ in alloc.groups():
        r = repriced(tables, t)
        if r is None:
            return None
        by_id[id(t)] = r
    return Allocation(tuple((by_id[id(t)], m) for t, m in alloc.pipelines), alloc.how, alloc.recipe)


@collector_paused
def replan(
    previous: SearchResult,
    new_pool: Pool,
    *,
    tolerance: float = 0.02,
    top_k: int = 1,
    simulate_top: int = _SIMULATE_TOP,
    full: bool = False,
    recipes: int = _RECIPES,
    running: tuple[Plan, Allocation] | None = None,
) -> SearchResult:
    """Plans for ``new_pool`` warm-started from ``previous`` (its tables, templates, plan).

    Returns the best ``top_k`` plans (one by default: the controller needs one), ranked as a
    full search would, except that plans within ``tolerance`` (relative) of the best
    objective are ordered by the layer replicas they would move from the current plan.
    Unless ``full``, only the warm start and the re-run recipes of the previous search's best
    ``recipes`` allocations are candidates (see the module docstring).

    ``simulate_top=0`` leaves the judging to the caller: no plan is simulated, and the
    result's candidates are the closed-form ranking, the first ``top_k`` with their plans
    (:func:`sailor.planner.search.search_recipes`). When no recipe can be re-run (no
    previous allocation, ``full``), the search from the tables runs instead and simulates
    as a replan does by default. A result without plans warm-starts the next replan from
    its closed-form best.
    """
    state = previous.state
    inputs = state.tables.inputs
    gbs = inputs.model.global_batch_size
    # the warm start grows only onto GPUs that can run the job's precision (the search
    # below leaves the others out again, and says why)
    runnable, _ = runnable_pool(new_pool, inputs.precision, inputs.gpu_specs)
    caps = resources_of(runnable, previous.constraints)
    current = previous.plans[0].plan if previous.plans else None
    old = previous.allocations[0] if previous.allocations else None
    if old is None:  # a replan that simulated nothing: its closed-form best
        shown = next((c for c in previous.candidates if c.plan is not None), None)
        if shown is not None:
            current, old = shown.plan, shown.alloc
    if running is not None:
        here = repriced_allocation(running[1], previous)
        if here is not None:
            current, old = running[0], here
    extra: list[Allocation] = []
    if old is not None:
        w = warm_start(old, caps, gbs)
        if w is not None:
            extra.append(w)
    todo = _recipes_of(previous, recipes)
    if full or not todo or old is None:
        # a search from the tables always simulates (``simulate_top=0`` asks the recipe path
        # below not to): its best, judged as a replan's by default
        k = top_k if simulate_top > 0 else 1
        return search_with_tables(
            state,
            new_pool,
            previous.objective,
            previous.constraints,
            top_k=k,
            simulate_top=max(simulate_top, k) if simulate_top > 0 else _SIMULATE_TOP,
            previous=current,
            extra=extra,
            prefer_less_movement=tolerance,
            shortlist_only=not full,
        )
    if not previous.constraints.one_microbatch_size:
        whole = Recipe(tuple(sorted(caps)), "least")
        if whole not in todo:
            todo.append(whole)
    n_layers = state.tables.inputs.model.num_all_layers
    before = _holders(old, n_layers)
    return search_recipes(
        state,
        new_pool,
        previous.objective,
        previous.constraints,
        todo,
        extra=extra,
        previous=current,
        moves_of=lambda a: _moved(before, _holders(a, n_layers)),
        tolerance=tolerance,
        top_k=top_k,
        simulate_top=simulate_top,
    )
