"""The ``sailor`` command line: one Typer app mounting every sub-command."""

from __future__ import annotations

import sys

import structlog
import typer

from sailor.checkpoint.cli import ckpt_app
from sailor.cli.catalog_cmd import catalog_app
from sailor.cli.certs_cmd import certs_app
from sailor.cli.check_cmd import check
from sailor.cli.checkpoint_cmd import checkpoint_app
from sailor.cli.config_cmd import config_app
from sailor.cli.data_cmd import data_app
from sailor.cli.demo_cmd import demo
from sailor.cli.errors import OneLineErrors
from sailor.cli.import_cmd import import_app
from sailor.cli.node_cmd import node_app
from sailor.cli.plan_cmd import plan_cmd
from sailor.cli.profile_cmd import profile_app
from sailor.cli.runtime_cmd import agent, audit, controller, status
from sailor.cli.schema_cmd import schema
from sailor.cli.simulate_cmd import simulate_cmd
from sailor.cli.worker_cmd import WORKER_SETTINGS, worker

__all__ = ["app"]

app = typer.Typer(
    name="sailor",
    cls=OneLineErrors,
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


app.command("schema")(schema)
app.command("demo")(demo)
app.command("simulate")(simulate_cmd)
app.command("plan")(plan_cmd)
app.add_typer(import_app, name="import")
app.add_typer(catalog_app, name="catalog")
app.add_typer(ckpt_app, name="ckpt")
app.add_typer(profile_app, name="profile")
app.command("controller")(controller)
app.command("agent")(agent)
app.command("status")(status)
app.command("check")(check)
app.command("audit")(audit)
app.add_typer(config_app, name="config")
app.add_typer(certs_app, name="certs")
app.add_typer(data_app, name="data")
app.add_typer(node_app, name="node")
app.add_typer(checkpoint_app, name="checkpoint")
app.command("worker", context_settings=WORKER_SETTINGS)(worker)


if __name__ == "__main__":
    app()
