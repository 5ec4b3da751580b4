"""The one place a CLI error becomes the line a user reads: ``error: WHAT: WHAT TO DO``.

Every command's failure reaches :class:`OneLineErrors` (the root command group), which prints
one line on stderr and exits non-zero; no traceback reaches the user. Commands raise
:class:`CliError` for what they check themselves (``sailor.cli._io.fail`` builds one), and any
other exception is described from what it carries: the file of an ``OSError``, the fields and
values of a pydantic ``ValidationError``, the message of anything else.

``SAILOR_TRACEBACK=1`` lets unexpected exceptions through with their traceback (for a bug
report). This module must never decide what a command does: it only words its failure.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

import typer
from rich.console import Console
from typer._click.exceptions import NoArgsIsHelpError, UsageError
from typer.core import TyperGroup

from sailor.schemas.redact import redact_text

__all__ = ["CliError", "OneLineErrors", "describe"]

_DEBUG_ENV = "SAILOR_TRACEBACK"


class CliError(typer.Exit):
    """A failure the user can fix: ``message`` names the file or field, the value and what to
    do; ``code`` is the exit status (2: bad input, 1: the command ran and failed). A
    ``typer.Exit``, so that code calling a command's helpers sees the exit it always saw."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(code)
        self.message = message
        self.code = code

    def __str__(self) -> str:
        return self.message


def _flat(text: str) -> str:
    """One line: newlines (multi-line library messages) become "; "."""
    return "; ".join(part.strip() for part in str(text).splitlines() if part.strip())


def _shown(value: Any) -> str:
    """A field's input as the line shows it: its repr without a URL's password (redacted
    before it is cut, so a cut URL leaks no part of one), at most 60 characters."""
    return f"{redact_text(repr(value)):.60}"


def _validation(exc: Any) -> str:
    fields = "; ".join(
        f"{'.'.join(map(str, e['loc'])) or '<root>'}: {e['msg']} (got {_shown(e.get('input'))})"
        for e in exc.errors()
    )
    return f"not a valid {exc.title}: {fields}: fix the field(s) named"


def describe(exc: BaseException) -> tuple[str, int]:
    """(the one line, without ``error:``, and the exit status) for ``exc``; a URL's
    password in it is shown as ``***`` (``schemas.redact``), whatever raised it."""
    line, code = _describe(exc)
    return redact_text(line), code


def _describe(exc: BaseException) -> tuple[str, int]:
    from pydantic import ValidationError

    if isinstance(exc, CliError):
        return _flat(str(exc)), exc.code
    if isinstance(exc, FileNotFoundError):
        return f"{exc.filename}: no such file or directory: check the path", 2
    if isinstance(exc, IsADirectoryError):
        return f"{exc.filename}: is a directory, a file is expected: pass the file", 2
    if isinstance(exc, PermissionError):
        return f"{exc.filename}: permission denied: check its owner and mode", 2
    if isinstance(exc, OSError) and exc.filename is not None:
        return f"{exc.filename}: {exc.strerror or exc}", 1
    if isinstance(exc, ValidationError):
        return _flat(_validation(exc)), 2
    if type(exc).__module__.startswith("sailor."):  # Sailor's own errors are worded for users
        retry = getattr(exc, "retry_after", None)
        what = "temporary: retry" if retry is not None else "see the message"
        return _flat(f"{exc}: {what}"), 1
    hint = f" (a bug? {_DEBUG_ENV}=1 shows where)"
    return _flat(f"{type(exc).__name__}: {exc}") + hint, 1


def _drop_stdout() -> None:
    """Point stdout at /dev/null: the interpreter's final flush of what is still buffered
    would meet the closed pipe again and print an error of its own."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no real stdout (a test's capture): nothing to flush
        pass


_RICH_ON_BROKEN_PIPE = Console.on_broken_pipe


def _raise_broken_pipe(console: Console) -> None:
    """rich's ``Console.on_broken_pipe``, made to raise the ``BrokenPipeError`` it met.
    rich's own exits 1, so a command whose output is a rich table (``sailor plan``,
    ``sailor catalog gpus``) piped into ``head`` ended with 1, "failed", where the same
    command printing with ``typer.echo`` (``--json``) ends with 141: :class:`OneLineErrors`
    now ends both alike. In another thread (a live view's refresh) rich's own is kept: its
    ``SystemExit`` ends that thread quietly, where an error would print a traceback."""
    if threading.current_thread() is not threading.main_thread():
        _RICH_ON_BROKEN_PIPE(console)
        return
    console.quiet = True  # nothing more into the closed pipe
    raise BrokenPipeError


class OneLineErrors(TyperGroup):
    """The root command group: runs the command and turns any exception into one line."""

    def invoke(self, ctx: Any) -> Any:
        Console.on_broken_pipe = _raise_broken_pipe  # type: ignore[method-assign,assignment]
        try:
            return super().invoke(ctx)
        except UsageError as exc:
            if isinstance(exc, NoArgsIsHelpError):
                raise  # a bare group: typer prints its help
            where = exc.ctx.command_path if exc.ctx is not None else "sailor"
            what = _flat(exc.format_message()).rstrip(".")
            typer.echo(f"error: {what}: see `{where} --help`", err=True)
            raise typer.Exit(exc.exit_code) from None
        except CliError as exc:
            typer.echo(f"error: {_flat(exc.message)}", err=True)
            raise typer.Exit(exc.code) from None
        except (typer.Exit, typer.Abort, typer.TyperException):
            raise  # exits: typer handles them
        except KeyboardInterrupt:
            # Ctrl-C: one line and 130 (128 + SIGINT), as a shell tool ends; typer's own
            # 130 said nothing (``sailor.cli.entry`` does the same during the imports)
            typer.echo("interrupted (Ctrl-C)", err=True)
            raise typer.Exit(130) from None
        except BrokenPipeError:
            # the reader of our output went away (``sailor ... | head``): end quietly, as a
            # shell tool killed by SIGPIPE does (128 + 13), and let nothing flush into the pipe
            _drop_stdout()
            raise typer.Exit(141) from None
        except Exception as exc:
            if os.environ.get(_DEBUG_ENV):
                raise
            line, code = describe(exc)
            typer.echo(f"error: {line}", err=True)
            raise typer.Exit(code) from None
