"""``sailor controller | agent | status | audit``: the runtime's commands."""

from __future__ import annotations

import asyncio
import getpass
import json
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from sailor.cli._io import fail, load_config
from sailor.cli.tables import print_table
from sailor.cli.terminal_text import inert, shown
from sailor.coordination.security import SecurityConfig

__all__ = [
    "agent",
    "audit",
    "controller",
    "periodic_line",
    "security_file_problems",
    "status",
]


def security_file_problems(security: SecurityConfig | None) -> list[str]:
    """What is wrong with the CA, certificate, key and login files ``security`` names (a
    missing or unreadable file), each naming the field and the path."""
    out: list[str] = []
    if security is None:
        return out
    for name in ("ca_file", "cert_file", "key_file", "nats_login_file"):
        path = getattr(security, name)
        if path is not None and not path.exists():
            out.append(
                f"security.{name}={str(path)!r}: no such file: create the files with "
                "`sailor certs` and point the config at them (docs/operations.md#security), or "
                "remove the security section to use plain development servers"
            )
        elif path is not None and not os.access(path, os.R_OK):
            out.append(
                f"security.{name}={str(path)!r}: not readable by this user "
                f"({getpass.getuser()}): `sailor certs` writes keys 0600 for the user who ran "
                "it; give the daemon's user read access (e.g. chown root:sailor and chmod 0640)"
            )
    return out


def _check_security_files(config: Path, security: SecurityConfig | None) -> None:
    """Name a missing CA, certificate, key or login file before connecting to anything."""
    problems = security_file_problems(security)
    if problems:
        raise fail(f"{config}: {problems[0]}")


def _check_training(config: Path, training: Path | None) -> None:
    """Refuse an unreadable or invalid training config before connecting to anything."""
    if training is None:
        return
    from sailor.controller.training import TrainingConfigError, load_training

    try:
        load_training(training)
    except TrainingConfigError as exc:
        raise fail(
            f"{config}: training: {exc}: fix the training config "
            "(`sailor schema training-config`), or remove `training:` to run without one"
        ) from exc


def controller(
    config: Path = typer.Option(..., "--config", help="Controller config file."),
) -> None:
    """Run a controller (leader or standby) until SIGTERM."""
    from sailor.controller.config import ControllerConfig
    from sailor.controller.daemon import run_controller

    cfg = load_config(config, ControllerConfig).anchored(config)
    _check_security_files(config, cfg.security)
    _check_training(config, cfg.training)
    code = asyncio.run(run_controller(cfg))
    if code:  # failed: systemd restarts it
        raise typer.Exit(code)


def agent(config: Path = typer.Option(..., "--config", help="Agent config file.")) -> None:
    """Run the agent of this node until SIGTERM."""
    from sailor.agent.agent_config import AgentConfig
    from sailor.agent.daemon import run_agent

    cfg = load_config(config, AgentConfig).anchored(config)
    _check_security_files(config, cfg.security)
    code = asyncio.run(run_agent(cfg))
    if code:  # the node check refused to join, or the agent failed: the log says why
        raise typer.Exit(code)


def status(
    config: Path = typer.Option(..., "--config", help="Controller config (etcd, job)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Nodes, plan, phase and last checkpoint, read from etcd."""
    from sailor.controller.config import ControllerConfig
    from sailor.controller.status import read_status

    cfg = load_config(config, ControllerConfig).anchored(config)
    _check_security_files(config, cfg.security)
    training = None
    if cfg.training is not None:  # the leader admits nodes by its forced precision
        from sailor.controller.training import load_training

        try:
            training = load_training(cfg.training)
        except Exception as exc:  # status is needed most when something is off: go on
            typer.echo(
                f"warning: {exc}; nodes are judged by the job's recorded precision", err=True
            )
    from sailor.controller.planning.in_process import planner_reach_of

    try:  # the leader admits only the nodes its planner can use
        reach = planner_reach_of(cfg)
    except Exception as exc:  # as above: a broken cost input must not hide the status
        reach = None
        typer.echo(f"warning: {exc}; nodes are not judged by what the planner can use", err=True)
    snap = asyncio.run(
        read_status(cfg.etcd_endpoints, cfg.job, cfg.security, training=training, reach=reach)
    )
    if as_json:
        typer.echo(json.dumps(snap, indent=2, default=str))
        return
    con = Console()
    con.print(
        f"job [bold]{cfg.job}[/]  leader {snap['leader']}  epoch {snap['epoch']}  "
        f"phase [bold]{snap['phase']}[/]  generation {snap['generation']}  "
        f"plan {snap['plan_id']}  last checkpoint {snap['last_checkpoint']}  "
        f"calibration v{snap['calibration_version'] or 0}  "
        f"precision {snap.get('job_precision') or 'not fixed'}"
        + (
            f" (admits by {snap['admission_precision']})"
            if snap.get("admission_precision") not in (None, snap.get("job_precision"))
            else ""
        )
    )
    stream = snap.get("event_stream")
    if stream:  # written only once this term's placement failed
        since = datetime.fromtimestamp(stream["since"], UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        if not stream["placed"]:  # the leader takes no event from NATS meanwhile
            late = " [bold red]OVERDUE[/]" if stream["overdue"] else ""
            con.print(
                f"[bold]event stream not placed[/]{late} since {since} "
                f"({stream['for_s']:.0f} s), {stream['replicas']} replicas: "
                f"{shown(stream['reason'])} (events are not received; joins, leaves and "
                "notices arrive through etcd only)"
            )
        else:
            con.print(
                f"event stream placed since {since} ({stream['for_s']:.0f} s), "
                f"{stream['replicas']} replicas, after a shortage of NATS servers this term"
            )
    held = snap.get("job_excluded")
    if held:  # most placed nodes failed alike: no layout is launched until then
        until = datetime.fromtimestamp(held["until"], UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        con.print(
            f"[bold]job held[/] until {until} after {held['failures']} failure(s) of most "
            f"nodes alike: {shown(held['cause'])} (`sailor node readmit --all` ends it)"
        )
    for node, ex in snap["excluded"].items():  # workers kept failing there: no layout uses it
        until = datetime.fromtimestamp(ex["until"], UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        con.print(
            f"excluded [bold]{shown(node)}[/] until {until} after {ex['failures']} failure(s) in a "
            f"row: {shown(ex['cause'])}"
        )
    for node, why in snap.get("not_admitted", {}).items():  # unplannable, runtime, precision
        con.print(f"not admitted [bold]{shown(node)}[/]: {shown(why)}")
    periodic = periodic_line(snap.get("periodic"))
    if periodic:
        con.print(periodic)
    if snap.get("plan_failed"):  # the last search failed: retried with a backoff
        con.print(f"last failed search: {shown(snap['plan_failed'])}")
    if snap.get("phase") == "idle" and snap.get("cause"):  # why nothing runs
        con.print(f"[bold]idle[/]: {shown(snap['cause'])}")
    cols = (
        "node",
        "gpu",
        "gpus",
        "zone",
        "spot",
        "state",
        "step",
        "loss",
        "notice",
        "excluded",
        "nccl",
        "admitted",
    )
    t = Table(*cols)
    for n in snap["nodes"]:
        t.add_row(*(shown(n.get(k, "")) for k in cols))  # agents write gpu and nccl
    print_table(con, t)


def periodic_line(p: dict[str, Any] | None) -> str:
    """The controller's periodic checkpoint as ``sailor status`` prints it (``read_status``'s
    ``periodic``): the save in flight and the newest periodic commit; '' if neither."""
    if not p or not (p.get("in_flight") or p.get("last_commit")):
        return ""
    parts = []
    f = p.get("in_flight")
    if f:
        left = f["deadline_in_s"]
        due = f"abandoned in {left:.0f} s" if left >= 0 else f"deadline passed {-left:.0f} s ago"
        parts.append(
            f"step {f['step']} in flight, asked {f['asked_s_ago']:.0f} s ago, {due} unless durable"
        )
    else:
        parts.append("none in flight")
    c = p.get("last_commit")
    if c:
        parts.append(f"last committed: step {c['step']}, {c['age_s']:.0f} s ago")
    else:
        parts.append("none committed yet")
    return "periodic checkpoint: " + "; ".join(parts)


def audit(
    logs: list[Path] = typer.Argument(..., help="Audit log(s); several controllers merge."),
    quiet: bool = typer.Option(False, "--quiet", help="Only the verdict."),
) -> None:
    """Check a run's audit log for invariants and print its timeline."""
    from sailor.controller.audit import check, read_records, timeline

    for log in logs:
        if not log.exists() and not list(log.parent.glob(log.name + ".*")):
            raise fail(
                f"{log}: no such audit log: pass the file the controller writes (its config's "
                "audit_log; rotated parts .1 .. .5 beside it are read too)"
            )
    records = read_records(logs)
    if not records:
        raise fail(
            f"{', '.join(map(str, logs))}: no records: an audit of nothing is a failure; pass "
            "the log of a run (the controller's audit_log)",
            code=1,
        )
    rep = check(records)
    if not quiet:
        for line in timeline(records):
            typer.echo(inert(line))  # events' subjects and causes are the nodes' text
    typer.echo(
        f"{rep.records} records, {rep.preemptions} preemptions, "
        f"{rep.reconfigurations} launches, commits {rep.commits}, "
        f"{rep.calibrations} calibration versions, {rep.recalibrations} calibration-driven "
        f"replans, {rep.in_place} launches in place, {rep.fallbacks} fallbacks to restart"
        + (f", marked bad {rep.marked_bad}" if rep.marked_bad else "")
    )
    for v in rep.violations:
        typer.echo(f"VIOLATION {inert(v)}", err=True)
    if not rep.ok:
        raise fail(
            f"{', '.join(map(str, logs))}: {len(rep.violations)} violation(s), listed above: "
            "the run broke an invariant (docs/runtime.md)",
            code=1,
        )
    typer.echo("audit ok")
