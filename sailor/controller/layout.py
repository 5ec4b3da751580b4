"""A plan's layout as the audit log records it: who runs which layers, at which TP degree.

One entry per pipeline: its stages (layer range, kind, TP degree, nodes) and its microbatch
arrangement, so an operator (and ``sailor demo``'s summary) reads from the log which layout
each generation ran, on which kinds of node, without the plan file. Pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sailor.schemas.plan import Plan

__all__ = ["describe_layout", "layout_of"]


def layout_of(plan: Plan, placement: Mapping[str, tuple[int, ...]]) -> list[dict[str, Any]]:
    """Per pipeline: ``{"stages": [{"layers": [a, b], "kind", "tp", "nodes"}], "mbs", "mb"}``."""
    node_of = {r: n for n, ranks in placement.items() for r in ranks}
    out: list[dict[str, Any]] = []
    rank = 0
    for p in plan.pipelines:
        stages = []
        for st in p.stages:
            tp = st.replica.tp
            nodes = sorted({node_of.get(r, "?") for r in range(rank, rank + tp)})
            rank += tp
            stages.append(
                {
                    "layers": [st.first_layer, st.last_layer],
                    "kind": st.replica.gpu_type,
                    "tp": tp,
                    "nodes": nodes,
                }
            )
        out.append({"stages": stages, "mbs": p.microbatch_size, "mb": p.num_microbatches})
    return out


def describe_layout(layout: list[dict[str, Any]]) -> str:
    """``cpu-full 0-3 tp1 | cpu-slow 4-5 tp1 (1×4)  +  cpu-full 0-5 tp1 (2×2)``."""
    pipes = []
    for p in layout:
        st = " | ".join(
            f"{s['kind']} {s['layers'][0]}-{s['layers'][1]}"
            + (f" tp{s['tp']}" if s["tp"] > 1 else "")
            for s in p["stages"]
        )
        pipes.append(f"{st} ({p['mbs']}×{p['mb']})")
    return "  +  ".join(pipes)
