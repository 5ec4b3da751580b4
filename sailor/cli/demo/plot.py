"""The demo's PNG: loss and throughput over time, the reconfigurations marked.

Loss per step (coloured by generation: a layout) and samples/s from the step times of each
generation (global batch / time between consecutive steps, so the workers' pacing and the
pipeline's bubbles are included), against seconds since the start; each injected change is a
vertical line, named above the plot, and the span until the new layout ran is shaded. Beside
them, loss per step of the cluster and of the uninterrupted run. matplotlib (Agg) only.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path

from sailor.cli.demo.observe import StepPoint
from sailor.cli.demo.reconfig import Reconfiguration

__all__ = ["plot_run", "throughput_series"]


def throughput_series(
    points: Sequence[StepPoint], global_batch_size: int
) -> list[tuple[float, float, int]]:
    """``(time, samples/s, generation)`` between consecutive steps of one generation."""
    out: list[tuple[float, float, int]] = []
    by_gen: dict[int, list[StepPoint]] = {}
    for p in points:
        by_gen.setdefault(p.generation, []).append(p)
    for gen, ps in by_gen.items():
        ps.sort(key=lambda p: p.step)
        for a, b in itertools.pairwise(ps):
            dt = b.time - a.time
            if b.step == a.step + 1 and dt > 0:
                out.append((b.time, global_batch_size / dt, gen))
    return sorted(out)


def plot_run(
    points: Sequence[StepPoint],
    reconfs: Sequence[Reconfiguration],
    global_batch_size: int,
    t0: float,
    path: Path,
    reference: Sequence[float] = (),
) -> Path:
    """Left: loss and samples/s over time, the changes marked and named above the plot (never
    over the curves). Right: loss per step, the cluster's beside the uninterrupted run's
    (``reference[step - 1]``), the comparison the demo is about."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(13, 6.5))
    grid = fig.add_gridspec(2, 2, width_ratios=(3, 2), hspace=0.08, wspace=0.18)
    ax1 = fig.add_subplot(grid[0, 0])
    ax2 = fig.add_subplot(grid[1, 0], sharex=ax1)
    ax3 = fig.add_subplot(grid[:, 1])
    gens = sorted({p.generation for p in points})
    cmap = plt.get_cmap("tab10")
    for i, g in enumerate(gens):
        ps = sorted((p for p in points if p.generation == g), key=lambda p: p.time)
        color = cmap(i % 10)
        ax1.plot([p.time - t0 for p in ps], [p.loss for p in ps], ".-", color=color, ms=3)
        ax3.plot(
            [p.step for p in ps],
            [p.loss for p in ps],
            ".",
            color=color,
            ms=3,
            label=f"generation {g}",
        )
    if reference:
        ax3.plot(
            range(1, len(reference) + 1),
            reference,
            "-",
            color="0.2",
            lw=2.5,
            alpha=0.45,
            label="uninterrupted run",
            zorder=0,
        )
    thr = throughput_series(points, global_batch_size)
    for i, g in enumerate(gens):
        xs = [(t - t0, v) for t, v, gg in thr if gg == g]
        if xs:
            ax2.plot([x for x, _ in xs], [v for _, v in xs], ".-", color=cmap(i % 10), ms=3)
    for k, r in enumerate(reconfs):
        for ax in (ax1, ax2):
            ax.axvline(r.injected_at - t0, color="red", lw=1, ls="--")
            if r.running_at is not None:
                ax.axvspan(r.injected_at - t0, r.running_at - t0, color="red", alpha=0.08)
        # above the plot, two staggered rows, text starting at the line: never on a curve,
        # never clipped at the left edge (the "start" line is at ~0 s)
        ax1.annotate(
            r.cause,
            (r.injected_at - t0, 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(2, 3 + 11 * (k % 2)),
            textcoords="offset points",
            ha="left",
            va="bottom",
            fontsize=8,
            color="red",
            annotation_clip=False,
        )
    ax1.set_ylabel("loss")
    ax1.tick_params(labelbottom=False)
    ax2.set_ylabel("samples/s")
    ax2.ticklabel_format(axis="y", useOffset=False)
    ax2.set_xlabel("seconds since start (dashed: a change; shaded: until the new layout runs)")
    ax3.set_xlabel("step")
    ax3.set_ylabel("loss")
    ax3.set_title("loss per step: the cluster beside an uninterrupted run", fontsize=10)
    ax3.legend(fontsize=7, loc="upper right", framealpha=0.9)
    fig.suptitle("sailor demo: a tiny GPT-2 on a one-machine cluster of agents", y=0.99)
    fig.subplots_adjust(left=0.06, right=0.98, top=0.86, bottom=0.09)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
