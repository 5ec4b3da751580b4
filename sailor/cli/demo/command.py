"""``sailor demo``: a one-machine cluster that trains through a preemption, a loss and a join.

Starts nats-server and etcd (the project's install), a controller and agents as real
``sailor`` processes, each agent a ``cpu`` node running real workers (a tiny GPT-2, see
``demo.model``); trains; then a spot-preemption notice, a node lost without notice and a
node joining, each followed by a reconfiguration; ends with a summary against an
uninterrupted run and a PNG. ``--plan`` adds (``--plan-only`` runs only) the planning
showcase on a bundled heterogeneous pool.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, TextIO, cast

import typer
from rich.console import Console

from sailor.cli._io import fail

__all__ = ["demo"]


def demo(
    out: Path = typer.Option(
        Path("out"),
        help="Where the files go: demo-cluster.png; with --plan or --plan-only also "
        "demo-timeline.png and demo-plan.json (the best plan, a file `sailor simulate` reads).",
    ),
    steps: int = typer.Option(30, help="Steps trained between two injected changes."),
    nodes: int = typer.Option(3, help="Agents at the start (>= 3); one more joins later."),
    min_step_s: float | None = typer.Option(
        None,
        help="Pace of a worker step (s). Default: unpaced under the nodes' CPU quotas; "
        "0.05 where quotas are unavailable (leaves the cores to the control plane).",
    ),
    notice_s: float = typer.Option(20.0, help="Deadline of the spot-preemption notice (s)."),
    timeout_s: float = typer.Option(90.0, help="Give up if a phase takes longer (s)."),
    plan: bool = typer.Option(False, "--plan", help="First plan OPT-350 on a bundled pool."),
    plan_only: bool = typer.Option(False, "--plan-only", help="Only the planning section."),
    train: bool = typer.Option(
        True, hidden=True, help="--no-train = --plan-only (the earlier demo's flag)."
    ),
    in_place: bool = typer.Option(
        True,
        "--in-place/--restart",
        help="Reconfigure in place (the workers survive and fetch only the layers they gain) "
        "or by restarting them (new processes read the checkpoint back), to compare.",
    ),
    compare_restart: bool = typer.Option(
        False,
        "--compare-restart",
        help="First run the same scenario on the restart path, then in place, and print each "
        "change's no-step gap and seconds per phase for both (twice the time).",
    ),
    keep: bool = typer.Option(False, help="Keep the run directory (logs, audit, checkpoints)."),
    as_json: bool = typer.Option(False, "--json", help="No live view; print a JSON summary."),
) -> None:
    """One-machine cluster: train, survive a preemption, a node loss and a join; summarize."""
    from sailor.cli.demo.kinds import DEMO_GLOBAL_BATCH
    from sailor.cli.demo.run import Interrupted, run_demo
    from sailor.cli.demo.scenario import DemoSettings

    con = Console(quiet=as_json)
    plan_only = plan_only or not train
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a file of that name, or a folder that cannot be made
        what = "is a file, not a folder" if out.is_file() else (exc.strerror or str(exc))
        raise fail(f"--out {out}: {what}: give a folder for the demo's files") from exc
    result: dict[str, Any] = {}
    if plan or plan_only:
        from sailor.cli.demo.plan_section import plan_section

        result["plan"] = plan_section(con, out)
    if not plan_only:
        _log_to_stderr()
        try:
            settings = DemoSettings(
                initial_nodes=nodes,
                steps_between=steps,
                min_step_s=min_step_s if min_step_s is not None else DemoSettings.min_step_s,
                global_batch_size=DEMO_GLOBAL_BATCH,
                notice_s=notice_s,
                phase_timeout_s=timeout_s,
                in_place=in_place,
            )
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from exc
        try:
            if compare_restart:
                con.rule("[bold]The restart path: the same scenario, workers restarted")
                restart = dataclasses.replace(settings, in_place=False)
                result["cluster_restart"] = run_demo(
                    restart, out, con, keep, show_live=not as_json, auto_pace=min_step_s is None
                )
            con.rule("[bold]A one-machine cluster: preemption notice, node loss, node join")
            result["cluster"] = run_demo(
                settings, out, con, keep, show_live=not as_json, auto_pace=min_step_s is None
            )
            if compare_restart:
                from sailor.cli.demo.report import print_paths

                print_paths(con, result["cluster_restart"], result["cluster"])
        except Interrupted as exc:
            typer.echo(f"sailor demo: {exc}: stopped, every process ended", err=True)
            raise typer.Exit(128 + exc.signum) from None
    if as_json:
        typer.echo(json.dumps(result, indent=2))
    for key in ("cluster_restart", "cluster"):
        cl = result.get(key)
        if cl is None:
            continue
        ok = cl["losses"]["ok"] and all(r["resumed"] for r in cl["reconfigurations"])
        if not ok or cl["leftover_processes"]:
            raise typer.Exit(1)


class _CurrentStderr:
    """Whatever ``sys.stderr`` is at each write (a test runner may swap and close it)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def _log_to_stderr() -> None:
    """The demo's own log lines (e.g. applying etcd RBAC) go to stderr: stdout is for --json."""
    import structlog

    stream = cast(TextIO, _CurrentStderr())  # only write() and flush() are used
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(stream))
