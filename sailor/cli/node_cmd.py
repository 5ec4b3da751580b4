"""``sailor node readmit``: ask the leader to forget failure records (exclusions).

The controller leaves a node whose workers keep failing out of the layouts for a while, and
holds the whole job when most nodes fail alike (docs/runtime.md, "Failing nodes"). Once the
node is repaired or the configuration fixed, an operator brings it back before the backoff
ends. The command writes a request under the job's etcd root with the controller config's
identity (RBAC: controllers and root may write there, agents may not); the leader applies
it in its next pass and deletes it. It never writes the desired state itself: the leader is
its one writer, under its epoch guard.
"""

from __future__ import annotations

import getpass
import socket
from pathlib import Path

import typer

from sailor.cli._io import fail, fail_unanswered, load_config, run_request

__all__ = ["node_app", "readmit"]

node_app = typer.Typer(
    help="Operator requests about nodes, carried out by the leader.", no_args_is_help=True
)


@node_app.callback()
def _group() -> None:
    """Operator requests about nodes, carried out by the leader (a group even with one
    command: ``readmit`` is never taken for a node id)."""


@node_app.command("readmit")
def readmit(
    nodes: list[str] = typer.Argument(None, help="Node ids whose failure records go."),
    config: Path = typer.Option(..., "--config", help="Controller config (etcd, job)."),
    everything: bool = typer.Option(
        False, "--all", help="Every node's record, and the job's hold."
    ),
    wait_s: float = typer.Option(
        10.0, "--wait", min=0, help="Seconds to wait for the leader to apply it."
    ),
) -> None:
    """Forget the failure records (exclusion, streak, backoff) of NODES, or with --all of
    every node and the job: they are planned on again from the leader's next pass."""
    from sailor.cli.runtime_cmd import security_file_problems
    from sailor.controller.config import ControllerConfig
    from sailor.controller.status import request_readmit

    # the config first: a bad file is named whatever else is wrong (tests/unit/test_cli_errors)
    cfg = load_config(config, ControllerConfig).anchored(config)
    if bool(nodes) == everything:
        raise fail("name the nodes to readmit, or pass --all (not both)")
    problems = security_file_problems(cfg.security)
    if problems:
        raise fail(f"{config}: {problems[0]}")
    who = f"{getpass.getuser()}@{socket.gethostname()}"
    answer = run_request(
        request_readmit(
            cfg.etcd_endpoints, cfg.job, nodes or (), everything, who, cfg.security, wait_s
        )
    )
    if answer.unknown:
        typer.echo(f"no failure record to forget for {', '.join(answer.unknown)}", err=True)
    if answer.outcome == "nothing":
        if everything:
            raise fail("nothing to readmit: no node is excluded or failing, no job hold", code=1)
        raise fail(
            f"nothing to readmit: {', '.join(answer.unknown)} not excluded or failing", code=1
        )
    rid = answer.request_id
    fail_unanswered(
        answer.outcome,
        rid,
        wait_s,
        f"/sailor/{cfg.job}/readmit",
        "readmit",
        "nothing was readmitted",
    )
    if answer.unread:
        typer.echo(
            f"applied: the leader took request {rid}; {answer.unread}, so what it readmitted "
            "is not known: see `sailor status` and the leader's audit log (`readmit`)"
        )
        return
    if answer.again:
        typer.echo(
            f"held again since (failed again?): {', '.join(answer.again)}: see `sailor status`",
            err=True,
        )
    if not answer.done and not answer.again:
        typer.echo(
            f"nothing left to readmit: the records were gone when the leader took request {rid}"
        )
        return
    if answer.done:
        typer.echo(f"readmitted {_records(answer.done)} (request {rid}): see `sailor status`")


def _records(names: tuple[str, ...]) -> str:
    """``3 nodes (n1, n2, n3) and the job``: what a readmit ended."""
    nodes = [n for n in names if n != "the job"]
    parts = (
        [f"{len(nodes)} node{'s' if len(nodes) != 1 else ''} ({', '.join(nodes)})"] if nodes else []
    )
    if "the job" in names:
        parts.append("the job's hold")
    return " and ".join(parts)
