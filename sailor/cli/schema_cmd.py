"""``sailor schema NAME``: print the JSON Schema of any schema."""

from __future__ import annotations

import json

import typer
from pydantic import BaseModel, TypeAdapter

from sailor import schemas as s
from sailor.cli._io import fail
from sailor.schemas.node_check import CheckReport

__all__ = ["SCHEMAS", "schema"]

SCHEMAS: dict[str, type[BaseModel] | TypeAdapter[object]] = {
    "gpu": s.GPUSpec,
    "zone": s.Zone,
    "node": s.NodeSpec,
    "pool": s.Pool,
    "network": s.NetworkProfile,
    "prices": s.PriceTable,
    "model": s.ModelSpec,
    "layer-profile": s.LayerProfile,
    "profiles": s.ProfileDB,
    "plan": s.Plan,
    "estimate": s.Estimate,
    "event": s.EventAdapter,  # type: ignore[dict-item]
    "command": s.CommandAdapter,  # type: ignore[dict-item]
    "checkpoint-manifest": s.CheckpointManifest,
    "check-report": CheckReport,
    "training-config": s.TrainingConfig,
    "dataset-manifest": s.DatasetManifest,
}


def schema(
    name: str = typer.Argument(..., help=f"One of: {', '.join(SCHEMAS)}; or 'list'."),
) -> None:
    """Print the JSON Schema of a Sailor schema."""
    if name == "list":
        for n in SCHEMAS:
            typer.echo(n)
        return
    target = SCHEMAS.get(name)
    if target is None:
        raise fail(f"schema name={name!r} is unknown; known: {', '.join(SCHEMAS)}")
    js = target.json_schema() if isinstance(target, TypeAdapter) else target.model_json_schema()
    typer.echo(json.dumps(js, indent=2))
