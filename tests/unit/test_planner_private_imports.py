"""The planner's modules use each other's public names only (``judge``'s scoring and
``upper_bound``'s candidate grids are shared with the baselines as public functions)."""

from __future__ import annotations

import ast
from pathlib import Path

PLANNER = Path(__file__).resolve().parents[2] / "sailor" / "planner"


def test_planner_imports_no_private_name_of_another_module() -> None:
    bad = []
    for path in sorted(PLANNER.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sailor."):
                bad += [
                    f"{path.relative_to(PLANNER)}:{node.lineno}: {node.module}.{a.name}"
                    for a in node.names
                    if a.name.startswith("_")
                ]
    assert not bad, "private names imported across modules:\n" + "\n".join(bad)
