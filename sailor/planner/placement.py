"""Whether a plan's replica groups fit the pool's nodes, one group inside one node.

The search counts a resource's GPUs, not its nodes: on nodes whose GPU count a TP degree does
not divide (TP 2 on nodes of 3 GPUs, TP 4 on nodes of 5 or 6) GPUs that count toward the
resource can hold no group of that degree, and a plan that adds up can still be one the
controller cannot place (4 nodes of 3 GPUs hold 4 TP-2 groups, not the 6 their 12 GPUs
count for). :func:`unplaceable` binds the groups as the controller does
(``controller.planning.api.place``: in rank order, each to the first node with ``tp`` free
GPUs of its GPU type, zone and node shape, else of its GPU type and zone) and says which
group finds no node. Pure; never places anything.
"""

from __future__ import annotations

from itertools import islice

from sailor.schemas import Plan, Pool

__all__ = ["unplaceable"]


def unplaceable(plan: Plan, pool: Pool) -> str | None:
    """Why the controller could not bind every replica group of ``plan`` to a node of
    ``pool``, or None if it could.

    Nodes of one shape are alike; the fallback to another shape of the GPU type and zone
    takes them in the pool's order (the controller's are in node-id order: a group that
    does not fit its own shape's nodes may be judged differently there)."""
    free: list[int] = []
    shaped: dict[tuple[str, str, int], list[int]] = {}
    grouped: dict[tuple[str, str], list[int]] = {}
    for e in pool.entries:
        for _ in range(e.nodes):
            shaped.setdefault((e.gpu_type, e.zone, e.gpus_per_node), []).append(len(free))
            grouped.setdefault((e.gpu_type, e.zone), []).append(len(free))
            free.append(e.gpus_per_node)
    cursor: dict[object, int] = {}

    def first_fit(key: object, ids: list[int], tp: int) -> int | None:
        lo = cursor.get(key, 0)
        while lo < len(ids) and free[ids[lo]] == 0:
            lo += 1
        cursor[key] = lo
        return next((i for i in islice(ids, lo, None) if free[i] >= tp), None)

    for pi, p in enumerate(plan.pipelines):
        for si, s in enumerate(p.stages):
            r = s.replica
            shape = (r.gpu_type, r.zone, r.gpus_per_node)
            at = first_fit(shape, shaped.get(shape, []), r.tp)
            if at is None:
                group = (r.gpu_type, r.zone)
                at = first_fit(group, grouped.get(group, []), r.tp)
            if at is None:
                ids = grouped.get((r.gpu_type, r.zone), [])
                sizes = "/".join(str(n) for n in sorted({free[i] for i in ids})) or "0"
                return (
                    f"pipelines[{pi}].stages[{si}]: no node with {r.tp} free {r.gpu_type} GPUs "
                    f"in {r.zone} ({len(ids)} node(s), {sizes} GPUs left on them after the "
                    "groups before it)"
                )
            free[at] -= r.tp
    return None
