"""The demo's PNG: change labels sit above the plot, inside the figure, and the uninterrupted
run's loss is drawn beside the cluster's."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from sailor.cli.demo.observe import StepPoint
from sailor.cli.demo.plot import plot_run
from sailor.cli.demo.reconfig import Reconfiguration


def _run() -> tuple[list[StepPoint], list[Reconfiguration], list[float]]:
    ref = [4.0 * math.exp(-s / 50) + 0.3 for s in range(1, 91)]
    points, t = [], 10.0
    for gen, first, last in ((0, 1, 30), (1, 31, 55), (2, 31, 90)):
        t += 4.0
        for s in range(first, last + 1):
            points.append(StepPoint(gen, s, ref[s - 1], 70.0 + s % 7, t))
            t += 0.1
    reconfs = [
        Reconfiguration("start", "n1,n2,n3", 0.0, 10.0, 0, -1),
        Reconfiguration("preemption notice", "n1", 17.0, 21.0, 1, 30),
        Reconfiguration("node lost", "n2", 23.5, 27.0, 2, 30),
    ]
    return points, reconfs, ref


def test_labels_above_the_curves_and_reference_beside(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figs: list[Any] = []
    monkeypatch.setattr(plt, "close", figs.append)  # keep the figure to measure it
    points, reconfs, ref = _run()
    png = plot_run(points, reconfs, 4, 0.0, tmp_path / "demo-cluster.png", reference=ref)
    assert png.stat().st_size > 10_000
    fig = figs[0]
    renderer = fig.canvas.get_renderer()
    page = fig.bbox
    loss_ax = fig.axes[0]
    labels = [t for t in loss_ax.texts if t.get_text() in {r.cause for r in reconfs}]
    assert len(labels) == len(reconfs)
    boxes = [t.get_window_extent(renderer) for t in labels]
    for text, box in zip(labels, boxes, strict=True):
        assert page.x0 <= box.x0 and box.x1 <= page.x1 and box.y1 <= page.y1, text.get_text()
        assert box.y0 >= loss_ax.bbox.y1, f"{text.get_text()!r} overlaps the loss curves"
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            assert not a.overlaps(b), "two change labels overlap"
    beside = fig.axes[2]
    assert "uninterrupted run" in [line.get_label() for line in beside.get_lines()]
