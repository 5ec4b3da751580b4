"""Reading and writing schema files (JSON or YAML) for the CLI, with errors that name the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TypeVar

import typer
import yaml
from pydantic import BaseModel, ValidationError

__all__ = ["fail", "load_model", "load_raw", "write_json"]

M = TypeVar("M", bound=BaseModel)


def fail(msg: str, code: int = 2) -> typer.Exit:
    """Print an error to stderr and return the exit to raise."""
    typer.echo(f"error: {msg}", err=True)
    return typer.Exit(code)


def load_raw(path: Path) -> Any:
    try:
        text = path.read_text()
    except OSError as exc:
        raise fail(f"{path}: cannot read ({exc.strerror or exc})") from exc
    try:
        if path.suffix in (".yaml", ".yml"):
            return yaml.safe_load(text)
        return json.loads(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise fail(f"{path}: not valid {path.suffix.lstrip('.') or 'JSON'}: {exc}") from exc


def load_model(path: Path, cls: type[M]) -> M:
    """Validate a file against a schema; on failure name the file, each field and value."""
    raw = load_raw(path)
    try:
        return cls.model_validate(raw)
    except ValidationError as exc:
        lines = [
            f"  {'.'.join(map(str, e['loc'])) or '<root>'}: {e['msg']} (got {e.get('input')!r:.80})"
            for e in exc.errors()
        ]
        raise fail(f"{path}: not a valid {cls.__name__}:\n" + "\n".join(lines)) from exc


def write_json(obj: BaseModel | dict[str, Any] | list[Any], path: Path | None) -> None:
    """Write to ``path`` (atomically) or print to stdout."""
    text = (
        obj.model_dump_json(indent=2) if isinstance(obj, BaseModel) else json.dumps(obj, indent=2)
    )
    if path is None:
        typer.echo(text)
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text + "\n")
        tmp.replace(path)
    except OSError as exc:
        raise fail(f"{path}: cannot write ({exc.strerror or exc})") from exc
