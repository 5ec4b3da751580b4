"""``sailor config check FILE``: validate a daemon's config file before deploying it.

The file is read exactly as the daemon reads it (YAML, TOML or JSON by suffix, through
``sailor.controller.config.load_mapping``) and validated by the daemon's own schema
(``ControllerConfig`` or ``AgentConfig``), so a file that passes here is one the daemon
starts with; a controller config's ``training`` file is read and validated too, as the
controller does at start. Which daemon: ``--kind``, else the file's shape: an agent config
must have a ``node:`` section and a controller config has none. (The schemas forbid unknown
keys, so a ``kind:`` key inside the file would make the daemon refuse it; the kind is not
written there.)

Exit codes: 0 valid; 1 invalid (every error printed with its field and value); 2 the file
cannot be read or parsed, or the kind is unknown. Never connects to NATS or etcd.
"""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Any

import typer
from pydantic import BaseModel, ValidationError

from sailor.cli._io import fail

__all__ = ["Kind", "check_config", "config_app"]

config_app = typer.Typer(help="Daemon config files.", no_args_is_help=True)


class Kind(StrEnum):
    controller = "controller"
    agent = "agent"


def _schema(kind: Kind) -> type[BaseModel]:
    if kind is Kind.agent:
        from sailor.agent.daemon import AgentConfig

        return AgentConfig
    from sailor.controller.config import ControllerConfig

    return ControllerConfig


def _field(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def _errors(exc: ValidationError) -> list[str]:
    lines = []
    for err in exc.errors(include_url=False):
        where = _field(tuple(err["loc"]))
        if err["type"] == "missing":
            lines.append(f"{where}: required field is missing")
        else:
            lines.append(f"{where}: {err['msg']} (value: {err.get('input')!r})")
    return lines


def _extra_checks(kind: Kind, cfg: Any, path: Path) -> list[str]:
    """Checks the schema cannot express but the daemon would fail on at start-up."""
    lines: list[str] = []
    if kind is Kind.controller and cfg.training is not None:
        from sailor.controller.training import TrainingConfigError, load_training

        training = cfg.anchored(path).training
        try:
            load_training(training)
        except TrainingConfigError as exc:
            for line in str(exc).splitlines():
                lines.append(f"training: {line} (value: {str(cfg.training)!r})")
    if kind is Kind.agent:
        from sailor.agent.watchers import make_watcher
        from sailor.coordination import SystemClock

        for i, w in enumerate(cfg.watchers):
            try:
                make_watcher(w.kind, w.target, SystemClock())
            except ValueError as exc:
                lines.append(f"watchers[{i}].kind: {exc} (value: {w.kind!r})")
    return lines


def check_config(path: Path, kind: Kind | None = None) -> tuple[int, Kind | None, list[str]]:
    """(exit code, kind, messages) for one file; see the module docstring for the codes."""
    from sailor.controller.config import load_mapping

    try:
        data = load_mapping(path)
    except (OSError, ValueError) as exc:  # yaml/toml/json errors are ValueError subclasses
        return 2, kind, [f"{path}: cannot read: {exc}"]
    except Exception as exc:  # yaml.YAMLError is not a ValueError
        return 2, kind, [f"{path}: cannot parse: {exc}"]
    if kind is None:
        kind = Kind.agent if "node" in data else Kind.controller
    try:
        cfg = _schema(kind).model_validate(data)
    except ValidationError as exc:
        return 1, kind, _errors(exc)
    extra = _extra_checks(kind, cfg, path)
    return (1 if extra else 0), kind, extra


@config_app.command("check")
def check(
    file: Path = typer.Argument(..., help="Config file (.yaml, .toml or .json)."),
    kind: Kind | None = typer.Option(
        None, "--kind", help="Daemon the file is for (default: agent if it has a node: section)."
    ),
) -> None:
    """Validate a controller or agent config file; print OK or every error."""
    code, found, messages = check_config(file, kind)
    if code == 0:
        typer.echo(f"{file}: OK ({found.value if found else '?'} config)")
        return
    if code == 2:  # cannot read or parse: one message, naming the file
        raise fail(f"{'; '.join(messages)}: pass a readable YAML, TOML or JSON config", code)
    label = f" ({found.value} config)" if found else ""
    for m in messages:
        typer.echo(f"{file}{label}: {m}", err=True)
    raise fail(f"{file}: {len(messages)} error(s), listed above: fix the fields named", code)
