"""How the controller gets a placed plan: the one place to look.

- :mod:`~sailor.controller.planning.api`: the ``Planner`` interface the executor calls on every
  membership change (``plan(nodes, previous) -> PlanResult``), ``place`` (pure: binds a plan's
  replica groups to concrete nodes) and ``DataParallelPlanner``, a stand-in that needs no
  profiles;
- :mod:`~sailor.controller.planning.in_process`: ``SailorPlanner``, the default, backed by
  ``sailor.planner`` (a full search for the first layout, ``replan`` after), and
  ``planner_from_config``, which builds it from the controller config;
- :mod:`~sailor.controller.planning.process`: ``ProcessPlanner``, the same planner kept warm in
  a separate process so that a replan does not share the controller loop's GIL
  (``planner_process: true``).

Never imports torch or the agent, and talks to no coordination backend: planning is a
computation the controller runs in a thread or a process, on the inputs it is handed.
"""

from sailor.controller.planning.api import (
    DataParallelPlanner,
    PlacementError,
    Planner,
    PlanResult,
    place,
)
from sailor.controller.planning.in_process import (
    SailorPlanner,
    load_model_spec,
    planner_from_config,
    pool_of,
)
from sailor.controller.planning.process import ProcessPlanner, StaleWorkerStateError

__all__ = [
    "DataParallelPlanner",
    "PlacementError",
    "PlanResult",
    "Planner",
    "ProcessPlanner",
    "SailorPlanner",
    "StaleWorkerStateError",
    "load_model_spec",
    "place",
    "planner_from_config",
    "pool_of",
]
