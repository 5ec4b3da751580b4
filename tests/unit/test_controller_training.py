"""The controller's training config: loaded and anchored at start, an invalid one refused
before anything starts (the daemon, ``sailor controller``, ``sailor config check``), and the
toy trainer validating what the agent hands it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from sailor.agent import toy_trainer
from sailor.cli.main import app
from sailor.controller.config import ControllerConfig
from sailor.controller.daemon import Controller
from sailor.controller.training import TrainingConfigError, load_training
from sailor.coordination.security import SecurityConfig
from sailor.schemas.training import IndexedData, SpecFileModel

GOOD = """
model: {kind: spec, path: spec.json}
data: {kind: indexed, prefix: data/corpus}
metrics: {jsonl: out/m.jsonl}
"""
BAD = "model: {kind: builtin, name: tiny-gpt}\noptimizer: {lr: -0.5}\n"


def _controller_file(tmp: Path, training: str, text: str) -> Path:
    (tmp / "train").mkdir(exist_ok=True)
    (tmp / "train" / training).write_text(text)
    cfg = tmp / "controller.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "nats_urls": ["nats://127.0.0.1:9"],  # nothing listens: must not be reached
                "etcd_endpoints": ["127.0.0.1:9"],
                "audit_log": str(tmp / "audit.jsonl"),
                "planner": "data_parallel",
                "training": f"train/{training}",
            }
        )
    )
    return cfg


def test_load_training_anchors_paths_at_the_files_directory(tmp_path: Path) -> None:
    cfg_file = _controller_file(tmp_path, "run.yaml", GOOD)
    cfg = ControllerConfig.load(cfg_file)
    assert cfg.training == tmp_path / "train" / "run.yaml"  # relative to the config file
    t = load_training(cfg.training)
    assert t.model == SpecFileModel(path=f"{tmp_path}/train/spec.json")
    assert t.data == IndexedData(prefix=f"{tmp_path}/train/data/corpus")
    assert t.metrics.jsonl == f"{tmp_path}/train/out/m.jsonl"
    # a config built in code keeps its path (relative: the working directory)
    assert ControllerConfig(training=Path("x.yaml")).anchored(Path("/etc/c.yaml")).training == (
        Path("/etc/x.yaml")
    )
    assert ControllerConfig(training=Path("/a/x.yaml")).anchored(cfg_file).training == Path(
        "/a/x.yaml"
    )


def test_the_files_a_controller_reads_are_anchored_at_its_config() -> None:
    """Under systemd the working directory is ``/``: every input file given relative to the
    config file is read from its directory; absolute ones and outputs stay as given."""
    cfg = ControllerConfig(
        profiles=(Path("p/a.json"), Path("/abs/b.json")),
        network=Path("net.json"),
        prices=Path("/abs/prices.json"),
        calibration=Path("cal/c.json"),
        checkpoint_dir="ckpt",
        audit_log=Path("audit.jsonl"),
        model="models/gpt.yaml",
        security=SecurityConfig(
            ca_file=Path("pki/ca.pem"),
            cert_file=Path("/abs/c.pem"),
            key_file=Path("pki/c.key"),
            nats_login_file=Path("c.nats.json"),
        ),
    ).anchored(Path("/etc/sailor/controller.yaml"))
    assert cfg.profiles == (Path("/etc/sailor/p/a.json"), Path("/abs/b.json"))
    assert cfg.model == "/etc/sailor/models/gpt.yaml"
    assert cfg.security is not None
    assert cfg.security.ca_file == Path("/etc/sailor/pki/ca.pem")
    assert cfg.security.cert_file == Path("/abs/c.pem")
    assert cfg.security.key_file == Path("/etc/sailor/pki/c.key")
    assert cfg.security.nats_login_file == Path("/etc/sailor/c.nats.json")
    # a catalog model name is a name, not a path
    assert ControllerConfig(model="OPT-350").anchored(Path("/etc/x.yaml")).model == "OPT-350"
    assert cfg.network == Path("/etc/sailor/net.json")
    assert cfg.prices == Path("/abs/prices.json")
    assert cfg.calibration == Path("/etc/sailor/cal/c.json")
    assert cfg.checkpoint_dir == "ckpt" and cfg.audit_log == Path("audit.jsonl")


def test_an_invalid_training_config_stops_the_controller_before_it_starts(
    tmp_path: Path,
) -> None:
    cfg = ControllerConfig.load(_controller_file(tmp_path, "run.yaml", BAD))
    with pytest.raises(TrainingConfigError) as err:
        Controller(cfg)
    assert str(err.value) == (
        f"{tmp_path}/train/run.yaml: optimizer.lr=-0.5: Input should be greater than 0"
    )
    assert not (tmp_path / "audit.jsonl").exists()  # nothing was started, not even the log
    missing = cfg.model_copy(update={"training": tmp_path / "nope.yaml"})
    with pytest.raises(TrainingConfigError, match=r"nope\.yaml: cannot read the training config"):
        Controller(missing)


def test_sailor_controller_refuses_it_in_one_line_naming_file_field_and_value(
    tmp_path: Path,
) -> None:
    cfg_file = _controller_file(tmp_path, "run.json", json.dumps(yaml.safe_load(BAD)))
    res = CliRunner().invoke(app, ["controller", "--config", str(cfg_file)])
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1, res.output
    assert lines[0].startswith(f"error: {cfg_file}: training: {tmp_path}/train/run.json: ")
    assert "optimizer.lr=-0.5: Input should be greater than 0" in lines[0]


def test_config_check_validates_the_training_file(tmp_path: Path) -> None:
    cfg_file = _controller_file(tmp_path, "run.yaml", BAD)
    res = CliRunner().invoke(app, ["config", "check", str(cfg_file)])
    assert res.exit_code == 1, res.output
    assert "training: " in res.output and "optimizer.lr=-0.5" in res.output
    _controller_file(tmp_path, "run.yaml", GOOD)
    res = CliRunner().invoke(app, ["config", "check", str(cfg_file)])
    assert res.exit_code == 0, res.output


def test_toy_trainer_validates_the_config_it_is_handed(tmp_path: Path) -> None:
    bad = tmp_path / "training.json"
    bad.write_text(json.dumps(yaml.safe_load(BAD)))
    err = tmp_path / "error.json"
    args = ["--plan", "p", "--rank", "0", "--world-size", "1", "--control", str(tmp_path / "c")]
    code = toy_trainer.main([*args, "--error-file", str(err), "--train-config", str(bad)])
    assert code == 1
    assert "optimizer.lr=-0.5" in json.loads(err.read_text())["message"]


def test_a_checkpoint_url_without_its_filesystem_is_refused_at_load() -> None:
    """``gs://`` needs gcsfs: said when the config is read, not at the first save."""
    assert ControllerConfig(checkpoint_dir="s3://bucket/job").checkpoint_dir == "s3://bucket/job"
    assert ControllerConfig(checkpoint_dir="/shared/ckpt").checkpoint_dir == "/shared/ckpt"
    with pytest.raises(ValueError, match=r"checkpoint_dir='nosuch://b/x': no filesystem for"):
        ControllerConfig(checkpoint_dir="nosuch://b/x")


@pytest.mark.parametrize(
    ("periodic", "controller", "refused"),
    [
        ("/x/ckpt", "/x/ckpt/", True),
        ("file:///x/ckpt", "/x/ckpt", True),  # the same directory spelled as a URL
        ("/x/ckpt", "file:///x/./ckpt/", True),
        ("s3://b/ckpt/", "s3://b/ckpt", True),
        ("/x/periodic", "/x/ckpt", False),  # one mount, two directories: no collision
        ("s3://b/periodic", "s3://b/ckpt", False),
        ("s3://b/ckpt", "/b/ckpt", False),
    ],
)
def test_the_periodic_checkpoints_may_not_share_the_controllers_directory(
    periodic: str, controller: str, refused: bool
) -> None:
    """``checkpoint.dir`` is refused when it is the controller's ``checkpoint_dir``, however
    either is spelled. Before, a ``file://`` URL was compared as text with a plain path,
    and the periodic retention could delete the commit the controller resumes from."""
    from sailor.controller.training import check_checkpoint_dirs
    from sailor.schemas.training import parse_training_config

    text = GOOD + f"checkpoint: {{dir: '{periodic}', every_steps: 5}}\n"
    training = parse_training_config(text, "t")
    if refused:
        with pytest.raises(TrainingConfigError, match="checkpoint_dir"):
            check_checkpoint_dirs(Path("t.yaml"), controller, training)
    else:
        check_checkpoint_dirs(Path("t.yaml"), controller, training)
