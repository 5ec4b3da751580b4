"""The robust ranking's measure: a plan's figures in one corner of the cost model's
uncertainty, and the order by minimax relative regret over them (``robust._rank`` judges
the candidates; this module scores and orders them).

A plan's figures in a corner come from the simulator, or from the closed form of its
allocation over that corner's cost tables (its time and $ follow the simulator's; memory is
the tables' bound). The order keeps the plans that fit and meet every limit in every judged
corner and ranks them by their worst judged corner's score relative to that corner's best
kept plan, then by the median corner's (docs/planner.md, "Robust planning").

Pure: values in, values out. Never simulates: the caller decides what to simulate.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from sailor.planner.allocate import Allocation
from sailor.planner.api import Constraints, Objective
from sailor.planner.scenarios import closed_form
from sailor.planner.template_pool import SearchState
from sailor.planner.templates import repriced
from sailor.schemas import Calibration, Estimate, Plan
from sailor.simulator.uncertainty import MEDIAN

__all__ = [
    "Figures",
    "Row",
    "Scored",
    "closed_form_figures",
    "order_by_regret",
    "score_of",
    "simulated_figures",
]


@dataclass(frozen=True)
class Figures:
    """A plan's figures in one corner: the simulator's (``estimate`` set) or the closed
    form's (its time and $ follow the simulator's; memory is the tables' bound, checked
    before: only plans that fit by it are left to the closed form)."""

    throughput_iter_s: float
    cost_per_iter_usd: float
    violations: tuple[str, ...]
    estimate: Estimate | None = None


Row = tuple[Plan, dict[str, Figures], float, "Allocation | None"]
Scored = tuple[tuple[float, float], float, dict[str, float], Row, dict[str, tuple[str, ...]]]


def simulated_figures(e: Estimate, cons: Constraints, cph: float) -> Figures:
    v = list(cons.violations(e, cph))
    if not e.fits_in_memory:
        v.append(f"peak memory {e.peak_memory_bytes / 2**30:.2f} GiB exceeds a GPU")
    return Figures(e.throughput_iter_s, e.cost_per_iter_usd, tuple(v), e)


def closed_form_figures(
    alloc: Allocation, state: SearchState, cons: Constraints, cph: float
) -> Figures | None:
    """``alloc``'s closed-form figures in ``state``'s corner; None if a template cannot be
    priced there or a stage exceeds its GPU by the tables' memory bound (which holds every
    stage's 1F1B microbatches in flight, and a rank's world and TP communicators but not its
    gradient-sync groups, which depend on the whole plan: beyond ``communicators_covered``
    the simulator's figure can be higher, so the search simulates each corner's best plan
    and the plans it returns before it trusts them, ``robust._rank``)."""
    tables = state.tables
    by_id = {}
    for t, _, _ in alloc.groups():
        r = repriced(tables, t)
        if r is None or any(st.memory_bytes > tables.capacity(st.kind.gpu_type) for st in r.stages):
            return None
        by_id[id(t)] = r
    f = closed_form(state, alloc.mapped(by_id, alloc.how))
    thr = 1.0 / f.iteration_s
    return Figures(thr, f.cost_per_iter, tuple(cons.limit_violations(thr, f.cost_per_iter, cph)))


def score_of(objective: Objective, f: Figures, cost_per_hour: float) -> float:
    """Larger is better, positive: it/s, iterations per $, or it/s per $/h."""
    if objective == "throughput":
        return f.throughput_iter_s
    if objective == "cost":
        return 1.0 / f.cost_per_iter_usd if f.cost_per_iter_usd > 0 else float("inf")
    return f.throughput_iter_s / cost_per_hour if cost_per_hour > 0 else 0.0


def order_by_regret(
    plans: list[Row],
    judged: tuple[str, ...],
    objective: Objective,
    by_name: Mapping[str, Calibration],
    moves: Callable[[Plan], int] | None,
    tolerance: float,
) -> list[Scored]:
    """The plans that fit and meet every limit in every judged corner, best first (empty if
    none does): by the worst judged corner's ratio to that corner's best kept plan, then the
    median corner's; with ``moves`` (a replan: layer replicas moved from the running plan),
    those within ``tolerance`` of the best by moves."""
    kept = [r for r in plans if not any(r[1][n].violations for n in judged)]
    if not kept:
        return []
    best = {
        n: max(score_of(objective, r[1][n], r[2]) for r in kept) for n in by_name
    }  # best kept plan per corner
    scored: list[Scored] = []
    for r in kept:
        rt = {n: score_of(objective, r[1][n], r[2]) / best[n] for n in by_name}
        worst_ratio = min(rt[n] for n in judged)
        # robust: the worst judged corner; optimistic/median: their one corner
        viol = {n: f.violations for n, f in r[1].items()}
        scored.append(((worst_ratio, rt[MEDIAN]), worst_ratio, rt, r, viol))
    scored.sort(key=lambda x: x[0], reverse=True)
    if moves is not None and scored:
        # a replan: among plans within ``tolerance`` of the best ratio, move the least first
        top = scored[0][1]
        near = [x for x in scored if x[1] >= top * (1 - tolerance)]
        near.sort(key=lambda x: moves(x[3][0]))  # stable: ratio order kept
        scored = near + [x for x in scored if x[1] < top * (1 - tolerance)]
    return scored
