"""The package's modules use each other's public names only: a name one module imports from
another is part of that module's interface, so it has no leading underscore (and is in its
``__all__``). Private helpers stay inside their module, so a module can change them alone."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "sailor"


def test_no_module_imports_a_private_name_of_another() -> None:
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sailor."):
                bad += [
                    f"{path.relative_to(PACKAGE)}:{node.lineno}: {node.module}.{a.name}"
                    for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")
                ]
    assert not bad, "private names imported across modules:\n" + "\n".join(bad)


def test_names_imported_across_modules_are_exported() -> None:
    """Every name a module of the package imports from another module of it is in that
    module's ``__all__`` (when it has one)."""
    exported: dict[str, set[str] | None] = {}

    def all_of(module: str) -> set[str] | None:
        if module not in exported:
            rel = Path(*module.split(".")[1:])
            path = PACKAGE / rel.with_suffix(".py")
            if not path.exists():
                path = PACKAGE / rel / "__init__.py"
            names: set[str] | None = None
            if path.exists():
                for node in ast.parse(path.read_text()).body:
                    target = (
                        node.target
                        if isinstance(node, ast.AnnAssign)
                        else node.targets[0]
                        if isinstance(node, ast.Assign)
                        else None
                    )
                    if isinstance(target, ast.Name) and target.id == "__all__":
                        value = node.value
                        assert isinstance(value, (ast.List, ast.Tuple)), path
                        names = {e.value for e in value.elts if isinstance(e, ast.Constant)}
            exported[module] = names
        return exported[module]

    def submodule(module: str, name: str) -> bool:
        """``from sailor.x import y`` where ``y`` is a module or package of ``sailor.x``."""
        base = PACKAGE / Path(*module.split(".")[1:])
        return (base / f"{name}.py").exists() or (base / name).is_dir()

    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            module = node.module or "" if isinstance(node, ast.ImportFrom) else ""
            names = all_of(module) if module.startswith("sailor.") else None
            if isinstance(node, ast.ImportFrom) and names is not None:
                missing += [
                    f"{path.relative_to(PACKAGE)}:{node.lineno}: {module}.{a.name}"
                    for a in node.names
                    if a.name not in names and not submodule(module, a.name)
                ]
    assert not missing, "imported but not in __all__:\n" + "\n".join(missing)
