"""The demo's PNG: loss and throughput over time, the reconfigurations marked.

Loss per step (coloured by generation: a layout) and samples/s from the step times of each
generation (global batch / time between consecutive steps, so the workers' pacing and the
pipeline's bubbles are included), against seconds since the start; each injected change is a
vertical line, and the span until the new layout ran is shaded. matplotlib (Agg) only.
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
) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    gens = sorted({p.generation for p in points})
    cmap = plt.get_cmap("tab10")
    for i, g in enumerate(gens):
        ps = sorted((p for p in points if p.generation == g), key=lambda p: p.time)
        ax1.plot(
            [p.time - t0 for p in ps],
            [p.loss for p in ps],
            ".-",
            color=cmap(i % 10),
            label=f"generation {g}",
        )
    thr = throughput_series(points, global_batch_size)
    for i, g in enumerate(gens):
        xs = [(t - t0, v) for t, v, gg in thr if gg == g]
        if xs:
            ax2.plot([x for x, _ in xs], [v for _, v in xs], ".-", color=cmap(i % 10))
    for r in reconfs:
        for ax in (ax1, ax2):
            ax.axvline(r.injected_at - t0, color="red", lw=1, ls="--")
            if r.running_at is not None:
                ax.axvspan(r.injected_at - t0, r.running_at - t0, color="red", alpha=0.08)
        ax1.annotate(
            r.cause,
            (r.injected_at - t0, 1.0),
            xycoords=("data", "axes fraction"),
            rotation=90,
            va="top",
            ha="right",
            fontsize=8,
            color="red",
        )
    ax1.set_ylabel("loss")
    ax1.legend(fontsize=7, loc="upper right")
    ax2.set_ylabel("samples/s")
    ax2.set_xlabel("seconds since start (shaded: change → new layout running)")
    ax1.set_title("sailor demo: a tiny GPT-2 on a one-machine cluster of agents")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
