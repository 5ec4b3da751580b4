"""Shared by the baselines: their grid's inputs, its DP degrees and uniform partitions, and
judging grid points with the simulator."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from sailor.planner.api import Constraints, NoFeasiblePlanError, Objective, RankedPlan
from sailor.planner.judge import objective_score
from sailor.planner.pricing import Resource
from sailor.planner.tables import CostTables, Inputs
from sailor.planner.upper_bound import pool_bound, resources_of
from sailor.schemas import Estimate, Plan, Pool
from sailor.simulator import ProfileLookupError

__all__ = [
    "Grid",
    "data_parallel",
    "grid_of",
    "grid_point",
    "judge",
    "uniform_cuts",
]


@dataclass(frozen=True)
class Grid:
    """What a baseline's grid search starts from: cost tables at the given (point)
    calibration, the constraints, the GPUs they allow per resource, and the pool's bound."""

    tables: CostTables
    constraints: Constraints
    caps: dict[Resource, int]
    upper_bound: float


def grid_of(inputs: Inputs, pool: Pool, constraints: Constraints | None) -> Grid:
    """The grid's tables on ``inputs`` and what ``constraints`` (default: none) allow."""
    cons = constraints or Constraints()
    tables = CostTables(inputs)
    caps = resources_of(pool, cons)
    return Grid(tables, cons, caps, pool_bound(tables, caps))


def data_parallel(gpus: int, tp: int, pp: int, mbs: int, gbs: int) -> int:
    """The most pipelines of depth ``pp`` at TP ``tp`` that ``gpus`` GPUs hold such that
    DP x microbatch size divides the global batch ``gbs`` (0: none)."""
    dp = gpus // (tp * pp)
    while dp > 0 and gbs % (dp * mbs):
        dp -= 1
    return dp


def uniform_cuts(n_layers: int, depth: int) -> tuple[int, ...]:
    """Last layer of each stage of an even split; extra layers go to the last stages."""
    base, extra = divmod(n_layers, depth)
    out: list[int] = []
    end = -1
    for s in range(depth):
        end += base + (1 if s >= depth - extra else 0)
        out.append(end)
    return tuple(out)


def grid_point(
    grid: Grid,
    objective: Objective,
    plan: Plan,
    iteration_s: float,
    gpus: Mapping[tuple[str, str], int],
) -> tuple[float, Plan, float]:
    """A grid point as :func:`judge` takes it: its prefilter score (from its closed-form
    iteration time and the $/h of its ``gpus`` per type and zone), the plan, its $/h."""
    hour = sum(grid.tables.price_per_s(g, z) * 3600 * n for (g, z), n in gpus.items())
    score = objective_score(objective, 1.0 / iteration_s, hour / 3600 * iteration_s, hour)
    return score, plan, hour


def judge(
    grid: Grid,
    points: Sequence[tuple[float, Plan, float]],
    objective: Objective,
    top_k: int,
    simulate_top: int,
    label: str,
) -> list[RankedPlan]:
    """Simulate the best ``max(simulate_top, top_k)`` grid points by their prefilter score
    (``points``: score, plan, $/h), best first; keep the feasible best ``top_k``."""
    inp = grid.tables.inputs
    ranked: list[tuple[float, Plan, Estimate, float]] = []
    for _, plan, hour in sorted(points, key=lambda x: -x[0])[: max(simulate_top, top_k)]:
        p = plan.with_precision(inp.gpu_specs, inp.model.precision)
        try:
            est = inp.simulate(p)
        except (ProfileLookupError, KeyError, ValueError):
            continue
        if not est.fits_in_memory or grid.constraints.violations(est, hour):
            continue
        sc = objective_score(objective, est.throughput_iter_s, est.cost_per_iter_usd, hour)
        ranked.append((sc, p, est, hour))
    if not ranked:
        raise NoFeasiblePlanError(
            f"{label}: no grid point fits in memory and meets the constraints"
        )
    ranked.sort(key=lambda x: -x[0])
    ub = grid.upper_bound
    return [
        RankedPlan(
            rank=i + 1,
            plan=p.model_copy(update={"plan_id": f"{label}-{i + 1}"}),
            estimate=est,
            cost_per_hour_usd=hour,
            upper_bound_fraction=est.throughput_iter_s / ub if ub > 0 else 0.0,
        )
        for i, (_, p, est, hour) in enumerate(ranked[:top_k])
    ]
