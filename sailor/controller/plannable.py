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
takes any node, and has none. It is read once, when the controller starts: a node refused
for the controller's profiles or prices is admitted after they are fixed and the controller
restarted; one refused for its own shape, once its agent's node section is fixed and that
agent restarted (a node left out runs nothing, so restarting its agent disturbs no job).

A node of the job's layout (``DesiredState.placement``) is not judged, as
``runtime_admission`` never leaves one out: after a controller restart with other prices or
profiles, a node the running layout trains on stays in the membership (dropping it said
"nothing runs there", and a later restart with the old reach counted it as newly joined: a
quiesce, a checkpoint and a relaunch for nothing). The planner decides at the next replan:
it leaves the node out of the pool it searches and says so in the plan's reason
(``SailorPlanner.plan``); once out of the layout, the node is judged here like any other.

Pure: no I/O, no clock; inputs never modified. Called by ``decide.not_admitted``.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from sailor.planner.reach import PlannerReach
from sailor.schemas.hardware import NodeSpec

__all__ = ["unplannable"]


def unplannable(
    nodes: Mapping[str, NodeSpec],
    candidates: Collection[str],
    reach: PlannerReach | None,
    placement: Collection[str] = (),
) -> dict[str, str]:
    """The ``candidates`` the planner of ``reach`` cannot use, each with the reason (for the
    audit log and ``sailor status``); empty when ``reach`` is None (any node goes). Nodes of
    ``placement`` (the job's layout) are not judged."""
    if reach is None:
        return {}
    out: dict[str, str] = {}
    judged: dict[tuple[str, str, int, bool], str] = {}  # a pool holds few shapes
    for n in sorted(candidates):
        spec = nodes.get(n)
        if spec is None or n in placement:
            continue
        shape = (spec.gpu_type, spec.zone, spec.gpus, spec.spot)
        why = judged.get(shape)
        if why is None:
            why = judged[shape] = reach.why_not(*shape)
        if why:
            out[n] = (
                f"the planner cannot use it: {why}; fix its agent's node section (`sailor "
                "config check AGENT.yaml --controller CONTROLLER.yaml` checks it) and restart "
                "that agent, or the controller's profiles and prices and restart the "
                "controller (it reads them once, at its start)"
            )
    return out
