"""A memo held on a frozen value: results computed from its fields, kept while they last.

A frozen schema value never changes, so what is computed from it (an index of a price table,
the planner's verdict on a node shape) can be kept on it and reused by every later call. It
is kept in the instance's ``__dict__`` beside the fields: pydantic compares, hashes, dumps and
validates the fields only, so a memo changes none of those. ``model_copy(update=...)`` copies
that ``__dict__`` to a value with other fields, so a memo is stamped with the field values it
was computed from (by identity) and dropped on a value whose fields are other objects.

Pure: no I/O; the memo is the value's own cache, never shared between values.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

__all__ = ["memo"]


def memo(value: BaseModel, name: str, fields: tuple[str, ...]) -> dict[Any, Any]:
    """The memo ``name`` of ``value`` (a dict to fill), valid for its ``fields``: emptied
    when one of them is not the object it was made for (a copy with other fields)."""
    stamp = tuple(value.__dict__[f] for f in fields)
    held = value.__dict__.get(name)
    if (
        held is None
        or len(held[0]) != len(stamp)
        or any(a is not b for a, b in zip(held[0], stamp, strict=True))
    ):
        held = (stamp, {})
        value.__dict__[name] = held
    table: dict[Any, Any] = held[1]
    return table
