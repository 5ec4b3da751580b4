"""JSON read from a file or a peer, with its depth limit turned into an error that names it.

``json.loads`` of text nested past Python's recursion limit (``[[[[…``: 100k brackets in a
line of an audit log, a trace file, a fence file or a child's output) raises
``RecursionError``, which is no ``ValueError``: a reader that catches what a bad file raises
(``ValueError``, ``JSONDecodeError``) let it through as a bare traceback, and a daemon's
pass ended on it. :func:`load_json` raises :class:`JsonTooDeepError` instead, a
``ValueError`` naming where the text came from, so every caller's handling of bad JSON
covers it.

Pure: parsing only; must never read a file itself (callers pass the text and its name).
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["JsonTooDeepError", "load_json"]


class JsonTooDeepError(ValueError):
    """JSON nested past the parser's depth limit (Python's recursion limit)."""


def load_json(text: str | bytes, where: str) -> Any:
    """``json.loads(text)``; nesting too deep to read is a :class:`JsonTooDeepError`
    naming ``where`` (a file, ``file:line``, a field). A syntax error is json's own
    ``JSONDecodeError`` (also a ``ValueError``)."""
    try:
        return json.loads(text)
    except RecursionError:
        raise JsonTooDeepError(
            f"{where}: JSON nested too deep to read (past the parser's depth limit)"
        ) from None
