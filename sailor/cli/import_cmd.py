"""``sailor import ...``: convert the original Sailor artifact's files into Sailor's schemas."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from pydantic import BaseModel

from sailor.cli._io import fail, write_json
from sailor.importers.sailor_extra import import_any
from sailor.importers.sailor_format import (
    ImportFormatError,
    import_egress,
    import_network,
    import_plan,
    import_profiles,
    profile_models,
)
from sailor.schemas.model import MAX_GLOBAL_BATCH

__all__ = ["import_app"]

import_app = typer.Typer(help="Import files of the original Sailor artifact.", no_args_is_help=True)


@import_app.command("sailor-profiles")
def sailor_profiles(
    directory: Path = typer.Argument(..., help="Folder with profiles_tmp.json and llm_info.json."),
    model: str | None = typer.Option(None, help="Model to import (default: every model)."),
    out: Path = typer.Option(Path("profiles"), "-o", "--out", help="Output folder."),
) -> None:
    """Per-layer profiles and sizes → one ProfileDB JSON per model (OUT/<model>.json)."""
    prof = directory / "profiles_tmp.json"
    info = directory / "llm_info.json"
    try:
        names = [model] if model else profile_models(prof)
        for m in names:
            db = import_profiles(prof, info if info.exists() else None, m)
            write_json(db, out / f"{m}.json")
            typer.echo(f"{m}: {len(db.timings)} timings, {len(db.sizes)} sizes -> {out / m}.json")
    except ImportFormatError as exc:
        raise fail(str(exc)) from exc


@import_app.command("sailor-network")
def sailor_network(
    multizone: Path = typer.Argument(..., help="multizone_bandwidths*.json"),
    intra: Path | None = typer.Option(None, help="intra_node_bandwidths.json"),
    out: Path | None = typer.Option(None, "-o", "--out", help="Output file (default stdout)."),
) -> None:
    """Zone-to-zone bandwidth fits → NetworkProfile JSON."""
    try:
        write_json(import_network(multizone, intra), out)
    except ImportFormatError as exc:
        raise fail(str(exc)) from exc


@import_app.command("sailor-egress")
def sailor_egress(
    path: Path = typer.Argument(..., help="communication_cost.json"),
    out: Path | None = typer.Option(None, "-o", "--out", help="Output file (default stdout)."),
) -> None:
    """Egress prices → PriceTable JSON (egress part)."""
    try:
        write_json(import_egress(path), out)
    except ImportFormatError as exc:
        raise fail(str(exc)) from exc


@import_app.command("sailor-plan")
def sailor_plan(
    path: Path = typer.Argument(..., help="plan_config_*.json"),
    model: str = typer.Option(..., help="Model name the plan trains, e.g. OPT-350."),
    gbs: int | None = typer.Option(
        None, min=1, max=MAX_GLOBAL_BATCH, help="Global batch (default: the file's 'gbs')."
    ),
    out: Path | None = typer.Option(None, "-o", "--out", help="Output file (default stdout)."),
) -> None:
    """A plan config → Plan JSON."""
    try:
        write_json(import_plan(path, model, global_batch_size=gbs), out)
    except ImportFormatError as exc:
        raise fail(str(exc)) from exc


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, BaseModel):
        return obj.model_dump(mode="json")
    if isinstance(obj, Exception):
        return {"error": str(obj)}
    if isinstance(obj, list | tuple):
        return [_jsonable(x) for x in obj]
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    return obj


@import_app.command("sailor-file")
def sailor_file(
    path: Path = typer.Argument(..., help="Any data file of the original artifact."),
    model: str = typer.Option("OPT-350", help="Model a plan file trains."),
    out: Path | None = typer.Option(None, "-o", "--out", help="Output file (default stdout)."),
) -> None:
    """Recognise the format of one file of the original artifact and convert it."""
    try:
        result = import_any(path, model=model, reference_dir=path.resolve().parent.parent)
    except ImportFormatError as exc:
        raise fail(str(exc)) from exc
    write_json(_jsonable(result) if not isinstance(result, BaseModel) else result, out)
