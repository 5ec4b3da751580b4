"""The demo's layout table: each generation's layout, per kind, predicted beside measured.

Every launch record in the audit log names its layout (``controller.layout``: per pipeline
its stages' layer ranges, kinds, TP degrees and nodes, and its microbatch size and count)
and the simulator's predicted iteration time. :func:`layouts` pairs each with the step time
its ranks measured; :func:`layout_shape` says what the layout gives each kind (layers per
stage and TP degrees, samples per pipeline) and whether the kinds' shares are uneven, which
is what a heterogeneous plan looks like. Pure, except :func:`print_layouts`, which draws.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from sailor.cli.demo.observe import StepPoint
from sailor.cli.tables import print_table
from sailor.controller.layout import describe_layout

__all__ = ["describe_kinds", "layout_shape", "layouts", "print_layouts"]


def layout_shape(layout: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """What each kind gets in ``layout``: per kind its stages' layer counts, TP degrees and
    nodes; per pipeline its stages' kinds and layer counts, its microbatch size and count
    and its samples; ``uneven`` when stages of a pipeline hold different numbers of layers,
    pipelines take different numbers of samples or TP degrees differ (the layout is not a
    homogeneous one's)."""
    kinds: dict[str, dict[str, list[Any]]] = {}
    pipes: list[dict[str, Any]] = []
    for p in layout:
        counts = []
        for st in p["stages"]:
            n = int(st["layers"][1]) - int(st["layers"][0]) + 1
            counts.append(n)
            k = kinds.setdefault(st["kind"], {"layers": [], "tp": [], "nodes": []})
            k["layers"].append(n)
            k["tp"].append(int(st["tp"]))
            k["nodes"].extend(x for x in st["nodes"] if x not in k["nodes"])
        pipes.append(
            {
                "kinds": [st["kind"] for st in p["stages"]],
                "layers": counts,
                "mbs": int(p["mbs"]),
                "microbatches": int(p["mb"]),
                "samples": int(p["mbs"]) * int(p["mb"]),
            }
        )
    tps = {t for k in kinds.values() for t in k["tp"]}
    uneven = (
        any(len(set(p["layers"])) > 1 for p in pipes)
        or len({p["samples"] for p in pipes}) > 1
        or len(tps) > 1
    )
    return {
        "kinds": {k: {**v, "tp": sorted(set(v["tp"]))} for k, v in sorted(kinds.items())},
        "pipelines": pipes,
        "uneven": uneven,
    }


def describe_kinds(shape: dict[str, Any], sep: str = " · ") -> str:
    """``cpu-full 5+6 tp1 (n1,n3) · cpu-slow 1 tp1 (n2)``: per kind, the layers of each of
    its stages, its TP degrees and its nodes."""
    parts = []
    for kind, k in shape["kinds"].items():
        tp = "/".join(f"tp{t}" for t in k["tp"])
        parts.append(f"{kind} {'+'.join(map(str, k['layers']))} {tp} ({','.join(k['nodes'])})")
    return sep.join(parts)


def layouts(
    records: Sequence[dict[str, Any]], points: Sequence[StepPoint], skip: int = 3
) -> list[dict[str, Any]]:
    """Per generation: the layout its launch record names, its shape (:func:`layout_shape`),
    the simulator's predicted step and the measured one: the mean time between consecutive
    steps of that generation, its first ``skip`` steps left out (start-up, first-touch
    allocation, a quota applied at ``ready``). The mean, not the median: under a CPU quota
    a worker runs at full speed until the period's quota is spent, then stalls to the
    period's end (100 ms), so most steps take the unthrottled time and a few the stall;
    only the mean is the rate the quota allows."""
    out = []
    for r in records:
        if r.get("kind") != "phase" or r.get("phase") != "launch" or "layout" not in r:
            continue
        gen = int(r["generation"])
        times = sorted(p.time for p in points if p.generation == gen)[skip:]
        measured = (times[-1] - times[0]) / (len(times) - 1) if len(times) >= 2 else None
        predicted = r.get("predicted_step_s")
        error = predicted / measured - 1.0 if predicted is not None and measured else None
        out.append(
            {
                "generation": gen,
                "layout": r["layout"],
                "shape": layout_shape(r["layout"]),
                "predicted_step_s": predicted,
                "measured_step_s": measured,
                "prediction_error": error,
                "steps": len(times) + min(skip, len(times)),
            }
        )
    return out


def print_layouts(con: Console, rows: Sequence[dict[str, Any]]) -> None:
    """The layout table of the summary."""
    t = Table(
        "gen",
        "per kind: layers per stage, TP (nodes)",
        escape("per pipeline: kind layers [tp] per stage (mbs×microbatches)"),
        "predicted s/step",
        "measured s/step",
        "error",
        title="layouts: the simulator's step (the kinds' prior) beside the measured mean",
    )
    for g in rows:
        pr, me, err = g["predicted_step_s"], g["measured_step_s"], g.get("prediction_error")
        shape = g.get("shape") or layout_shape(g["layout"])
        t.add_row(
            str(g["generation"]),
            escape(describe_kinds(shape, "\n")),
            escape(describe_layout(g["layout"]).replace("  +  ", "\n")),
            f"{pr:.3f}" if pr is not None else "—",
            f"{me:.3f}" if me is not None else "—",
            f"{err:+.0%}" if err is not None else "—",
        )
    print_table(con, t)
