"""``sailor schema NAME``: print the JSON Schema of any schema."""

from __future__ import annotations

import json

import typer
from pydantic import TypeAdapter

from sailor.cli._io import fail
from sailor.cli.schema_names import SCHEMAS

__all__ = ["SCHEMAS", "schema"]


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
