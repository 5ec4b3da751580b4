"""Gantt chart of a simulated 1F1B timeline (one row per stage of every pipeline).

The edge of the simulator that writes a file: it imports matplotlib lazily (headless Agg
backend) so the pure core never pulls it in, and it takes the output path from its caller.
"""

from __future__ import annotations

from pathlib import Path

from sailor.simulator.simulate import Timeline

__all__ = ["plot_timeline"]

_FWD_COLOR = "#4c72b0"
_BWD_COLOR = "#dd8452"


def plot_timeline(timeline: Timeline, path: str | Path, *, title: str = "") -> Path:
    """Draw every forward (blue) and backward (orange) of every stage; write ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted({(op.pipeline, op.stage) for op in timeline.ops})
    index = {r: i for i, r in enumerate(rows)}
    fig, ax = plt.subplots(figsize=(12, 0.4 * len(rows) + 1.5))
    # one bar collection per row and kind: matplotlib re-fits the view to every collection
    # on each addition, so one call per op was quadratic (6,144 ops: ~20 s)
    bars: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for op in timeline.ops:
        y = index[(op.pipeline, op.stage)]
        bars.setdefault((y, op.kind), []).append((op.start_s, op.end_s - op.start_s))
    for (y, kind), spans in bars.items():
        ax.broken_barh(
            spans,
            (y - 0.4, 0.8),
            facecolors=_FWD_COLOR if kind == "F" else _BWD_COLOR,
            edgecolor="white",
            linewidth=0.3,
        )
    if len(timeline.ops) <= 400:
        for op in timeline.ops:
            ax.text(
                (op.start_s + op.end_s) / 2,
                index[(op.pipeline, op.stage)],
                str(op.microbatch),
                ha="center",
                va="center",
                fontsize=6,
                color="white",
            )
    ax.axvline(timeline.iteration_time_s, color="black", linestyle="--", linewidth=0.8)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"p{p} s{s}" for p, s in rows])
    ax.invert_yaxis()
    ax.set_xlabel("time (s); dashed: end of iteration (after gradient sync and step)")
    ax.set_title(title or "1F1B schedule (blue: forward, orange: backward)")
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)  # as `sailor plan --pareto` does
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
