"""State that moves between two plans: which layers a new plan needs where the old had none.

Nodes are not named in a plan, so state is counted per resource (GPU type, zone): a layer
held by ``k`` replica groups of a resource in the old plan and ``k' > k`` in the new one needs
``k' - k`` copies sent over the network (loaded from a checkpoint or a peer). Fewer moved
layer replicas means a faster reconfiguration.
"""

from __future__ import annotations

from sailor.schemas import Pipeline, Plan

__all__ = ["moved_layers"]


def _holders(plan: Plan) -> dict[tuple[str, str, int], int]:
    # a planner's plan repeats one Pipeline object per template: count each distinct once
    count: dict[int, int] = {}
    distinct: list[Pipeline] = []
    for p in plan.pipelines:
        if id(p) not in count:
            count[id(p)] = 0
            distinct.append(p)
        count[id(p)] += 1
    out: dict[tuple[str, str, int], int] = {}
    for p in distinct:
        c = count[id(p)]
        for s in p.stages:
            r = s.replica
            for layer in s.layers:
                k = (r.gpu_type, r.zone, layer)
                out[k] = out.get(k, 0) + c
    return out


def moved_layers(old: Plan | None, new: Plan) -> tuple[tuple[int, ...], int]:
    """(layers that would move, number of layer replicas to move) from ``old`` to ``new``."""
    if old is None:
        return (), 0
    before, after = _holders(old), _holders(new)
    layers: set[int] = set()
    replicas = 0
    for (g, z, layer), n in after.items():
        extra = n - before.get((g, z, layer), 0)
        if extra > 0:
            layers.add(layer)
            replicas += extra
    return tuple(sorted(layers)), replicas
