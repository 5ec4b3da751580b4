"""`sailor ckpt ls|inspect|verify|gc DIR`: look at and tidy a checkpoint root.

The logic lives in plain functions (``ls_rows``, ``inspect_text``, ``verify_report``,
``gc_paths``) that return values; the typer commands only print them and set the exit code.
``ckpt_app`` is mounted by the main CLI (``sailor.cli``); this module must not import it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import typer

from sailor.checkpoint.errors import CheckpointError
from sailor.checkpoint.storage import open_storage

__all__ = ["LsRow", "ckpt_app", "gc_paths", "inspect_text", "ls_rows", "verify_report"]

ckpt_app = typer.Typer(
    help="Inspect, verify and garbage-collect checkpoints.", no_args_is_help=True
)


class _NoRoot(typer.BadParameter):
    """A checkpoint root that is not there: the command fails (exit 1) without creating it."""

    exit_code = 1


def _root(directory: str) -> str:
    """A local root must be an existing directory: reading one must not create it."""
    local = directory[len("file://") :] if directory.startswith("file://") else directory
    if "://" not in local and not Path(local).is_dir():
        what = "is not a directory" if Path(local).exists() else "does not exist"
        raise _NoRoot(
            f"no committed checkpoint under {directory}: it {what}; pass the checkpoint root "
            "the workers save to (the controller config's checkpoint_dir)"
        )
    return directory


_ROOT_HELP = "Checkpoint root (path or URL)."


@dataclass(frozen=True)
class LsRow:
    step: int
    consumed_samples: int
    layers: int
    bytes: int
    created: float
    layout: str
    status: str


def ls_rows(url: str) -> list[LsRow]:
    """One row per committed checkpoint (status 'ok', or why its manifest is unreadable)."""
    from pydantic import ValidationError

    from sailor.checkpoint.reader import committed_steps, invalid_manifest, read_manifest

    storage = open_storage(url)
    rows = []
    for step in committed_steps(storage):
        try:
            m = read_manifest(storage, step)
        except CheckpointError as exc:
            rows.append(LsRow(step, 0, 0, 0, 0.0, "", f"bad: {exc}"))
            continue
        except ValidationError as exc:  # a newer release's, or a shard path out of its step
            rows.append(
                LsRow(step, 0, 0, 0, 0.0, "", f"bad: {invalid_manifest(storage, step, exc)}")
            )
            continue
        rows.append(
            LsRow(step, m.consumed_samples, len(m.layers), m.total_bytes, m.created, m.layout, "ok")
        )
    return rows


def inspect_text(url: str, step: int | None = None, tensors: bool = False) -> str:
    """The manifest summary of a step (latest if None): globals, layout, per-layer sizes."""
    from sailor.checkpoint.reader import globals_of, latest_step, read_manifest

    storage = open_storage(url)
    s = latest_step(storage) if step is None else step
    m = read_manifest(storage, s)
    lines = [
        f"step {m.step}  consumed_samples {m.consumed_samples}  model {m.model}",
        f"save_id {m.save_id}  plan_id {m.plan_id or '-'}  created {m.created:.0f}",
        f"layout {m.layout or '-'}",
        f"layers {len(m.layers)} of {m.num_layers}  bytes {m.total_bytes}",
        "globals " + json.dumps(dict(globals_of(storage, m).extra)),
        # what consumed_samples indexes (data_fit compares it at a resume)
        "data "
        + (
            json.dumps(m.data.model_dump(mode="json", exclude_none=True))
            if m.data is not None
            else "- (not recorded: saved before data identities were)"
        ),
    ]
    for sh in m.shards:
        lines.append(
            f"  layer {','.join(map(str, sh.layers)):>5}  {sh.size:>12} B  "
            f"rank {sh.writer_rank:>3}  {sh.path}"
        )
        if tensors:
            for t in sh.tensors:
                lines.append(
                    f"      {t.name:<40} {t.dtype:<8} {list(t.shape)!s:<20} tp_dim={t.tp_dim}"
                )
    return "\n".join(lines)


def verify_report(url: str, step: int | None = None) -> dict[int, list[str]]:
    """Problems per committed step (all steps if None); empty lists mean verified."""
    from sailor.checkpoint.reader import committed_steps, verify

    storage = open_storage(url)
    steps = committed_steps(storage) if step is None else [step]
    return {s: verify(storage, s) for s in steps}


def gc_paths(
    url: str, keep: int | None = None, grace_s: float = 0.0, dry_run: bool = False
) -> tuple[list[str], list[str]]:
    """Delete uncommitted debris (and committed checkpoints beyond ``keep``): ``(what was
    deleted, why each committed step it cannot judge was spared)``."""
    from sailor.checkpoint.gc import sweep

    res = sweep(open_storage(url), keep=keep, grace_s=grace_s, dry_run=dry_run)
    return res.deleted, res.spared


@ckpt_app.command("ls")
def ls_cmd(directory: str = typer.Argument(..., help=_ROOT_HELP, callback=_root)) -> None:
    """List committed checkpoints."""
    rows = ls_rows(directory)
    if not rows:
        typer.echo(f"no committed checkpoint under {directory}")
        return
    typer.echo(f"{'step':>10} {'samples':>10} {'layers':>6} {'MB':>10}  status  layout")
    for r in rows:
        typer.echo(
            f"{r.step:>10} {r.consumed_samples:>10} {r.layers:>6} {r.bytes / 1e6:>10.1f}  "
            f"{r.status:<6}  {r.layout}"
        )


@ckpt_app.command("inspect")
def inspect_cmd(
    directory: str = typer.Argument(..., help=_ROOT_HELP, callback=_root),
    step: int | None = typer.Option(None, help="Step (default: latest committed)."),
    tensors: bool = typer.Option(False, help="Also list every tensor."),
) -> None:
    """Show a manifest: step, layers, sizes, the layout it was saved from."""
    try:
        typer.echo(inspect_text(directory, step, tensors))
    except CheckpointError as exc:
        raise _NoRoot(str(exc)) from exc


@ckpt_app.command("verify")
def verify_cmd(
    directory: str = typer.Argument(..., help=_ROOT_HELP, callback=_root),
    step: int | None = typer.Option(None, help="Only this step (default: every committed)."),
) -> None:
    """Verify every checksum of every committed checkpoint; exit 1 if any fails, or if
    there is none to verify (a wrong root must not pass as verified)."""
    if step is not None:
        from sailor.checkpoint.reader import committed_steps

        steps = committed_steps(open_storage(directory))
        if step not in steps:  # nothing to verify: not a corrupt checkpoint
            known = ", ".join(map(str, steps[-5:])) or "none"
            typer.echo(
                f"error: step {step} is not committed under {directory} (newest committed: "
                f"{known}): nothing verified; pass a committed step (`sailor ckpt ls`)",
                err=True,
            )
            raise typer.Exit(1)
    report = verify_report(directory, step)
    bad = not report
    for s, problems in report.items():
        typer.echo(f"step {s}: {'ok' if not problems else 'CORRUPT'}")
        for p in problems:
            bad = True
            typer.echo(f"  {p}")
    if not report:
        typer.echo(f"no committed checkpoint under {directory}")
    if bad:
        raise typer.Exit(1)


@ckpt_app.command("gc")
def gc_cmd(
    directory: str = typer.Argument(..., help=_ROOT_HELP, callback=_root),
    keep: int | None = typer.Option(
        None, min=1, help="Also keep only the newest K committed (at least 1)."
    ),
    grace: float = typer.Option(
        3600.0,
        min=0.0,
        help="Spare uncommitted saves touched within this many seconds (a save running on "
        "a live root, below or above the newest commit); 0: delete every uncommitted save.",
    ),
    dry_run: bool = typer.Option(False, help="Only print what would be deleted."),
) -> None:
    """Delete uncommitted debris (never the newest committed checkpoint). A committed step
    it cannot judge (a newer release's manifest, one refused for a shard path) is spared and
    not counted in ``--keep``: the rest is deleted, then it exits 1 naming each such step."""
    try:
        paths, spared = gc_paths(directory, keep, grace, dry_run)
    except CheckpointError as exc:
        typer.echo(f"error: {exc}\nnothing deleted", err=True)
        raise typer.Exit(1) from exc
    verb = "would delete" if dry_run else "deleted"
    for p in paths:
        typer.echo(f"{verb} {p}")
    typer.echo(f"{verb} {len(paths)} path(s)")
    for why in spared:
        typer.echo(f"error: spared, cannot judge: {why}", err=True)
    if spared:
        raise typer.Exit(1)
