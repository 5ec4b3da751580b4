"""Shared by the baselines: uniform partitions and judging grid points with the simulator."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from sailor.planner.api import Constraints, NoFeasiblePlanError, Objective, RankedPlan
from sailor.planner.judge import objective_score
from sailor.planner.tables import CostTables
from sailor.schemas import Estimate, Plan
from sailor.simulator import ProfileLookupError, simulate

__all__ = [
    "judge",
    "per_hour",
    "uniform_cuts",
]


def uniform_cuts(n_layers: int, depth: int) -> tuple[int, ...]:
    """Last layer of each stage of an even split; extra layers go to the last stages."""
    base, extra = divmod(n_layers, depth)
    out: list[int] = []
    end = -1
    for s in range(depth):
        end += base + (1 if s >= depth - extra else 0)
        out.append(end)
    return tuple(out)


def judge(
    tables: CostTables,
    plans: Sequence[tuple[float, Plan, float]],
    objective: Objective,
    constraints: Constraints,
    top_k: int,
    ub: float,
    label: str,
) -> list[RankedPlan]:
    """Simulate the grid points in order of their prefilter score; keep the feasible best."""
    inp = tables.inputs
    ranked: list[tuple[float, Plan, Estimate, float]] = []
    for _, plan, per_hour in plans:
        p = plan.with_precision(inp.gpu_specs, inp.model.precision)
        try:
            est = simulate(
                p,
                inp.model,
                inp.profiles,
                inp.network,
                inp.prices,
                calibration=inp.calibration,
                gpu_specs=inp.gpu_specs,
                spot=bool(inp.spot),
            )
        except (ProfileLookupError, KeyError, ValueError):
            continue
        if not est.fits_in_memory or constraints.violations(est, per_hour):
            continue
        sc = objective_score(objective, est.throughput_iter_s, est.cost_per_iter_usd, per_hour)
        ranked.append((sc, p, est, per_hour))
    if not ranked:
        raise NoFeasiblePlanError(
            f"{label}: no grid point fits in memory and meets the constraints"
        )
    ranked.sort(key=lambda x: -x[0])
    return [
        RankedPlan(
            rank=i + 1,
            plan=p.model_copy(update={"plan_id": f"{label}-{i + 1}"}),
            estimate=est,
            cost_per_hour_usd=per_hour,
            upper_bound_fraction=est.throughput_iter_s / ub if ub > 0 else 0.0,
        )
        for i, (_, p, est, per_hour) in enumerate(ranked[:top_k])
    ]


def per_hour(tables: CostTables, gpus: Mapping[tuple[str, str], int]) -> float:
    return sum(tables.price_per_s(g, z) * 3600 * n for (g, z), n in gpus.items())
