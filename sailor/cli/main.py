"""The ``sailor`` command line: one Typer app whose sub-commands are imported when used.

``sailor agent`` imports the agent's command module, not the planner's, the profiler's or
the certificates' (every command imported up front cost ~0.8 CPU-s a start, ~0.3 s more than
one command's own imports): :class:`_Commands` resolves a name to its module on first use.
Listing them (``sailor --help``, the tests walking every command) imports them all.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import ItemsView, Iterator, KeysView, ValuesView
from typing import Any

import structlog
import typer

from sailor.cli.errors import OneLineErrors

__all__ = ["app"]

_COMMANDS: dict[str, tuple[str, str]] = {
    # single commands first, then groups: the order ``sailor --help`` lists them in
    "schema": ("sailor.cli.schema_cmd", "schema"),
    "demo": ("sailor.cli.demo_cmd", "demo"),
    "simulate": ("sailor.cli.simulate_cmd", "simulate_cmd"),
    "plan": ("sailor.cli.plan_cmd", "plan_cmd"),
    "controller": ("sailor.cli.runtime_cmd", "controller"),
    "agent": ("sailor.cli.runtime_cmd", "agent"),
    "status": ("sailor.cli.runtime_cmd", "status"),
    "check": ("sailor.cli.check_cmd", "check"),
    "audit": ("sailor.cli.runtime_cmd", "audit"),
    "worker": ("sailor.cli.worker_cmd", "worker"),
    "import": ("sailor.cli.import_cmd", "import_app"),
    "catalog": ("sailor.cli.catalog_cmd", "catalog_app"),
    "ckpt": ("sailor.checkpoint.cli", "ckpt_app"),
    "profile": ("sailor.cli.profile_cmd", "profile_app"),
    "config": ("sailor.cli.config_cmd", "config_app"),
    "certs": ("sailor.cli.certs_cmd", "certs_app"),
    "data": ("sailor.cli.data_cmd", "data_app"),
    "node": ("sailor.cli.node_cmd", "node_app"),
    "checkpoint": ("sailor.cli.checkpoint_cmd", "checkpoint_app"),
}
"""Sub-command name -> (module, attribute): a Typer app (a group) or a command function."""


def _build(name: str) -> Any:
    """The click command of sub-command ``name``, its module imported now."""
    module, attr = _COMMANDS[name]
    mod = importlib.import_module(module)
    obj = getattr(mod, attr)
    cmd: Any
    if isinstance(obj, typer.Typer):
        cmd = typer.main.get_group(obj)
    else:
        one = typer.Typer(add_completion=False)  # completion is the root's
        settings = getattr(mod, "WORKER_SETTINGS", None) if name == "worker" else None
        one.command(name, context_settings=settings)(obj)
        cmd = typer.main.get_command(one)
    cmd.name = name
    return cmd


class _Commands(dict[str, Any]):
    """The root group's ``commands``: a name's command built on first lookup; iterating,
    listing or counting them builds every one (help, completion, tests that walk them)."""

    def _all(self) -> None:
        for name in _COMMANDS:
            self.get(name)

    def get(self, name: str, default: Any = None) -> Any:
        if not dict.__contains__(self, name) and name in _COMMANDS:
            dict.__setitem__(self, name, _build(name))
        return dict.get(self, name, default)

    def __getitem__(self, name: str) -> Any:
        found = self.get(name)
        if found is None:
            raise KeyError(name)
        return found

    def __contains__(self, name: object) -> bool:
        return name in _COMMANDS or dict.__contains__(self, name)

    def __iter__(self) -> Iterator[str]:
        self._all()
        return dict.__iter__(self)

    def __len__(self) -> int:
        self._all()
        return dict.__len__(self)

    def keys(self) -> KeysView[str]:  # type: ignore[override]
        self._all()
        return dict.keys(self)

    def values(self) -> ValuesView[Any]:  # type: ignore[override]
        self._all()
        return dict.values(self)

    def items(self) -> ItemsView[str, Any]:  # type: ignore[override]
        self._all()
        return dict.items(self)


class _Root(OneLineErrors):
    """The root group: :class:`OneLineErrors` over the lazily built sub-commands, listed in
    :data:`_COMMANDS`' order."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.commands = _Commands(self.commands)

    def list_commands(self, ctx: Any) -> list[str]:
        return list(_COMMANDS)

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        return self.commands.get(cmd_name)


app = typer.Typer(
    name="sailor",
    cls=_Root,
    help="Plan and run training on heterogeneous, geo-distributed, dynamic GPU clusters.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


class _Stderr:
    """``sys.stderr`` as it is when a line is written (a test's captured stream, once
    closed, is not kept)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


@app.callback()
def _logs_to_stderr() -> None:
    """Log lines go to stderr: stdout is each command's own output (``--json`` included);
    systemd's journal takes both streams of a daemon."""
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(_Stderr()))  # type: ignore[arg-type]


if __name__ == "__main__":
    app()
