"""The planner's inputs and outputs: objective, constraints, ranked plans, search results.

Pure values: frozen dataclasses and pydantic schemas. Nothing here searches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from sailor.schemas import Estimate, Plan

__all__ = [
    "OBJECTIVES",
    "Constraints",
    "NoFeasiblePlanError",
    "Objective",
    "PlannerError",
    "PlannerInputError",
    "RankedPlan",
    "SearchStats",
]

Objective = Literal["throughput", "cost", "throughput_per_cost"]
"""``throughput``: max iterations/s. ``cost``: min $ per iteration. ``throughput_per_cost``:
max iterations/s per $/hour of GPUs rented (it differs from ``cost`` only by egress, which
it leaves out: a rented GPU is paid for whether its traffic crosses a zone or not)."""

OBJECTIVES: tuple[Objective, ...] = ("throughput", "cost", "throughput_per_cost")


class PlannerError(Exception):
    """Base of the planner's errors. Not retryable: the inputs must change."""


class PlannerInputError(PlannerError, ValueError):
    """The inputs are inconsistent (unknown GPU type, empty pool, contradictory constraints)."""


class NoFeasiblePlanError(PlannerError):
    """The search ran and nothing met memory and the constraints; ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class Constraints:
    """Hard limits every returned plan meets. ``None`` means no limit."""

    max_cost_per_iter_usd: float | None = None
    max_cost_per_hour_usd: float | None = None
    min_throughput_iter_s: float | None = None
    max_gpus_per_type: tuple[tuple[str, int], ...] = ()
    allowed_zones: tuple[str, ...] | None = None
    allowed_regions: tuple[str, ...] | None = None
    one_microbatch_size: bool = False
    """Every pipeline uses the same microbatch size (what the original's plan format holds)."""

    def __post_init__(self) -> None:
        for name in ("max_cost_per_iter_usd", "max_cost_per_hour_usd", "min_throughput_iter_s"):
            v = getattr(self, name)
            if v is not None and (not math.isfinite(v) or v <= 0):
                raise PlannerInputError(f"{name}={v!r}: must be a positive finite number")
        for g, n in self.max_gpus_per_type:
            if n < 0:
                raise PlannerInputError(f"max_gpus_per_type[{g!r}]={n}: must be >= 0")
        if self.allowed_zones is not None and not self.allowed_zones:
            raise PlannerInputError("allowed_zones=(): no zone allowed, nothing can be planned")
        if self.allowed_regions is not None and not self.allowed_regions:
            raise PlannerInputError("allowed_regions=(): no region allowed")

    def gpu_cap(self, gpu_type: str) -> int | None:
        for g, n in self.max_gpus_per_type:
            if g == gpu_type:
                return n
        return None

    def violations(self, est: Estimate, cost_per_hour: float) -> list[str]:
        """Why an estimate breaks these constraints (empty if it meets them)."""
        out = self.limit_violations(est.throughput_iter_s, est.cost_per_iter_usd, cost_per_hour)
        by_type: dict[str, int] = {}
        for k, n in est.gpus_by_type_zone.items():
            g, _, _z = k.partition("@")
            by_type[g] = by_type.get(g, 0) + n
        for g, n in by_type.items():
            cap = self.gpu_cap(g)
            if cap is not None and n > cap:
                out.append(f"{g}: {n} GPUs > max {cap}")
        return out

    def limit_violations(
        self, throughput_iter_s: float, cost_per_iter_usd: float, cost_per_hour: float
    ) -> list[str]:
        """Which of the budget and throughput limits these figures break (not the GPU caps)."""
        out: list[str] = []
        if self.max_cost_per_iter_usd is not None and cost_per_iter_usd > (
            self.max_cost_per_iter_usd * (1 + 1e-9)
        ):
            out.append(f"cost_per_iter={cost_per_iter_usd:.4g} > {self.max_cost_per_iter_usd:.4g}")
        if self.max_cost_per_hour_usd is not None and cost_per_hour > (
            self.max_cost_per_hour_usd * (1 + 1e-9)
        ):
            out.append(f"cost_per_hour={cost_per_hour:.4g} > {self.max_cost_per_hour_usd:.4g}")
        if self.min_throughput_iter_s is not None and throughput_iter_s < (
            self.min_throughput_iter_s * (1 - 1e-9)
        ):
            out.append(f"throughput={throughput_iter_s:.4g} < {self.min_throughput_iter_s:.4g}")
        return out


@dataclass(frozen=True)
class RankedPlan:
    """One feasible plan with the simulator's figures for it."""

    rank: int
    plan: Plan
    estimate: Estimate
    cost_per_hour_usd: float
    upper_bound_fraction: float
    moved_layers: tuple[int, ...] = ()
    moved_layer_replicas: int = 0
    explain: tuple[str, ...] = ()

    @property
    def throughput_iter_s(self) -> float:
        return self.estimate.throughput_iter_s

    @property
    def cost_per_iter_usd(self) -> float:
        return self.estimate.cost_per_iter_usd

    def to_json(self) -> dict[str, Any]:
        e = self.estimate
        return {
            "rank": self.rank,
            "throughput_iter_s": e.throughput_iter_s,
            "iteration_time_s": e.iteration_time_s,
            "cost_per_iter_usd": e.cost_per_iter_usd,
            "cost_per_hour_usd": self.cost_per_hour_usd,
            "peak_memory_bytes": e.peak_memory_bytes,
            "gpus_by_type_zone": e.gpus_by_type_zone,
            "uses_estimates": e.uses_estimates,
            "upper_bound_fraction": self.upper_bound_fraction,
            "moved_layers": list(self.moved_layers),
            "moved_layer_replicas": self.moved_layer_replicas,
            "explain": list(self.explain),
            "plan": self.plan.model_dump(mode="json"),
        }


@dataclass(frozen=True)
class SearchStats:
    """What the search looked at."""

    templates: int = 0
    allocations: int = 0
    simulated: int = 0
    pruned_memory: int = 0
    pruned_bound: int = 0
    notes: tuple[str, ...] = field(default=())
