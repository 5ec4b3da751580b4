"""``sailor controller | agent | status | audit``: the runtime's commands."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

__all__ = ["agent", "audit", "controller", "status"]


def controller(
    config: Path = typer.Option(..., "--config", help="Controller config file."),
) -> None:
    """Run a controller (leader or standby) until SIGTERM."""
    from sailor.controller.config import ControllerConfig
    from sailor.controller.daemon import run_controller

    asyncio.run(run_controller(ControllerConfig.load(config)))


def agent(config: Path = typer.Option(..., "--config", help="Agent config file.")) -> None:
    """Run the agent of this node until SIGTERM."""
    from sailor.agent.daemon import AgentConfig, run_agent
    from sailor.controller.config import load_mapping

    asyncio.run(run_agent(AgentConfig.model_validate(load_mapping(config))))


def status(
    config: Path = typer.Option(..., "--config", help="Controller config (etcd, job)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Nodes, plan, phase and last checkpoint, read from etcd."""
    from sailor.controller.config import ControllerConfig
    from sailor.controller.status import read_status

    cfg = ControllerConfig.load(config)
    snap = asyncio.run(read_status(cfg.etcd_endpoints, cfg.job, cfg.security))
    if as_json:
        typer.echo(json.dumps(snap, indent=2, default=str))
        return
    con = Console()
    con.print(
        f"job [bold]{cfg.job}[/]  leader {snap['leader']}  epoch {snap['epoch']}  "
        f"phase [bold]{snap['phase']}[/]  generation {snap['generation']}  "
        f"plan {snap['plan_id']}  last checkpoint {snap['last_checkpoint']}"
    )
    cols = ("node", "gpu", "gpus", "zone", "spot", "state", "step", "loss", "notice")
    t = Table(*cols)
    for n in snap["nodes"]:
        t.add_row(*(str(n.get(k, "")) for k in cols))
    con.print(t)


def audit(
    logs: list[Path] = typer.Argument(..., help="Audit log(s); several controllers merge."),
    quiet: bool = typer.Option(False, "--quiet", help="Only the verdict."),
) -> None:
    """Check a run's audit log for invariants and print its timeline."""
    from sailor.controller.audit import check, read_records, timeline

    records = read_records(logs)
    rep = check(records)
    if not quiet:
        for line in timeline(records):
            typer.echo(line)
    typer.echo(
        f"{rep.records} records, {rep.preemptions} preemptions, "
        f"{rep.reconfigurations} launches, commits {rep.commits}"
    )
    for v in rep.violations:
        typer.echo(f"VIOLATION {v}", err=True)
    if not rep.ok:
        raise typer.Exit(1)
    typer.echo("audit ok")
