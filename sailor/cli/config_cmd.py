"""``sailor config check FILE``: validate a daemon's (or a training) config file before
deploying it.

The file is read exactly as the daemon reads it (YAML, TOML or JSON by suffix, through
``sailor.controller.config.load_mapping``) and validated by the daemon's own schema
(``ControllerConfig`` or ``AgentConfig``), so a file that passes here is one the daemon
starts with; a controller config's ``training`` file is read and validated too, as the
controller does at start, and (unless ``--no-files``) the security files a daemon config
names must exist and be readable, as the daemon checks at start, and a controller config's
cost inputs (model, profiles, network, prices, calibration) must load as the controller
loads them at start, one problem per field. Which kind: ``--kind``,
else the file's shape: an agent config must have a ``node:`` section, a training config
(``--kind training``, read as the controller reads its ``training:`` file) has ``data:`` or
``optimizer:``, and a controller config has none of these. (The schemas forbid unknown
keys, so a ``kind:`` key inside the file would make the daemon refuse it; the kind is not
written there.)

Exit codes: 0 valid; 1 invalid (every error printed with its field and value); 2 the file
cannot be read or parsed, or the kind is unknown. Never connects to NATS or etcd.
"""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Any

import typer
from pydantic import BaseModel, ValidationError

from sailor.cli._io import fail
from sailor.schemas.redact import redact_text

__all__ = ["Kind", "check_config", "config_app"]

config_app = typer.Typer(help="Daemon config files.", no_args_is_help=True)


class Kind(StrEnum):
    controller = "controller"
    agent = "agent"
    training = "training"


def _schema(kind: Kind) -> type[BaseModel]:
    if kind is Kind.training:
        from sailor.schemas.training import TrainingConfig

        return TrainingConfig
    if kind is Kind.agent:
        from sailor.agent.agent_config import AgentConfig

        return AgentConfig
    from sailor.controller.config import ControllerConfig

    return ControllerConfig


def _field(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def _errors(exc: ValidationError) -> list[str]:
    lines = []
    for err in exc.errors(include_url=False):
        where = _field(tuple(err["loc"]))
        if err["type"] == "missing":
            lines.append(f"{where}: required field is missing")
        else:
            lines.append(f"{where}: {err['msg']} (value: {err.get('input')!r})")
    return [redact_text(line) for line in lines]  # a NATS URL's password is not echoed


def _extra_checks(kind: Kind, cfg: Any, path: Path, files: bool) -> list[str]:
    """Checks the schema cannot express but the daemon would fail on at start-up (with
    ``files``: the security files it names exist and are readable)."""
    lines: list[str] = []
    if kind is Kind.training:
        from sailor.controller.training import TrainingConfigError, load_training

        try:
            load_training(path)  # as the controller reads it: paths anchored, data checked
        except TrainingConfigError as exc:
            lines += str(exc).splitlines()
        return lines
    if files:
        from sailor.cli.runtime_cmd import security_file_problems

        lines += security_file_problems(cfg.anchored(path).security)
    if kind is Kind.controller and files:
        lines += _cost_input_problems(cfg.anchored(path))
    if kind is Kind.controller and cfg.training is not None:
        from sailor.controller.training import (
            TrainingConfigError,
            check_checkpoint_dirs,
            load_training,
        )

        anchored = cfg.anchored(path)
        training = anchored.training
        try:
            check_checkpoint_dirs(training, anchored.checkpoint_dir, load_training(training))
        except TrainingConfigError as exc:
            for line in str(exc).splitlines():
                lines.append(f"training: {line} (value: {str(cfg.training)!r})")
    if kind is Kind.agent:
        from sailor.agent.watchers import make_watcher
        from sailor.coordination import SystemClock

        for i, w in enumerate(cfg.watchers):
            try:
                make_watcher(w.kind, w.target, SystemClock())
            except ValueError as exc:
                lines.append(f"watchers[{i}].kind: {exc} (value: {w.kind!r})")
    return lines


def _against_controller(node: Any, controller: Path) -> list[str]:
    """Why the planner of the ``controller`` config cannot use ``node`` (an agent config's),
    as that controller judges it (``controller/plannable.py``: it would leave the node out):
    an unknown GPU type, one without a price; none for the stand-in planner."""
    from sailor.controller.config import ControllerConfig, load_mapping
    from sailor.controller.planning.in_process import planner_reach_of

    try:
        cfg = ControllerConfig.model_validate(load_mapping(controller)).anchored(controller)
        reach = planner_reach_of(cfg)
    except Exception as exc:  # any reason the controller would not start with it
        return [f"--controller {controller}: cannot load it: {_one_line(exc)}"]
    why = reach.why_not(node.gpu_type, node.zone, node.gpus, node.spot) if reach else ""
    if not why:
        return []
    return [
        f"node: the planner of {controller} cannot use this node ({why}; value: "
        f"gpu_type={node.gpu_type!r}, gpus={node.gpus}, zone={node.zone!r}): that "
        "controller would leave it out; use a catalog GPU type (`sailor catalog gpus`) or "
        "give the controller a profile and a price of it"
    ]


def _cost_input_problems(cfg: Any) -> list[str]:
    """The model, profiles, network, prices and calibration of a controller config, each
    loaded as the controller loads them at start (``load_cost_inputs``), one problem per
    field."""
    import tomllib

    import yaml

    from sailor.controller.planning.in_process import load_cost_inputs, load_model_spec

    bad = (OSError, ValueError, KeyError, yaml.YAMLError, tomllib.TOMLDecodeError)
    try:
        load_model_spec(cfg.model, cfg.global_batch_size)
    except bad as exc:
        return [f"model: {str(exc).strip(chr(34))} (value: {cfg.model!r})"]
    lines = []
    files: list[tuple[str, Any, dict[str, Any]]] = [
        *((f"profiles[{i}]", p, {"profiles": (p,)}) for i, p in enumerate(cfg.profiles)),
        ("network", cfg.network, {"network": cfg.network}),
        ("prices", cfg.prices, {"prices": cfg.prices}),
        ("calibration", cfg.calibration, {"calibration": cfg.calibration}),
    ]
    for field, value, one in files:
        if not value:
            continue
        try:
            load_cost_inputs(cfg.model, cfg.global_batch_size, **one)
        except bad as exc:
            lines.append(f"{field}: {_one_line(exc)} (value: {str(value)!r})")
    return lines


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, ValidationError):
        return f"not a valid {exc.title}: " + "; ".join(_errors(exc)[:4])
    text = " ".join(str(exc).split())
    return text[:400] + ("..." if len(text) > 400 else "")


def warnings_of(data: dict[str, Any]) -> list[str]:
    """What an agent config (``data``, as read) may get wrong without the check being able
    to tell: a GPU type the catalog does not know. A warning, not an error: the controller
    plans such a type when its config gives a profile of it, and an agent config alone does
    not say which controller it joins; with ``--controller`` the check judges the node by
    that controller's planner (:func:`_against_controller`), and an unknown type is an
    error."""
    from sailor import catalog
    from sailor.schemas.device_kind import is_cpu_type

    node = data.get("node")
    g = node.get("gpu_type") if isinstance(node, dict) else None
    if isinstance(g, str) and not is_cpu_type(g) and g not in catalog.gpus():
        return [
            f"node.gpu_type={g!r} is not a catalog GPU type (`sailor catalog gpus`): the "
            "controller plans it only with a profile of it (ControllerConfig.profiles), "
            "else leaves the node out; `--controller CONTROLLER.yaml` checks it against "
            "the controller's config"
        ]
    return []


def check_config(
    path: Path, kind: Kind | None = None, files: bool = True, controller: Path | None = None
) -> tuple[int, Kind | None, list[str]]:
    """(exit code, kind, messages) for one file; see the module docstring for the codes.
    ``controller``: for an agent config, the controller config whose planner judges the
    node (:func:`_against_controller`)."""
    code, kind, messages, _ = _checked(path, kind, files, controller)
    return code, kind, messages


def _checked(
    path: Path, kind: Kind | None, files: bool, controller: Path | None = None
) -> tuple[int, Kind | None, list[str], dict[str, Any] | None]:
    """:func:`check_config`, plus the mapping read from the file (None if unreadable)."""
    from sailor.controller.config import load_mapping

    try:
        data = load_mapping(path)
    except (OSError, ValueError) as exc:  # yaml/toml/json errors are ValueError subclasses
        return 2, kind, [f"{path}: cannot read: {exc}"], None
    except Exception as exc:  # yaml.YAMLError is not a ValueError
        return 2, kind, [f"{path}: cannot parse: {exc}"], None
    if kind is None:
        kind = _kind_of(data)
    try:
        cfg = _schema(kind).model_validate(data)
    except ValidationError as exc:
        return 1, kind, _errors(exc), data
    extra = _extra_checks(kind, cfg, path, files)
    node = getattr(cfg, "node", None) if kind is Kind.agent else None
    if controller is not None and node is not None:
        extra += _against_controller(node, controller)
    return (1 if extra else 0), kind, extra, data


def _kind_of(data: dict[str, Any]) -> Kind:
    """An agent config has a ``node:`` section; a training config ``data:`` or
    ``optimizer:`` (neither daemon config has those keys); anything else is a controller's."""
    if "node" in data:
        return Kind.agent
    if "data" in data or "optimizer" in data:
        return Kind.training
    return Kind.controller


@config_app.command("check")
def check(
    file: Path = typer.Argument(..., help="Config file (.yaml, .toml or .json)."),
    kind: Kind | None = typer.Option(
        None,
        "--kind",
        help="What the file is (default: agent with a node: section, training with data: "
        "or optimizer:, else controller).",
    ),
    files: bool = typer.Option(
        True,
        "--files/--no-files",
        help="Check that the security files the config names exist and are readable (as the "
        "daemon does at start); --no-files before the certificates are issued.",
    ),
    controller: Path | None = typer.Option(
        None,
        "--controller",
        help="For an agent config: the controller config it joins; its node is then an "
        "error where that controller's planner cannot use it (an unknown GPU type, no "
        "price), not a warning.",
    ),
) -> None:
    """Validate a controller, agent or training config file; print OK or every error."""
    code, found, messages, data = _checked(file, kind, files, controller)
    if found is Kind.agent and data is not None and controller is None:
        for w in warnings_of(data):
            typer.echo(f"warning: {file}: {w}", err=True)
    if code == 0:
        typer.echo(f"{file}: OK ({found.value if found else '?'} config)")
        return
    if code == 2:  # cannot read or parse: one message, naming the file
        raise fail(f"{'; '.join(messages)}: pass a readable YAML, TOML or JSON config", code)
    label = f" ({found.value} config)" if found else ""
    for m in messages:
        typer.echo(f"{file}{label}: {m}", err=True)
    raise fail(f"{file}: {len(messages)} error(s), listed above: fix the fields named", code)
