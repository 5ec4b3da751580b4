"""``sailor checkpoint clear-bad``: ask the leader to clear bad checkpoint marks.

A committed step that launches could not load is marked bad (or, after a first strike,
suspect) and never loaded again: the job falls back to older commits (docs/runtime.md,
"Failing nodes"). When the fault was the storage (a mount, a bucket's
permission) and an operator has repaired it, this brings the step back. As ``sailor node
readmit``: the command writes a request under the job's etcd root with the controller
config's identity; the leader applies it in its next pass and deletes it. It never writes
the desired state itself: the leader is its one writer, under its epoch guard.

``--repoint``, after the checkpoint storage moved (the files copied to the controller
config's new ``checkpoint_dir``): the commit records naming another directory are
re-pointed to the leader's ``checkpoint_dir`` too, and their marks go. Without it a launch
reads each commit where it was saved, and with the old path gone every one is marked bad.
``--from DIR`` (repeatable) re-points only the records under DIR: with ``--all``, every
record under it (its marks go; marks of steps recorded elsewhere stay); with STEPS, those,
refused when one is recorded under a third directory. The request names the steps (the
wire record is unchanged: any leader with re-pointing applies it).

(``sailor ckpt`` holds the tools that read and write a checkpoint directory itself.)
"""

from __future__ import annotations

import getpass
import socket
from pathlib import Path

import typer

from sailor.cli._io import fail, fail_unanswered, load_config, run_request

__all__ = ["checkpoint_app", "clear_bad"]

checkpoint_app = typer.Typer(
    help="Operator requests about a job's checkpoints, carried out by the leader "
    "(`sailor ckpt`: tools for a checkpoint directory).",
    no_args_is_help=True,
)


@checkpoint_app.callback()
def _group() -> None:
    """Operator requests about a job's checkpoints, carried out by the leader (a group even
    with one command)."""


@checkpoint_app.command("clear-bad")
def clear_bad(
    steps: list[int] = typer.Argument(None, help="Committed steps whose bad marks go."),
    config: Path = typer.Option(..., "--config", help="Controller config (etcd, job)."),
    everything: bool = typer.Option(False, "--all", help="Every bad and suspect mark."),
    repoint: bool = typer.Option(
        False,
        "--repoint",
        help="Also re-point the commit records of STEPS (--all: every record) that name "
        "another directory to the config's checkpoint_dir: their files were moved there.",
    ),
    sources: list[str] = typer.Option(
        None,
        "--from",
        metavar="DIR",
        help="With --repoint: only the records under DIR (repeatable) are re-pointed; with "
        "--all, every record under DIR and its mark (marks elsewhere stay).",
    ),
    wait_s: float = typer.Option(
        10.0, "--wait", min=0, help="Seconds to wait for the leader to apply it."
    ),
) -> None:
    """Clear the bad (and suspect) marks of STEPS, or with --all of every step, once their
    storage is repaired: the next launch that takes the newest readable commit may load
    them. Nothing running is aborted for it. With --repoint, after moving the checkpoint
    storage to checkpoint_dir, also load them from there."""
    from sailor.cli.runtime_cmd import security_file_problems
    from sailor.controller.config import ControllerConfig
    from sailor.controller.status import request_clear_bad

    # the config first: a bad file is named whatever else is wrong (tests/unit/test_cli_errors)
    cfg = load_config(config, ControllerConfig).anchored(config)
    if bool(steps) == everything:
        raise fail("name the steps to clear, or pass --all (not both)")
    if any(s < 0 for s in steps or ()):
        raise fail(f"steps are committed steps, 0 or more: got {sorted(steps)}")
    sources = sorted(set(sources or ()))
    if sources and not repoint:
        raise fail(f"--from {sources[0]}: names the records to re-point: pass --repoint too")
    for src in sources:
        if not src.strip():
            raise fail("--from '': a directory is expected: pass the old checkpoint_dir")
        if src == cfg.checkpoint_dir:
            raise fail(
                f"--from {src}: is the config's checkpoint_dir, where the records are "
                "re-pointed to: pass the directory they were moved from"
            )
    problems = security_file_problems(cfg.security)
    if problems:
        raise fail(f"{config}: {problems[0]}")
    who = f"{getpass.getuser()}@{socket.gethostname()}"
    answer = run_request(
        request_clear_bad(
            cfg.etcd_endpoints,
            cfg.job,
            steps or (),
            everything,
            who,
            cfg.security,
            wait_s,
            repoint=cfg.checkpoint_dir if repoint else "",
            sources=sources,
        )
    )
    if answer.elsewhere:
        raise fail(
            f"step {', '.join(answer.elsewhere)}: recorded under neither --from "
            f"{', '.join(sources)} nor {cfg.checkpoint_dir}: leave it out, or add its "
            "directory with --from (nothing was written)"
        )
    names = ", ".join(answer.unknown)
    if answer.unknown:
        typer.echo(f"no bad or suspect mark on step {names}", err=True)
    if answer.outcome == "nothing":
        if sources:
            named = ", ".join(answer.directories) or "none"
            raise fail(
                f"nothing to clear or re-point: no {'' if everything else 'such '}step is "
                f"recorded under --from {', '.join(sources)} (records under another "
                f"directory than {cfg.checkpoint_dir}: {named})",
                code=1,
            )
        if repoint:
            raise fail(
                "nothing to clear or re-point: no such step is marked bad or suspect, nor "
                f"recorded under another directory than {cfg.checkpoint_dir}",
                code=1,
            )
        if everything:
            raise fail("nothing to clear: no step is marked bad or suspect", code=1)
        raise fail(f"nothing to clear: step {names} not marked bad or suspect", code=1)
    rid = answer.request_id
    fail_unanswered(
        answer.outcome,
        rid,
        wait_s,
        f"/sailor/{cfg.job}/clear-bad",
        "clear_bad",
        "no mark was cleared",
    )
    if answer.unread:
        typer.echo(
            f"applied: the leader took request {rid}; {answer.unread}, so what it cleared "
            "or re-pointed is not known: see `sailor status` and the leader's audit log "
            "(`clear_bad`)"
        )
        return
    if answer.again:
        typer.echo(
            f"marked again since (read again and failed?): step {', '.join(answer.again)}: "
            "see `sailor status`",
            err=True,
        )
    if answer.moved:
        typer.echo(
            f"re-pointed the records of step {', '.join(answer.moved)} from "
            f"{', '.join(answer.moved_from)} to {cfg.checkpoint_dir} (request {rid})"
        )
    if answer.unmoved:
        typer.echo(
            f"the records of step {', '.join(answer.unmoved)} were not re-pointed to "
            f"{cfg.checkpoint_dir}: does the leader's "
            "checkpoint_dir differ from this config's, or does it run a release before "
            "--repoint? See `sailor status` and the leader's audit log (`clear_bad`)",
            err=True,
        )
    if answer.done:
        what = f"step {', '.join(answer.done)}"
        if everything and not sources:
            what = f"every bad and suspect mark ({what})"
        typer.echo(f"cleared {what} (request {rid}): see `sailor status`")
    elif not answer.again and not answer.moved:
        typer.echo(f"nothing left to clear: the marks were gone when the leader took request {rid}")
