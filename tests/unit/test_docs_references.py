"""What README.md and docs/*.md name exists: paths, `sailor` command lines and their flags,
module paths, `make` targets and the flags of the benchmarks.

The docs are what an engineer types from, so a renamed file, flag or module must take its
mentions along. Read from the text: every path under ``sailor/``, ``tests/``,
``benchmarks/``, ``docs/`` or ``deploy/`` (brace alternatives ``x_{a,b}.py`` expanded, globs
matched); every ``sailor …`` command line (a ```` ``` ```` block's line, or a backticked
span that starts with it) resolved against the CLI's own commands, each ``--flag`` among its
options (``sailor worker``: the rank's argparse parser); every dotted ``sailor.x.y`` /
``tests.x.y`` / ``benchmarks.x.y`` as a module, and its first attribute as a name the module
defines or imports (from the source, nothing imported); every backticked ``make X``; every
``benchmarks/x.py --flag`` (or ``x.py --flag`` of a benchmark) as a string in that script;
every backticked ``Model.field`` of a schema or daemon config model as one of its fields.
Not checked here: values and defaults quoted in prose (the config and option defaults the
docs quote are checked by test_docs_defaults.py; other values: read them against the code).
"""

from __future__ import annotations

import ast
import itertools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import typer

ROOT = Path(__file__).resolve().parents[2]
_TOPS = ("sailor", "tests", "benchmarks", "docs", "deploy")


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@dataclass(frozen=True)
class Mention:
    where: str  # "docs/x.md:12"
    text: str


def _lines(path: Path) -> list[tuple[int, str, bool]]:
    """(line number, text, inside a ``` block) of a doc; a backslash continuation joined."""
    out: list[tuple[int, str, bool]] = []
    in_block = False
    pending: tuple[int, str] | None = None
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            in_block = not in_block
            pending = None
            continue
        if pending is not None:
            number, line = pending[0], pending[1].rstrip() + " " + line.lstrip()
            pending = None
        if in_block and line.endswith("\\"):
            pending = (number, line[:-1])
            continue
        out.append((number, line, in_block))
    return out


def _where(path: Path, number: int) -> str:
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    return f"{shown}:{number}"


# ---------------------------------------------------------------------------- paths

_PATH = re.compile(r"(?<![\w./-])((?:sailor|tests|benchmarks|docs|deploy)/[\w./*{},-]*[\w*}/])")


def expand_braces(text: str) -> list[str]:
    """``a_{x,y}.py`` -> ``a_x.py``, ``a_y.py`` (every group, as the shell does)."""
    parts = re.split(r"\{([^{}]*)\}", text)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def path_exists(name: str, root: Path = ROOT) -> bool:
    """A path, a glob, or ``dir/module.ATTR`` (a name in a module, written with its path)."""
    name = name.split("::")[0]
    if "*" in name:
        return any(root.glob(name))
    if (root / name).exists():
        return True
    stem, _, attr = name.rpartition(".")
    return bool(stem) and attr.isidentifier() and (root / f"{stem}.py").is_file()


def path_mentions(text: str) -> list[str]:
    out: list[str] = []
    for m in _PATH.finditer(text):
        name = m.group(1)
        if "{" in name and "}" not in name:  # a brace group cut by the regex: keep the stem
            name = name[: name.index("{")]
        out.extend(expand_braces(name.rstrip(".,")))
    return out


def test_paths_named_in_docs_exist() -> None:
    missing: list[str] = []
    seen = 0
    for doc in doc_files():
        for number, line, _ in _lines(doc):
            for name in path_mentions(line):
                seen += 1
                if not path_exists(name):
                    missing.append(f"{_where(doc, number)}: {name}")
    assert seen > 200, seen  # the scan reads the docs at all
    assert not missing, "\n".join(missing)


def test_path_scan_expands_and_reports() -> None:
    assert path_mentions("see `tests/integration/test_security_{nats,etcd}.py`.") == [
        "tests/integration/test_security_nats.py",
        "tests/integration/test_security_etcd.py",
    ]
    assert path_mentions("x https://h/sailor/a.py `sailor/controller/decide.py`, y") == [
        "sailor/controller/decide.py"
    ]
    assert path_exists("sailor/controller/decide.py")
    assert path_exists("tests/reference_opt350.DEEPSPEED")
    assert path_exists("tests/unit/test_docs_references.py::test_path_scan_expands_and_reports")
    assert path_exists("deploy/systemd/*.service")
    assert not path_exists("sailor/controller/no_such_module.py")
    assert not path_exists("deploy/systemd/*.timer")


# ------------------------------------------------------------------- sailor commands

# `sailor ARGS` at a command's start: line start (after a path to the binary), or after a
# shell separator; in prose only a backticked span that starts with it.
_BLOCK_CMD = re.compile(r"(?:^|[;&|(]\s*|\$\(\s*|\$\s+)(?:[\w./-]*/)?sailor\s+([^;&|)#]*)")
_INLINE_CMD = re.compile(r"`(?:[\w./-]*/)?sailor\s+([^`]*)`")


def command_mentions(path: Path) -> list[Mention]:
    out: list[Mention] = []
    for number, line, in_block in _lines(path):
        if in_block:
            code = re.sub(r"(?:^|\s)#.*", "", line).strip()
            out += [Mention(_where(path, number), m.group(1)) for m in _BLOCK_CMD.finditer(code)]
        else:
            out += [Mention(_where(path, number), m.group(1)) for m in _INLINE_CMD.finditer(line)]
    return out


def _options(cmd: Any) -> set[str]:
    opts = {"--help"}
    for param in cmd.params:
        opts.update(param.opts)
        opts.update(param.secondary_opts)
    return {o for o in opts if o.startswith("-")}


def _worker_options() -> set[str]:
    from sailor.megatron_patch.rank_args import build_parser

    return {o for a in build_parser()._actions for o in a.option_strings}


def check_command(args: str, root: Any, worker_options: set[str]) -> list[str]:
    """What is wrong with ``sailor ARGS``: an unknown subcommand, or a flag its command lacks.
    Alternatives ``a|b`` are each checked; placeholders (NAME, <x>, …) end the command path."""
    tokens = [t.strip("[]()`,") for t in args.split()]
    tokens = [t for t in tokens if t]
    if not tokens or not re.match(r"[a-z]", tokens[0]):
        return []
    problems: list[str] = []
    for first in tokens[0].split("|"):
        cmds, path, rest = [root], ["sailor"], [first, *tokens[1:]]
        while rest and hasattr(cmds[0], "commands") and re.match(r"[a-z]", rest[0]):
            subs = []
            for alt in rest[0].split("|"):
                sub = cmds[0].commands.get(alt)
                if sub is None:
                    problems.append(f"`{' '.join(path)}` has no command {alt!r}")
                else:
                    subs.append(sub)
            if not subs:
                return problems
            path.append(rest[0])
            cmds, rest = subs, rest[1:]
        for cmd in cmds:
            known = worker_options if path == ["sailor", "worker"] else _options(cmd)
            for token in rest:
                for flag in token.split("|"):
                    name = flag.split("=")[0].rstrip(".:;")
                    if re.fullmatch(r"--[a-z][\w-]*|-[a-zA-Z]", name) and name not in known:
                        problems.append(f"`{' '.join(path)}` has no option {name}")
    return problems


@pytest.fixture(scope="module")
def cli_root() -> Any:
    from sailor.cli.main import app

    return typer.main.get_command(app)


def test_sailor_command_lines_in_docs_exist(cli_root: Any) -> None:
    worker = _worker_options()
    problems: list[str] = []
    mentions = [m for doc in doc_files() for m in command_mentions(doc)]
    assert len(mentions) > 100, len(mentions)
    for m in mentions:
        problems += [
            f"{m.where}: {p}   [sailor {m.text.strip()}]"
            for p in check_command(m.text, cli_root, worker)
        ]
    assert not problems, "\n".join(problems)


def test_command_check_reports(cli_root: Any, tmp_path: Path) -> None:
    worker = _worker_options()
    assert check_command("plan --model m --top 3 -o out.json", cli_root, worker) == []
    assert check_command("ckpt ls|gc DIR --keep 2", cli_root, worker) == [
        "`sailor ckpt ls|gc` has no option --keep"
    ]
    assert check_command("worker --cpu-cores 0,2-3", cli_root, worker) == []
    assert check_command("worker --no-such-flag", cli_root, worker) == [
        "`sailor worker` has no option --no-such-flag"
    ]
    assert check_command("nosuch --x", cli_root, worker) == ["`sailor` has no command 'nosuch'"]
    assert check_command("schema NAME", cli_root, worker) == []
    doc = tmp_path / "x.md"
    doc.write_text(
        "`sailor demo --json` and `sailor.x`\n```sh\n# the sailor user\n"
        "/opt/v/bin/sailor status \\\n  --config c.yaml   # read etcd\nx && sailor check\n```\n"
    )
    assert [m.text.strip() for m in command_mentions(doc)] == [
        "demo --json",
        "status --config c.yaml",
        "check",
    ]


# -------------------------------------------------------------------- module paths

_DOTTED = re.compile(r"(?<![\w./-])((?:sailor|tests|benchmarks)(?:\.\w+)+)")
_FILE_SUFFIXES = {"py", "md", "json", "jsonl", "yaml", "yml", "toml", "service", "bin", "idx"}


def module_names(path: Path) -> set[str]:
    """Names a module defines or imports at any depth, and its package's submodules."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.ImportFrom | ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    if path.name == "__init__.py":
        names |= {p.stem for p in path.parent.glob("*.py")}
        names |= {p.name for p in path.parent.iterdir() if (p / "__init__.py").is_file()}
    return names


def check_dotted(name: str, root: Path = ROOT) -> str | None:
    """Why ``sailor.x.y[.attr]`` names nothing, or None."""
    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        base = root.joinpath(*parts[:k])
        source = (
            base / "__init__.py" if (base / "__init__.py").is_file() else base.with_suffix(".py")
        )
        if not source.is_file():
            continue
        rest = parts[k:]
        if not rest or rest[0] in _FILE_SUFFIXES or rest[0] in module_names(source):
            return None
        return f"{'.'.join(parts[:k])} has no {rest[0]!r}"
    return f"no module {parts[0]}.{parts[1]}"


def test_module_paths_named_in_docs_exist() -> None:
    problems: list[str] = []
    seen = 0
    for doc in doc_files():
        for number, line, _ in _lines(doc):
            for m in _DOTTED.finditer(line):
                seen += 1
                why = check_dotted(m.group(1).rstrip("."))
                if why is not None:
                    problems.append(f"{_where(doc, number)}: {m.group(1)}: {why}")
    assert seen > 50, seen
    assert not problems, "\n".join(problems)


def test_dotted_check_reports() -> None:
    assert check_dotted("sailor.controller.decide") is None
    assert check_dotted("sailor.comm.api.all_gather_into_tensor") is None
    assert check_dotted("sailor.megatron_patch.rank_main") is None
    assert check_dotted("sailor.comm.all_gather_into_tensor") == (
        "sailor.comm has no 'all_gather_into_tensor'"
    )
    assert check_dotted("sailor.nosuch") == "sailor has no 'nosuch'"


# ------------------------------------------------------------ make targets, benchmarks


def make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([a-z][\w-]*):", text, re.M))


def test_make_targets_named_in_docs_exist() -> None:
    targets = make_targets()
    assert {"demo", "test", "chaos", "setup"} <= targets, targets
    problems: list[str] = []
    for doc in doc_files():
        for number, line, in_block in _lines(doc):
            found = re.findall(r"`make ([a-z][\w-]*)", line)
            if in_block:
                found += re.findall(r"^\s*make ([a-z][\w-]*)", line)
            problems += [f"{_where(doc, number)}: make {t}" for t in found if t not in targets]
    assert not problems, "\n".join(problems)


_BENCH = re.compile(r"(?:benchmarks/)?(\w+)\.py((?:\s+(?:--?[\w-]+(?:=\S+)?|[^\s`-]\S*))*)")


def benchmark_flag_problems(line: str, root: Path = ROOT) -> list[str]:
    problems: list[str] = []
    for m in _BENCH.finditer(line):
        script = root / "benchmarks" / f"{m.group(1)}.py"
        if not script.is_file():
            continue
        source = script.read_text()
        for flag in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", m.group(2)):
            if f'"{flag}"' not in source and f"'{flag}'" not in source:
                problems.append(f"benchmarks/{script.name} has no {flag}")
    return problems


def test_benchmark_flags_named_in_docs_exist() -> None:
    problems = [
        f"{_where(doc, number)}: {p}"
        for doc in doc_files()
        for number, line, _ in _lines(doc)
        for p in benchmark_flag_problems(line)
    ]
    assert not problems, "\n".join(problems)
    assert benchmark_flag_problems("`planner_replan.py --sizes 512 --reps 3`") == []
    assert benchmark_flag_problems("`benchmarks/planner_replan.py --no-such 1`") == [
        "benchmarks/planner_replan.py has no --no-such"
    ]


# ------------------------------------------------------------- schema and config fields

_MODEL_MODULES = (
    "sailor.controller.config",
    "sailor.controller.phases",
    "sailor.controller.node_health",
    "sailor.agent.agent_config",
    "sailor.coordination.endpoints",
    "sailor.coordination.security",
)
_FIELD = re.compile(r"`([A-Z]\w*)\.([a-z_]\w*\*?)")


def schema_models() -> dict[str, type]:
    """The pydantic models of the schemas and of the daemons' configs, by class name."""
    import importlib
    import inspect
    import pkgutil

    from pydantic import BaseModel

    import sailor.schemas

    names = [m.name for m in pkgutil.iter_modules(sailor.schemas.__path__, "sailor.schemas.")]
    out: dict[str, type] = {}
    for name in (*names, *_MODEL_MODULES):
        for cls_name, cls in inspect.getmembers(importlib.import_module(name), inspect.isclass):
            if issubclass(cls, BaseModel) and cls.__module__.startswith("sailor."):
                out[cls_name] = cls
    return out


def field_problems(line: str, models: dict[str, type]) -> list[str]:
    """``Model.field`` where Model is a schema or config model and field is none of its
    fields or attributes (``Model.prefix_*``: some field starts so)."""
    problems: list[str] = []
    for m in _FIELD.finditer(line):
        cls = models.get(m.group(1))
        if cls is None:
            continue
        attr = m.group(2)
        fields = set(getattr(cls, "model_fields", {}))
        if attr.endswith("*"):
            ok = any(f.startswith(attr[:-1]) for f in fields)
        else:
            ok = attr in fields or hasattr(cls, attr)
        if not ok:
            problems.append(f"{m.group(1)} has no field {attr!r}")
    return problems


def test_schema_and_config_fields_named_in_docs_exist() -> None:
    models = schema_models()
    assert {"ControllerConfig", "AgentConfig", "TrainingConfig", "Plan"} <= set(models)
    problems = [
        f"{_where(doc, number)}: {p}"
        for doc in doc_files()
        for number, line, _ in _lines(doc)
        for p in field_problems(line, models)
    ]
    assert not problems, "\n".join(problems)
    assert field_problems("`ControllerConfig.keep_checkpoints` (default 1)", models) == []
    assert field_problems("`HostSharing.allreduce_after_*`", models) == []
    assert field_problems("`CalibrationRecord.p2p_fixed_s`", models) == [
        "CalibrationRecord has no field 'p2p_fixed_s'"
    ]
