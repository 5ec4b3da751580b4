"""docs/training.md's "Files" table says, per module of ``sailor/megatron_patch``, whether it
needs torch (the last column): a module marked ``no`` is usable without it (the pure layout
logic), one marked ``yes`` imports it. Checked from the source: a module needs torch when
its import-time statements import ``torch`` or a ``sailor`` module that does (imports inside
functions or under ``if TYPE_CHECKING:`` do not count)."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs/training.md"
ROW = re.compile(r"^\| `([\w/]+\.py)` \|.*\| (yes|no) \|$", re.M)


def _source(module: str) -> Path | None:
    base = ROOT / module.replace(".", "/")
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _import_time(body: list[ast.stmt]) -> list[ast.stmt]:
    """The statements that run at import: the body, into ``try``/``if`` blocks, but not an
    ``if TYPE_CHECKING:`` block nor function or class bodies."""
    out: list[ast.stmt] = []
    for node in body:
        if isinstance(node, ast.If):
            if "TYPE_CHECKING" in ast.unparse(node.test):
                out += _import_time(node.orelse)
                continue
            out += _import_time(node.body) + _import_time(node.orelse)
        elif isinstance(node, ast.Try):
            out += _import_time(node.body) + _import_time(node.orelse)
            for handler in node.handlers:
                out += _import_time(handler.body)
        else:
            out.append(node)
    return out


def _imports(module: str) -> set[str]:
    path = _source(module)
    if path is None:
        return set()
    names: set[str] = set()
    for node in _import_time(ast.parse(path.read_text()).body):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}  # a submodule
    return names


@functools.cache
def needs_torch(module: str) -> bool:
    seen: set[str] = set()
    todo = [module]
    while todo:
        mod = todo.pop()
        if mod in seen:
            continue
        seen.add(mod)
        parts = mod.split(".")
        # importing a.b.c runs a/__init__, a/b/__init__ too
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]
        for name in _imports(mod):
            if name.split(".")[0] == "torch":
                return True
            if name.startswith("sailor") and _source(name) is not None:
                todo.append(name)
    return False


def rows() -> list[tuple[str, bool]]:
    return [(m.group(1), m.group(2) == "yes") for m in ROW.finditer(DOC.read_text())]


def test_the_table_is_found() -> None:
    assert len(rows()) > 30


@pytest.mark.parametrize(("name", "says"), rows(), ids=[n for n, _ in rows()])
def test_torch_column_is_true(name: str, says: bool) -> None:
    module = "sailor.megatron_patch." + name.removesuffix(".py").replace("/", ".")
    assert _source(module) is not None, f"docs/training.md names {name}: no such module"
    assert needs_torch(module) == says, (
        f"docs/training.md says {name} needs torch: {'yes' if says else 'no'}; "
        f"its imports say {'yes' if not says else 'no'}"
    )
