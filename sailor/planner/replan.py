"""Incremental replanning: a new pool, the previous search's tables and plan.

When nodes join or leave, the GPU types, zones and VM shapes rarely change, so every cost
table and pipeline template of the previous search is still valid (they never depend on node
counts). :func:`replan` reuses them, adds one warm-start candidate (the current allocation,
trimmed to the pipelines the new pool still hosts or grown with more pipelines of the same
templates, microbatches re-spread), reruns the allocation and the simulator on the few best,
and, among plans whose objective is within ``tolerance`` of the best, prefers the one that
moves the fewest layer replicas (:mod:`moves`).
"""

from __future__ import annotations

from sailor.planner.allocate import Allocation, assign_microbatches
from sailor.planner.search import SearchResult, resources_of, search_with_tables
from sailor.planner.templates import PipelineTemplate
from sailor.schemas import Pool

__all__ = ["replan", "warm_start"]


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
    templates = sorted(
        {id(t): t for t, _ in alloc.pipelines}.values(), key=lambda t: t.period_s / t.mbs
    )
    for t in templates:
        need = t.gpus_by_resource()
        while all(left.get(r, 0) >= k for r, k in need.items()):
            for r, k in need.items():
                left[r] -= k
            kept.append(t)
    zero = {id(t): 0.0 for t in kept}
    a = assign_microbatches(kept, gbs, zero)
    return Allocation(tuple(a), "warm start: current plan adapted to the new pool") if a else None


def replan(
    previous: SearchResult,
    new_pool: Pool,
    *,
    tolerance: float = 0.02,
    top_k: int | None = None,
    simulate_top: int = 2,
    full: bool = False,
) -> SearchResult:
    """Plans for ``new_pool`` warm-started from ``previous`` (its tables, templates, plan).

    Ranked as a full search would, except that plans within ``tolerance`` (relative) of the
    best objective are ordered by the layer replicas they would move from the current plan.
    Unless ``full``, allocations draw only on the templates the previous search used plus the
    best few per resource set (the cost tables and every template stay available).
    """
    state = previous.state
    gbs = state.tables.inputs.model.global_batch_size
    caps = resources_of(new_pool, previous.constraints)
    extra: list[Allocation] = []
    current = previous.plans[0].plan if previous.plans else None
    if previous.allocations:
        w = warm_start(previous.allocations[0], caps, gbs)
        if w is not None:
            extra.append(w)
    return search_with_tables(
        state,
        new_pool,
        previous.objective,
        previous.constraints,
        top_k=top_k or max(1, len(previous.plans)),
        simulate_top=simulate_top,
        previous=current,
        extra=extra,
        prefer_less_movement=tolerance,
        shortlist_only=not full,
    )
