"""The planner: which GPUs to use and how to parallelize a model on them.

``plan(model, profiles, pool, network, prices, objective, constraints) -> list[RankedPlan]``,
best first; :func:`search` returns the same with the reason when nothing is feasible, the
candidates it kept and the tables a :func:`replan` warm-starts from. Pure: no I/O, no clock,
no torch (docs/planner.md).
"""

from sailor.planner.api import (
    Constraints,
    NoFeasiblePlanError,
    Objective,
    PlannerError,
    PlannerInputError,
    RankedPlan,
    SearchStats,
)
from sailor.planner.judge import Candidate, SearchResult
from sailor.planner.moves import moved_layers
from sailor.planner.replan import replan
from sailor.planner.search import plan, search
from sailor.planner.upper_bound import throughput_upper_bound

__all__ = [
    "Candidate",
    "Constraints",
    "NoFeasiblePlanError",
    "Objective",
    "PlannerError",
    "PlannerInputError",
    "RankedPlan",
    "SearchResult",
    "SearchStats",
    "moved_layers",
    "plan",
    "replan",
    "search",
    "throughput_upper_bound",
]
