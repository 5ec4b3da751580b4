"""The defaults the docs quote in prose equal the config schemas' own.

``test_docs_references.py`` checks that what the docs name exists; this checks the values an
operator reads off them ("default 3600 s", "(125 MiB/s", "an hour by default") against the
pydantic ``Field`` defaults they describe. Each case is a sentence of a doc, matched by a
pattern whose groups capture the quoted values, and the dotted schema fields they must equal;
a reworded sentence fails here (fix the pattern), a changed default fails here (fix the doc).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from sailor.agent.agent_config import AgentConfig
from sailor.checkpoint.cli import gc_cmd
from sailor.cli.certs_cmd import issue_cmd
from sailor.cli.demo.command import demo
from sailor.cli.profile_layers_cmd import layers_cmd
from sailor.cli.profile_network_cmd import network_cmd
from sailor.controller.config import ControllerConfig
from sailor.schemas.training import TrainingConfig

ROOT = Path(__file__).resolve().parents[2]

_UNITS = {"s": 1.0, "h": 3600.0, "ms": 1.0, "MiB/s": 1.0, "days": 1.0, "KiB": 1 << 10}
_UNITS["MiB"] = 1 << 20
_WORDS = {"an hour": 3600.0, "none": None}


def schema_default(model: type[BaseModel], dotted: str) -> Any:
    """The default of ``model``'s field at ``dotted`` (``deadlines.derive.max_s``), through
    nested models' default factories."""
    head, _, rest = dotted.partition(".")
    info = model.model_fields[head]
    if not rest:
        return info.get_default(call_default_factory=True)
    sub = info.annotation
    assert isinstance(sub, type) and issubclass(sub, BaseModel), (model.__name__, head, sub)
    return schema_default(sub, rest)


def quoted(text: str) -> Any:
    """A value as the prose writes it: ``3600``, ``3 h``, ``2^16``, ``an hour``, ``exec``."""
    text = text.strip()
    if text in _WORDS:
        return _WORDS[text]
    if m := re.fullmatch(r"2\^(\d+)", text):
        return int(m.group(1))  # a scale quoted as its power: the field is the exponent
    if m := re.fullmatch(r"([\d.,]+)\s*(\S+)?", text):
        number = float(m.group(1).replace(",", ""))
        return number * _UNITS.get(m.group(2) or "s", 1.0)
    if text in ("true", "false"):
        return text == "true"
    return text


# (doc, pattern with one group per value, the model, the dotted field of each group)
CASES: list[tuple[str, str, type[BaseModel], tuple[str, ...]]] = [
    (
        "docs/runtime.md",
        r"`checkpoint_every_s` \(controller\s+config; default (\d+ s)",
        ControllerConfig,
        ("checkpoint_every_s",),
    ),
    (
        "docs/operations.md",
        r"`checkpoint_every_s`, (an hour) by default",
        ControllerConfig,
        ("checkpoint_every_s",),
    ),
    (
        "docs/checkpoint.md",
        r"`ControllerConfig\.keep_checkpoints` \(default (\d+);",
        ControllerConfig,
        ("keep_checkpoints",),
    ),
    (
        "docs/runtime.md",
        r"`event_stream_deadline_s`\s+\(default (\d+ s);",
        ControllerConfig,
        ("event_stream_deadline_s",),
    ),
    (
        "docs/operations.md",
        r"`event_stream_deadline_s` \((\d+ s)\)",
        ControllerConfig,
        ("event_stream_deadline_s",),
    ),
    (
        "docs/runtime.md",
        r"`time_between_changes_s`,\s+default (\d+ s)",
        ControllerConfig,
        ("online_calibration.time_between_changes_s",),
    ),
    (
        "docs/runtime.md",
        r"by default \(`planner_process: (true|false)`\)",
        ControllerConfig,
        ("planner_process",),
    ),
    (
        "docs/runtime.md",
        r"QUIESCE (\d+ s), CHECKPOINT (\d+ s), LOAD and VERIFY (\d+ s)",
        ControllerConfig,
        ("deadlines.quiesce", "deadlines.checkpoint", "deadlines.load"),
    ),
    (
        "docs/runtime.md",
        r"LOAD and VERIFY (\d+ s)",
        ControllerConfig,
        ("deadlines.verify",),
    ),
    (
        "docs/runtime.md",
        r"\(`deadlines\.teardown`, (\d+ s)\)",
        ControllerConfig,
        ("deadlines.teardown",),
    ),
    (
        "docs/runtime.md",
        r"`write_mib_s` and `read_mib_s` \((\d+ MiB/s):",
        ControllerConfig,
        ("deadlines.derive.write_mib_s",),
    ),
    (
        "docs/runtime.md",
        r"`write_mib_s` and `read_mib_s` \((\d+ MiB/s):",
        ControllerConfig,
        ("deadlines.derive.read_mib_s",),
    ),
    (
        "docs/runtime.md",
        r"`safety` \((\d+)\), the start-up terms \((\d+), (\d+) and (\d+) s:",
        ControllerConfig,
        (
            "deadlines.derive.safety",
            "deadlines.derive.checkpoint_startup_s",
            "deadlines.derive.load_startup_s",
            "deadlines.derive.verify_startup_s",
        ),
    ),
    (
        "docs/runtime.md",
        r"`verify_steps` \((\d+)\), `max_s` \((\d+ h):",
        ControllerConfig,
        ("deadlines.derive.verify_steps", "deadlines.derive.max_s"),
    ),
    (
        "docs/runtime.md",
        r"up to `stretch_cap`, (\d+)\)",
        ControllerConfig,
        ("deadlines.stretch_cap",),
    ),
    (
        "docs/runtime.md",
        r"`stretch_max_s` \((\d+ h): twice",
        ControllerConfig,
        ("deadlines.stretch_max_s",),
    ),
    (
        "docs/runtime.md",
        r"`teardown_timeout_s` \((\d+ s),",
        AgentConfig,
        ("teardown_timeout_s",),
    ),
    (
        "docs/runtime.md",
        r"`AgentConfig\.cpu_quota_period_ms` \(default\s+(\d+) ms",
        AgentConfig,
        ("cpu_quota_period_ms",),
    ),
    (
        "docs/runtime.md",
        r"That is the default \(`AgentConfig\.cpu_quota_from: (\w+)`\)",
        AgentConfig,
        ("cpu_quota_from",),
    ),
    (
        "docs/training.md",
        r"`initial_scale_power` \((2\^\d+)\), `loss_scale_window` \((\d+) good steps",
        TrainingConfig,
        ("loss_scaling.initial_scale_power", "loss_scaling.loss_scale_window"),
    ),
    (
        "docs/training.md",
        r"`nonfinite\.max_skips` \|.*?\(default (\d+)\)",
        TrainingConfig,
        ("nonfinite.max_skips",),
    ),
    (
        "docs/training.md",
        r"`allow_precision_change` \|.*?\(default (true|false)\)",
        TrainingConfig,
        ("allow_precision_change",),
    ),
    (
        "docs/training.md",
        r"`allow_data_change` \|.*?\(default (true|false):",
        TrainingConfig,
        ("allow_data_change",),
    ),
    (
        "docs/checkpoint.md",
        r"`allow_data_change: true` in the training config \(default (true|false);",
        TrainingConfig,
        ("allow_data_change",),
    ),
]


def _id(case: tuple[str, str, type[BaseModel], tuple[str, ...]]) -> str:
    doc, _, model, fields = case
    return f"{Path(doc).stem}-{model.__name__}-{'+'.join(fields)}"


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_quoted_default_is_the_schema_default(
    case: tuple[str, str, type[BaseModel], tuple[str, ...]],
) -> None:
    doc, pattern, model, fields = case
    text = (ROOT / doc).read_text()
    m = re.search(pattern, text)
    assert m is not None, f"{doc}: no sentence matches {pattern!r} (reworded? fix the pattern)"
    line = text.count("\n", 0, m.start()) + 1
    for group, field in zip(m.groups(), fields, strict=True):
        want = schema_default(model, field)
        got = quoted(group)
        assert got == want, (
            f"{doc}:{line} quotes {field}={group!r}; the schema's default is {want!r}"
        )


def cli_default(command: Callable[..., Any], param: str) -> Any:
    """The default of a typer command's option (the function's parameter ``param``)."""
    return inspect.signature(command).parameters[param].default.default


# (doc, pattern with one group per value, the command, its parameter of each group)
CLI_CASES: list[tuple[str, str, Callable[..., Any], tuple[str, ...]]] = [
    (
        "docs/demo.md",
        r"`--steps N` \((\d+)\) steps between changes; `--nodes N` \((\d+), at least",
        demo,
        ("steps", "nodes"),
    ),
    (
        "docs/demo.md",
        r"`--notice-s` \((\d+)\); `--timeout-s` \((\d+)\) per wait",
        demo,
        ("notice_s", "timeout_s"),
    ),
    ("docs/demo.md", r"`--out DIR` \(`(\w+)`, ignored by git\)", demo, ("out",)),
    (
        "docs/checkpoint.md",
        r"`--grace S` \((\d+) by\s+default",
        gc_cmd,
        ("grace",),
    ),
    (
        "docs/operations.md",
        r"until it expires \((\d+ days) by default\)",
        issue_cmd,
        ("days",),
    ),
    (
        "docs/profiler.md",
        r"`--warmup (\d+)`, then at least `--min-reps (\d+)`",
        layers_cmd,
        ("warmup", "min_reps"),
    ),
    (
        "docs/profiler.md",
        r"from `--min-bytes` \((\d+ KiB)\) to `--max-bytes` \((\d+ MiB)\s+by default",
        network_cmd,
        ("min_bytes", "max_bytes"),
    ),
]


def _cli_id(case: tuple[str, str, Callable[..., Any], tuple[str, ...]]) -> str:
    doc, _, command, params = case
    return f"{Path(doc).stem}-{command.__name__}-{'+'.join(params)}"


@pytest.mark.parametrize("case", CLI_CASES, ids=[_cli_id(c) for c in CLI_CASES])
def test_quoted_option_default_is_the_commands(
    case: tuple[str, str, Callable[..., Any], tuple[str, ...]],
) -> None:
    doc, pattern, command, params = case
    text = (ROOT / doc).read_text()
    m = re.search(pattern, text)
    assert m is not None, f"{doc}: no sentence matches {pattern!r} (reworded? fix the pattern)"
    line = text.count("\n", 0, m.start()) + 1
    for group, param in zip(m.groups(), params, strict=True):
        want = cli_default(command, param)
        got = quoted(group)
        if isinstance(want, Path):
            got = Path(group)
        assert got == want, f"{doc}:{line} quotes {param}={group!r}; the command's is {want!r}"


def test_the_parser_reads_what_the_docs_write() -> None:
    assert quoted("3600 s") == 3600.0
    assert quoted("3 h") == 3 * 3600.0
    assert quoted("an hour") == 3600.0
    assert quoted("2^16") == 16
    assert quoted("1,000") == 1000.0
    assert quoted("exec") == "exec"
    assert quoted("256 MiB") == 256 << 20
    assert quoted("false") is False
    assert schema_default(ControllerConfig, "deadlines.derive.max_s") == 3 * 3600.0
