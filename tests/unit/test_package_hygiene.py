"""The ``sailor`` package: no import circles, and every module a process is started as exists.

Read from the source (``ast`` and text): a circle hidden in a function-level import still
makes two modules one concept, and a module path in a string (``python -m sailor.X``,
``module="sailor.X"``) is not seen by the import checks when a module is renamed.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "sailor"

# A module started as a process: `python -m sailor.x`, ("-m", "sailor.x"), module="sailor.x".
_STARTED = re.compile(
    r"""(?:python3?\s+-m\s+|["']-m["'],\s*["']|\bmodule\s*[:=]\s*(?:str\s*=\s*)?["'])"""
    r"""(sailor(?:\.\w+)*)"""
)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PKG.rglob("*.py")}


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Sailor modules ``name`` imports, at any depth (function-level imports included)."""
    out: set[str] = set()
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                mod = ".".join([*base, *([node.module] if node.module else [])])
            else:
                mod = node.module or ""
            for a in node.names:
                if f"{mod}.{a.name}" in modules:
                    out.add(f"{mod}.{a.name}")
                elif mod in modules:
                    out.add(mod)
    return out - {name}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (depth-first search, no recursion), or None."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    for root in sorted(graph):
        if root in state:
            continue
        stack: list[tuple[str, list[str]]] = [(root, sorted(graph[root]))]
        state[root] = 1
        while stack:
            node, todo = stack[-1]
            if not todo:
                state[node] = 2
                stack.pop()
                continue
            nxt = todo.pop()
            if state.get(nxt) == 1:
                path = [n for n, _ in stack]
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state:
                state[nxt] = 1
                stack.append((nxt, sorted(graph.get(nxt, ()))))
    return None


def test_sailor_has_no_import_circle() -> None:
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    # the scan sees function-level imports (rss_probe imports the rank's main lazily) and the
    # pair that once formed a circle is still connected, one way
    assert "sailor.megatron_patch.rank_main" in graph["sailor.profiler.rss_probe"]
    assert "sailor.profiler.in_situ" in graph["sailor.profiler.layer_bench"]
    assert "sailor.profiler.layer_measurement" in graph["sailor.profiler.in_situ"]
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_cycle_finder_finds_a_circle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_every_module_started_as_a_process_exists() -> None:
    """Module paths in strings, across code, tests, benchmarks, docs and deployment files."""
    modules = _modules()
    found: dict[str, list[str]] = {}
    for top in ("sailor", "tests", "benchmarks", "docs", "deploy"):
        for path in sorted((ROOT / top).rglob("*")):
            if path.suffix not in (".py", ".md", ".yaml", ".yml", ".service", ".toml"):
                continue
            if path == Path(__file__).resolve():  # its examples name no module
                continue
            for m in _STARTED.finditer(path.read_text()):
                found.setdefault(m.group(1), []).append(str(path.relative_to(ROOT)))
    for name in ("README.md", "Makefile", "pyproject.toml"):
        for m in _STARTED.finditer((ROOT / name).read_text()):
            found.setdefault(m.group(1), []).append(name)
    missing = {name: where for name, where in found.items() if name not in modules}
    assert not missing, missing
    # the scan sees the processes the agent, the profiler and the tests start
    assert {
        "sailor.training_process",
        "sailor.megatron_patch.rank_main",
        "sailor.agent.toy_trainer",
        "sailor.profiler.rss_probe",
    } <= set(found), sorted(found)


def test_deprecated_worker_module_runs_the_training_process() -> None:
    """``python -m sailor.worker`` (agent configs written before the rename) starts the same
    process as ``python -m sailor.training_process``."""
    import sailor.training_process
    import sailor.worker

    assert sailor.worker.main is sailor.training_process.main
    main_py = ast.parse((PKG / "worker" / "__main__.py").read_text())
    froms = {n.module for n in ast.walk(main_py) if isinstance(n, ast.ImportFrom)}
    assert froms == {"sailor.training_process"}
