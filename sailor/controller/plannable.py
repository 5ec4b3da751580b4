"""Admission by what the planner can use: which registered nodes no plan may hold because
the controller's planner has no figure for them.

Any agent may register a node, and the planner refuses a pool with a node it cannot use as
a whole (``sailor.planner.reach``): a GPU type with neither a spec in the catalog nor a
profile, one without a price (or at $0/h when cost is ranked), more GPUs on one node than
the planner's bound. Given to the planner, one such node made every replan fail, so no
layout was made for any node while it stayed registered (a running job could not replan
after a failure). The controller leaves such a node out instead, with the reason, as it
does a node of another runtime (``controller/runtime_admission.py``): the audit log says
so once, ``sailor status`` shows it, and the other nodes are planned as if it were absent.

The reach comes from the controller's planner (``DecideConfig.planner_reach``: the sailor
planner's, built from the controller config's profiles and prices); the stand-in planner
takes any node, and has none.

Pure: no I/O, no clock; inputs never modified. Called by ``decide.not_admitted``.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from sailor.planner.reach import PlannerReach
from sailor.schemas.hardware import NodeSpec

__all__ = ["unplannable"]


def unplannable(
    nodes: Mapping[str, NodeSpec], candidates: Collection[str], reach: PlannerReach | None
) -> dict[str, str]:
    """The ``candidates`` the planner of ``reach`` cannot use, each with the reason (for the
    audit log and ``sailor status``); empty when ``reach`` is None (any node goes)."""
    if reach is None:
        return {}
    out: dict[str, str] = {}
    for n in sorted(candidates):
        spec = nodes.get(n)
        if spec is None:
            continue
        why = reach.why_not(spec.gpu_type, spec.zone, spec.gpus, spec.spot)
        if why:
            out[n] = (
                f"the planner cannot use it: {why}; fix its agent's node section (`sailor "
                "config check AGENT.yaml --controller CONTROLLER.yaml` checks it) or the "
                "controller's profiles and prices, then restart that agent"
            )
    return out
