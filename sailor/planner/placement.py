"""Whether a plan's replica groups fit the pool's nodes, one group inside one node.

The search counts a resource's GPUs, not its nodes: on nodes whose GPU count a TP degree does
not divide (TP 2 on nodes of 3 GPUs, TP 4 on nodes of 5 or 6) GPUs that count toward the
resource can hold no group of that degree, and a plan that adds up can still be one the
controller cannot place (4 nodes of 3 GPUs hold 4 TP-2 groups, not the 6 their 12 GPUs
count for). :func:`unplaceable` binds the groups as the controller does
(``controller.planning.api.place``: in rank order, each to the first node of its GPU type
and zone with ``tp`` free GPUs) and says which group finds no node. Pure; never places
anything.
"""

from __future__ import annotations

from sailor.schemas import Plan, Pool

__all__ = ["unplaceable"]


def unplaceable(plan: Plan, pool: Pool) -> str | None:
    """Why the controller could not bind every replica group of ``plan`` to a node of
    ``pool``, or None if it could.

    Nodes of one GPU type and zone are taken in the pool's order (the controller's are in
    node-id order: the same answer when they all have one shape)."""
    free: dict[tuple[str, str], list[int]] = {}
    for e in pool.entries:
        free.setdefault((e.gpu_type, e.zone), []).extend([e.gpus_per_node] * e.nodes)
    cursor = dict.fromkeys(free, 0)
    for pi, p in enumerate(plan.pipelines):
        for si, s in enumerate(p.stages):
            r = s.replica
            key = (r.gpu_type, r.zone)
            nodes = free.get(key, [])
            lo = cursor.get(key, 0)
            while lo < len(nodes) and nodes[lo] == 0:
                lo += 1
            cursor[key] = lo
            at = next((i for i in range(lo, len(nodes)) if nodes[i] >= r.tp), None)
            if at is None:
                sizes = sorted(set(nodes)) or [0]
                return (
                    f"pipelines[{pi}].stages[{si}]: no node with {r.tp} free {r.gpu_type} GPUs "
                    f"in {r.zone} (its {len(nodes)} node(s) of {'/'.join(map(str, sizes))} "
                    "GPUs are taken by the groups before it)"
                )
            nodes[at] -= r.tp
    return None
