"""``sailor config check``: the shipped examples pass; broken files name field and value."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from sailor.cli.config_cmd import Kind, check_config
from sailor.cli.main import app
from sailor.localnet import free_port

ROOT = Path(__file__).resolve().parents[2]
CONTROLLER = ROOT / "deploy/config/controller.example.yaml"
AGENT = ROOT / "deploy/config/agent.example.yaml"


def _run(*args: str) -> tuple[int, str]:
    res = CliRunner().invoke(app, ["config", "check", *args])
    return res.exit_code, res.output


TRAINING = ROOT / "deploy/config/training.example.yaml"


@pytest.mark.parametrize(
    ("path", "kind"), [(CONTROLLER, "controller"), (AGENT, "agent"), (TRAINING, "training")]
)
def test_examples_pass(path: Path, kind: str) -> None:
    # --no-files: the examples name /etc/sailor/pki files this machine does not have
    code, out = _run("--no-files", str(path))
    assert code == 0, out
    assert f"OK ({kind} config)" in out
    code, out = _run("--no-files", "--kind", kind, str(path))
    assert code == 0, out


@pytest.mark.parametrize("path", [CONTROLLER, AGENT])
def test_missing_security_files_fail_the_check_as_they_fail_the_start(path: Path) -> None:
    """The daemon refuses to start without its CA, certificate, key and login: so does the
    check its unit runs first (before, it said OK and the start failed)."""
    code, out = _run(str(path))
    assert code == 1, out
    assert "security.ca_file='/etc/sailor/pki/ca.crt': no such file" in out
    assert "security.key_file=" in out


def test_a_training_config_is_checked_as_the_controller_reads_it(tmp_path: Path) -> None:
    data = yaml.safe_load(TRAINING.read_text())
    data["optimizer"]["lr"] = -1
    bad = tmp_path / "training.yaml"
    bad.write_text(yaml.safe_dump(data))
    code, out = _run(str(bad))
    assert code == 1 and "(training config)" in out and "optimizer.lr" in out, out


def test_examples_are_documented_line_by_line() -> None:
    """Every top-level key of the examples carries a comment (the file is the reference)."""
    for path in (CONTROLLER, AGENT):
        text = path.read_text()
        assert text.startswith("#")
        for key in yaml.safe_load(text):
            line = next(ln for ln in text.splitlines() if ln.startswith(f"{key}:"))
            before = text.splitlines()[text.splitlines().index(line) - 1]
            assert "#" in line or before.startswith("#") or key in {"node", "deadlines"}, key


@pytest.mark.parametrize(
    ("path", "kind"), [(CONTROLLER, "controller"), (AGENT, "agent"), (TRAINING, "training")]
)
def test_examples_show_every_top_level_field(path: Path, kind: str) -> None:
    """The examples are the reference the docs send operators to ("every key commented",
    "shows every field"): each top-level field of the schema is in the file, set or as a
    commented ``# field:`` line. Before, the training example left out
    ``allow_precision_change`` and ``nonfinite``, the controller's ``planner_process`` and
    ``risk``, the agent's ``cpu_quota_period_ms``."""
    from sailor.agent.agent_config import AgentConfig
    from sailor.controller.config import ControllerConfig
    from sailor.schemas.training import TrainingConfig

    model = {"controller": ControllerConfig, "agent": AgentConfig, "training": TrainingConfig}
    text = path.read_text()
    keys = set(yaml.safe_load(text))
    commented = {ln[2:].split(":")[0] for ln in text.splitlines() if ln.startswith("# ")}
    missing = sorted(set(model[kind].model_fields) - {"schema_version"} - keys - commented)
    assert not missing, f"{path.name} leaves out {missing}"


def _unmarked(value: Any, default: Any, key: str, lines: list[str], at: int) -> list[str]:
    """The dotted keys under ``key`` (its line at index ``at``) whose value is away from the
    default without "deployment" on their line; a section is looked into unless its own line
    is marked."""
    if value == default or "deployment" in lines[at]:
        return []
    if not (isinstance(value, dict) and isinstance(default, dict)):
        return [key]
    out: list[str] = []
    for sub, v in value.items():
        line = next(i for i in range(at + 1, len(lines)) if lines[i].lstrip().startswith(f"{sub}:"))
        out += _unmarked(v, default.get(sub), f"{key}.{sub}", lines, line)
    return out


@pytest.mark.parametrize("path", [CONTROLLER, AGENT])
def test_example_values_are_the_defaults_unless_marked(path: Path) -> None:
    """Both examples say "the values below are the defaults unless marked 'deployment'": a
    value away from the schema's default says so on its line. Before, the controller's
    ``in_place: true`` (default false), the agent's ``watchers`` and ``warm_spares: 1``
    (default 0) and both ``security`` sections were unmarked."""
    from sailor.agent.agent_config import AgentConfig
    from sailor.controller.config import ControllerConfig

    text = path.read_text()
    lines = text.splitlines()
    data = yaml.safe_load(text)
    model = AgentConfig if path == AGENT else ControllerConfig
    required = {"node": data["node"]} if path == AGENT else {}
    defaults = model.model_validate(required).model_dump(mode="json")
    unmarked: list[str] = []
    for key, value in data.items():
        if key in required:
            continue
        ours = model.model_validate({**required, key: value}).model_dump(mode="json")[key]
        at = next(i for i, ln in enumerate(lines) if ln.startswith(f"{key}:"))
        unmarked += _unmarked(ours, defaults[key], key, lines, at)
    assert not unmarked, f"{path.name}: away from the default, not marked 'deployment': {unmarked}"


def test_broken_controller_names_every_field_and_value(tmp_path: Path) -> None:
    data = yaml.safe_load(CONTROLLER.read_text())
    data["lease_ttl_s"] = 0
    data["deadlines"]["load"] = -5
    data["objective"] = "speed"
    data["leader_ttl"] = 3
    bad = tmp_path / "controller.yaml"
    bad.write_text(yaml.safe_dump(data))
    code, out = _run(str(bad))
    assert code == 1
    assert "lease_ttl_s:" in out and "(value: 0)" in out
    assert "deadlines.load:" in out and "(value: -5)" in out
    assert "objective:" in out and "'speed'" in out
    assert "leader_ttl:" in out and "(value: 3)" in out
    assert "4 error(s)" in out


def test_broken_agent_names_nested_fields(tmp_path: Path) -> None:
    data = yaml.safe_load(AGENT.read_text())
    data["node"]["gpus"] = 0
    del data["node"]["zone"]
    data["watchers"] = [{"kind": "gce", "target": "http://metadata.google.internal"}]
    bad = tmp_path / "agent.yaml"
    bad.write_text(yaml.safe_dump(data))
    code, out = _run(str(bad))
    assert code == 1
    assert "node.gpus:" in out and "(value: 0)" in out
    assert "node.zone: required field is missing" in out
    # the schema accepts any watcher kind; the check catches what the agent would refuse
    data["node"]["gpus"] = 1
    data["node"]["zone"] = "z"
    bad.write_text(yaml.safe_dump(data))
    code, messages = check_config(bad, files=False)[0], check_config(bad, files=False)[2]
    assert code == 1 and messages == [
        "watchers[0].kind: watcher kind='gce': must be gcp, aws, azure or file (value: 'gce')"
    ]


def test_kind_detection_and_option(tmp_path: Path) -> None:
    assert check_config(AGENT)[1] is Kind.agent
    assert check_config(CONTROLLER)[1] is Kind.controller
    # an agent file checked as a controller config: `node` is not a controller field
    code, kind, messages = check_config(AGENT, Kind.controller)
    assert code == 1 and kind is Kind.controller
    assert any(m.startswith("node: Extra inputs are not permitted") for m in messages)
    empty = tmp_path / "agent.yaml"
    empty.write_text("job: x\n")
    code, _, messages = check_config(empty, Kind.agent)
    assert code == 1 and messages == ["node: required field is missing"]


def test_toml_and_json_are_read_like_the_daemons_do(tmp_path: Path) -> None:
    toml = tmp_path / "controller.toml"
    toml.write_text('job = "j"\nlease_ttl_s = 5\n[deadlines]\nload = 300.0\n')
    assert check_config(toml)[0] == 0
    js = tmp_path / "agent.json"
    js.write_text('{"node": {"node_id": "n", "gpu_type": "cpu", "gpus": 1, "zone": "z"}}')
    assert check_config(js)[:2] == (0, Kind.agent)
    # `sailor check --config` reads a daemon's config as the daemon does (it took a TOML
    # file for JSON and refused it); unreachable servers, not an unreadable file
    agent = tmp_path / "agent.toml"
    agent.write_text(
        f'nats_urls = ["nats://127.0.0.1:{free_port()}"]\n'
        f'etcd_endpoints = ["127.0.0.1:{free_port()}"]\n'
        '[node]\nnode_id = "n"\ngpu_type = "cpu"\ngpus = 1\nzone = "z"\n'
    )
    res = CliRunner().invoke(app, ["check", "--config", str(agent), "--json", "--timeout", "1"])
    assert res.exit_code == 1 and '"nats"' in res.stdout, res.output


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("missing.yaml", None),
        ("list.yaml", "- a\n- b\n"),
        ("bad.yaml", "a: [1\n"),
        ("bad.toml", "a = \n"),
    ],
)
def test_unreadable_files_exit_2(tmp_path: Path, name: str, text: str | None) -> None:
    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    code, out = _run(str(path))
    assert code == 2, out
    assert str(path) in out


def test_unknown_kind_is_a_usage_error() -> None:
    code, _ = _run("--kind", "worker", str(AGENT))
    assert code == 2


def test_a_gpu_type_the_catalog_lacks_is_a_warning(tmp_path: Path) -> None:
    """A typo'd GPU type passes the schema (a profile may define a new type) but is named."""
    data = yaml.safe_load(AGENT.read_text())
    data["node"]["gpu_type"] = "A100-41"
    f = tmp_path / "agent.yaml"
    f.write_text(yaml.safe_dump(data))
    res = CliRunner().invoke(app, ["config", "check", "--no-files", str(f)])
    assert res.exit_code == 0
    assert "warning:" in res.stderr and "node.gpu_type='A100-41'" in res.stderr
    data["node"]["gpu_type"] = "cpu-slow"
    f.write_text(yaml.safe_dump(data))
    again = CliRunner().invoke(app, ["config", "check", "--no-files", str(f)])
    assert "warning" not in again.stderr


def test_cost_inputs_load_as_the_controller_loads_them(tmp_path: Path) -> None:
    """A controller config naming an unknown model, a missing price file, a pool where a
    profile belongs or a broken calibration said OK, and the controller did not start."""
    pool = ROOT / "sailor/catalog/examples/pool-hetero.yaml"
    (tmp_path / "cal.json").write_text('{"gpus": {"A100-40": {"network_efficiency": -1}}}')
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"prices: {tmp_path}/missing.json\nprofiles: [{pool}]\ncalibration: cal.json\n")
    code, out = _run("--kind", "controller", str(cfg))
    assert code == 1, out
    assert "profiles[0]: not a valid ProfileDB" in out and "pool-hetero.yaml" in out
    assert "prices: [Errno 2] No such file or directory" in out
    assert "calibration: not a valid Calibration" in out  # anchored beside the config
    cfg.write_text("model: NoSuchModel\n")
    code, out = _run("--kind", "controller", str(cfg))
    assert code == 1 and "model: model='NoSuchModel' is not in the catalog" in out, out
    cfg.write_text("model: OPT-350\n")
    assert _run("--kind", "controller", str(cfg)) == (0, f"{cfg}: OK (controller config)\n")


def test_periodic_checkpoints_may_not_share_the_controllers_directory(tmp_path: Path) -> None:
    """Their retention keeps the newest ``keep`` commits on disk and deleted the checkpoint
    the controller had recorded and would resume from. Refused by the check and at the
    controller's start, naming both."""
    from sailor.controller.config import ControllerConfig
    from sailor.controller.daemon import Controller
    from sailor.controller.training import TrainingConfigError

    data = yaml.safe_load(TRAINING.read_text())
    data["checkpoint"] = {"dir": str(tmp_path / "ckpt"), "every_steps": 10, "keep": 2}
    training = tmp_path / "training.yaml"
    training.write_text(yaml.safe_dump(data))
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"training: training.yaml\ncheckpoint_dir: {tmp_path / 'ckpt'}/\n")
    code, out = _run("--kind", "controller", str(cfg))
    assert code == 1 and "is the controller's checkpoint_dir" in out, out
    with pytest.raises(TrainingConfigError, match=r"checkpoint\.dir="):
        Controller(ControllerConfig(training=training, checkpoint_dir=str(tmp_path / "ckpt")))
    cfg.write_text(f"training: training.yaml\ncheckpoint_dir: {tmp_path / 'other'}\n")
    code, out = _run("--kind", "controller", str(cfg))
    assert code == 0, out
