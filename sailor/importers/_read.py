"""Reading JSON of foreign formats with errors that name the file and the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["ImportFormatError", "as_float", "as_int", "get", "load_json"]


class ImportFormatError(ValueError):
    """A foreign file does not have the expected shape; names the file and the field."""

    def __init__(self, file: str | Path, field: str, why: str) -> None:
        super().__init__(f"{file}: field {field!r}: {why}")
        self.file = str(file)
        self.field = field


def load_json(path: str | Path) -> Any:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ImportFormatError(p, "<file>", f"cannot read: {exc.strerror or exc}") from exc
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ImportFormatError(
            p, "<file>", f"not valid JSON ({exc.msg} at line {exc.lineno})"
        ) from exc
    except RecursionError as exc:  # json's own depth limit
        raise ImportFormatError(p, "<file>", "not valid JSON (nested too deep)") from exc


def get(d: Any, key: str | int, file: str | Path, field: str) -> Any:
    """``d[key]`` or an error naming ``field``."""
    if isinstance(d, dict):
        if key in d:
            return d[key]
        raise ImportFormatError(file, field, f"missing (have: {', '.join(map(str, list(d)[:12]))})")
    if isinstance(d, list) and isinstance(key, int):
        if -len(d) <= key < len(d):
            return d[key]
        raise ImportFormatError(file, field, f"index {key} out of range (length {len(d)})")
    # a key of the wrong kind for what is there: say what the key needs, not what was found
    # alone (a string key into a list read "expected an object or a list, got list")
    want = "a list (an index)" if isinstance(key, int) else f"an object (key {key!r})"
    raise ImportFormatError(file, field, f"expected {want}, got {type(d).__name__}")


def as_float(v: Any, file: str | Path, field: str, *, min_value: float | None = None) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise ImportFormatError(file, field, f"expected a number, got {v!r}")
    f = float(v)
    if f != f or f in (float("inf"), float("-inf")):
        raise ImportFormatError(file, field, f"expected a finite number, got {v!r}")
    if min_value is not None and f < min_value:
        raise ImportFormatError(file, field, f"must be >= {min_value}, got {v!r}")
    return f


def as_int(v: Any, file: str | Path, field: str, *, min_value: int | None = None) -> int:
    if isinstance(v, bool):
        raise ImportFormatError(file, field, f"expected an integer, got {v!r}")
    if isinstance(v, str) and v.strip().lstrip("-").isdigit():
        v = int(v)
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not isinstance(v, int):
        raise ImportFormatError(file, field, f"expected an integer, got {v!r}")
    if min_value is not None and v < min_value:
        raise ImportFormatError(file, field, f"must be >= {min_value}, got {v!r}")
    return v
