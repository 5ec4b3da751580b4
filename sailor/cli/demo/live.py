"""The demo's live terminal view (rich): phase, plan, nodes, step, loss, samples/s, events.

A pure function of what :mod:`sailor.cli.demo.observe` read; the scenario hands the result
to ``rich.live.Live``. Must never read or write anything itself.
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from sailor.cli.demo.observe import ClusterView, StepPoint

__all__ = ["render"]

_PHASE_STYLE = {"running": "bold green", "idle": "dim"}


def render(
    view: ClusterView,
    latest: StepPoint | None,
    samples_per_s: float | None,
    log: Sequence[str],
    elapsed_s: float,
) -> RenderableType:
    """One frame of the live view."""
    style = _PHASE_STYLE.get(view.phase, "bold yellow")
    head = Text.assemble(
        ("phase ", "dim"),
        (f"{view.phase.upper():<10}", style),
        ("  generation ", "dim"),
        str(view.generation),
        ("  step ", "dim"),
        str(latest.step if latest else "—"),
        ("  loss ", "dim"),
        f"{latest.loss:.4f}" if latest else "—",
        ("  samples/s ", "dim"),
        f"{samples_per_s:.1f}" if samples_per_s else "—",
        ("  t ", "dim"),
        f"{elapsed_s:5.1f} s",
    )
    plan = Text.assemble(("plan ", "dim"), view.plan)
    nodes = Table("node", "gpu", "zone", "ranks", "state", "step", "loss", expand=False)
    for n in view.nodes:
        nodes.add_row(
            n.node,
            n.gpu,
            n.zone,
            ",".join(map(str, n.ranks)) or "—",
            n.state,
            str(n.step) if n.step >= 0 else "—",
            f"{n.loss:.4f}" if n.loss is not None else "—",
        )
    events = Text("\n".join(log[-6:]) or "…", style="cyan")
    return Panel(
        Group(head, plan, nodes, Panel(events, title="demo", title_align="left")),
        title="sailor demo — one-machine cluster",
        title_align="left",
    )
