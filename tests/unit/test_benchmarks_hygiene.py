"""The benchmark scripts: no import circles, and figures quoted from elsewhere say so.

Read from the source (``ast``): importing a benchmark would start its servers' set-up.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"

# A figure written into the text (not computed in the run): "8.9%", "30 s", ">= 30 s".
_LITERAL_FIGURE = re.compile(r"\d+(\.\d+)?\s*(%|s\b)")
# What such a figure is compared with: another system, whose numbers this run cannot measure.
_OTHER_SYSTEM = re.compile(r"original|torchrun|anchor|paper", re.IGNORECASE)


def _imports(path: Path, local: set[str]) -> set[str]:
    """Benchmark modules ``path`` imports, at any depth (function-level imports included)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module.split(".")[0])
    return out & local


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (depth-first search), or None."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                return [*stack[stack.index(m) :], m]
            if m not in state and (found := visit(m)):
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_benchmarks_have_no_import_circle() -> None:
    files = {p.stem: p for p in BENCH.glob("*.py")}
    graph = {name: _imports(path, set(files)) - {name} for name, path in files.items()}
    assert graph["runtime_burst"] >= {"runtime_decision_latency"}  # the scan sees imports
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_cycle_finder_finds_a_circle() -> None:
    assert _cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def _printed_literals(path: Path) -> list[tuple[int, str]]:
    """(line, literal text) of every ``print(...)`` call in ``path``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "print":
            text = " ".join(
                c.value
                for a in node.args
                for c in ast.walk(a)
                if isinstance(c, ast.Constant) and isinstance(c.value, str)
            )
            out.append((node.lineno, text))
    return out


def test_quoted_figures_are_labelled_with_their_source() -> None:
    """A figure of another system written into a benchmark's output is not a measured baseline:
    the line says it is quoted and where it comes from."""
    checked = 0
    for path in sorted(BENCH.glob("*.py")):
        for line, text in _printed_literals(path):
            if _OTHER_SYSTEM.search(text) and _LITERAL_FIGURE.search(text):
                checked += 1
                assert "quoted" in text and "source" in text, f"{path.name}:{line}: {text!r}"
    assert checked >= 2  # simulator_accuracy's original simulator, runtime_reconfig's anchors
