"""``sailor worker ARGS``: run one training rank (what the agent launches on a node).

A thin wrapper: every argument after ``worker`` goes unparsed to
:func:`sailor.training_process.main` (``--plan --rank --world-size --master [--control]
[--ckpt-dir --load-step] ...``; ``sailor worker --help`` lists them). torch is imported
only when the command runs, so the rest of the CLI stays quick to start.
"""

from __future__ import annotations

import typer

__all__ = [
    "WORKER_SETTINGS",
    "worker",
]


def worker(ctx: typer.Context) -> None:
    """Run one rank of a plan (arguments: see `sailor worker --help`)."""
    from sailor.training_process import main

    raise typer.Exit(main(list(ctx.args)))


WORKER_SETTINGS = {
    "allow_extra_args": True,
    "ignore_unknown_options": True,
    "help_option_names": [],
}
"""Typer context settings that hand every argument, ``--help`` included, to the worker."""
