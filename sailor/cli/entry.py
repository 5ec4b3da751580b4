"""The ``sailor`` console script: :func:`main` imports the command line, then runs it.

The import of the command line and of the sub-command run takes seconds on a busy machine; a
Ctrl-C then, or at any later time, ends with one line on stderr and exit 130 (128 +
SIGINT), as a shell tool interrupted by Ctrl-C does: no traceback. This module imports
nothing of Sailor at its top, so that the interrupt meets :func:`main`'s handler.
"""

from __future__ import annotations

import sys

__all__ = ["INTERRUPTED", "main"]

INTERRUPTED = 130
"""The exit status after Ctrl-C (128 + SIGINT)."""


def main() -> None:
    """Import and run ``sailor.cli.main.app``; Ctrl-C at any point: one line, exit 130."""
    try:
        from sailor.cli.main import app

        app()
    except KeyboardInterrupt:
        sys.stderr.write("interrupted (Ctrl-C)\n")
        sys.stderr.flush()
        raise SystemExit(INTERRUPTED) from None


if __name__ == "__main__":
    main()
