"""``sailor check``: is this VM ready to join as a node? Run it on a new GPU VM before its agent.

Gathers CUDA and driver, NCCL, the devices with their catalog types, bf16/fp16 and memory,
runs a one-node NCCL all-reduce and send/recv probe among the GPUs, and reaches NATS and
etcd with the node's own credentials (``--config agent.yaml``: URL, endpoint, TLS, login);
prints one ok / warn / fail line per check with what to do (``--json``: a ``CheckReport``).

Exit codes: 0 the node can serve (no line failed; warnings allowed); 1 it cannot; 2 the
config cannot be read, or an option is out of reach (``--timeout -1``). A machine without a
GPU fails as a GPU node; it passes when the config's ``node.gpu_type`` is ``cpu`` (a CPU
node: GPU checks skipped, nothing spawned), or with ``--allow-cpu`` (its "no GPU" becomes a
warning, to check the rest).
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.table import Table

from sailor.cli._io import fail, load_config
from sailor.cli.tables import print_table

if TYPE_CHECKING:
    from sailor.schemas.node_check import CheckReport

__all__ = ["check"]

_STYLE = {"ok": "green", "warn": "yellow", "fail": "bold red"}


def check(
    config: Path | None = typer.Option(
        None, "--config", help="Agent config (node, NATS, etcd, security); without it: GPUs only."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the CheckReport as JSON."),
    allow_cpu: bool = typer.Option(
        False, "--allow-cpu", help="No GPU on a GPU node is a warning, not a failure."
    ),
    probe: bool = typer.Option(True, help="Run the NCCL all-reduce and send/recv probe."),
    timeout: float = typer.Option(5.0, help="Seconds to wait for NATS and for etcd."),
    probe_deadline: float = typer.Option(120.0, help="Seconds the NCCL probe may take."),
) -> None:
    """Check this node: GPUs, CUDA, NCCL, a one-node collective, NATS and etcd."""
    from sailor.agent.agent_config import AgentConfig
    from sailor.agent.check_gather import gather_gpu, node_facts, reach_servers
    from sailor.agent.check_verdicts import judge

    for option, seconds in (("--timeout", timeout), ("--probe-deadline", probe_deadline)):
        # -1 or nan reached the servers' clients, whose refusal read as "did not answer"
        if not 0 < seconds < math.inf:
            raise fail(f"{option}={seconds}: seconds, finite and > 0")
    cfg = load_config(config, AgentConfig).anchored(config) if config is not None else None
    if cfg is not None:  # named as the agent names it, not as a TLS failure to connect
        from sailor.cli.runtime_cmd import security_file_problems

        problems = security_file_problems(cfg.security)
        if problems:
            raise fail(f"{config}: {problems[0]}")
    node = cfg.node if cfg is not None else None
    facts = node_facts(node)
    if facts.node_kind == "gpu":
        facts = node_facts(node, gather_gpu(probe=probe, deadline_s=probe_deadline))
    if cfg is not None:
        nats, etcd = asyncio.run(
            reach_servers(
                cfg.nats_urls, cfg.etcd_endpoints, cfg.security, cfg.node.node_id, timeout
            )
        )
        facts = facts.model_copy(update={"nats": nats, "etcd": etcd})
    report = judge(facts, node_id=node.node_id if node else "", allow_cpu=allow_cpu)
    if as_json:
        typer.echo(report.model_dump_json(indent=2))
    else:
        _print(report)
    if not report.serves:
        raise typer.Exit(1)


def _print(report: CheckReport) -> None:
    f = report.facts
    con = Console()
    who = f"node {report.node_id}" if report.node_id else "this machine"
    con.print(f"[bold]sailor check[/] {who} on {f.hostname}")
    t = Table("check", "verdict", "finding", "what to do")
    for line in report.lines:
        t.add_row(
            line.check, f"[{_STYLE[line.verdict]}]{line.verdict}[/]", line.detail, line.action
        )
    print_table(con, t)
    if report.serves:
        con.print(f"[green]ready[/]: this node can serve ({report.verdict})")
    else:
        con.print("[bold red]not ready[/]: this node cannot serve as configured")
