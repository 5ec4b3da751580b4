"""The training config: defaults, refusals naming field and value, the LR curve, decay groups."""

from __future__ import annotations

import math

import pytest

from sailor.schemas.training import (
    IndexedData,
    OptimizerConfig,
    ScheduleConfig,
    SpecFileModel,
    TrainingConfig,
    parse_training_config,
)

BASE = "model: {kind: builtin, name: tiny-gpt}\n"


def test_minimal_config_has_defaults() -> None:
    tc = parse_training_config(BASE, "run.yaml")
    assert tc.data.kind == "synthetic" and tc.precision == "auto"
    assert tc.optimizer.lr == 1e-3 and tc.clipping.max_norm is None
    assert tc.lr_at(0) == tc.lr_at(10_000) == 1e-3
    assert TrainingConfig.model_validate_json(tc.model_dump_json()) == tc


def test_full_config_parses_from_json() -> None:
    text = """{
      "model": {"kind": "spec", "path": "model.json"},
      "data": {"kind": "indexed", "prefix": "data/pydocs"},
      "seed": 3,
      "optimizer": {"lr": 3e-4, "betas": [0.9, 0.99], "weight_decay": 0.1},
      "schedule": {"warmup_steps": 10, "decay": "linear", "min_lr_ratio": 0.1, "total_steps": 100},
      "precision": "bf16",
      "clipping": {"max_norm": 1.0},
      "eval": {"every_steps": 50, "batches": 2},
      "checkpoint": {"dir": "ckpt", "every_steps": 25, "keep": 3},
      "metrics": {"jsonl": "metrics.jsonl", "tensorboard_dir": "tb"}
    }"""
    tc = parse_training_config(text, "run.json")
    assert isinstance(tc.model, SpecFileModel) and isinstance(tc.data, IndexedData)
    assert tc.optimizer.betas == (0.9, 0.99) and tc.checkpoint.keep == 3


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("optimizer: {lr: -1}", "run.yaml: optimizer.lr=-1: Input should be greater than 0"),
        ("optimizr: {lr: 1}", "run.yaml: optimizr={'lr': 1}: Extra inputs are not permitted"),
        ("optimizer: {betas: [0.9, 1.5]}", "optimizer.betas[1]=1.5: must be in [0, 1)"),
        ("precision: fp8", "run.yaml: precision='fp8': Input should be 'auto', 'fp32'"),
        ("schedule: {decay: cosine}", "schedule.total_steps=None: is required by decay='cosine'"),
        (
            "schedule: {warmup_steps: 20, decay: linear, total_steps: 10}",
            "schedule.warmup_steps=20: must be below total_steps=10 for decay='linear'",
        ),
        (
            "schedule: {min_lr_ratio: 1.5}",
            "schedule.min_lr_ratio=1.5: Input should be less than or equal to 1",
        ),
        ("optimizer: {no_decay: [ln1]}", "optimizer.no_decay[0]='ln1': Input should be 'bias'"),
        ("checkpoint: {every_steps: 5}", "checkpoint.every_steps=5: needs a checkpoint 'dir'"),
        (
            "data: {kind: indexed, prefix: d, manifest: d.json, validation_fraction: 0.1}",
            "data.validation_fraction=0.1: must stay 0 when a manifest gives the splits",
        ),
        ("data: {kind: indexed}", "run.yaml: data.prefix: Field required"),
        ("clipping: {max_norm: 0}", "clipping.max_norm=0: Input should be greater than 0"),
        (
            "metrics: {tensorboard_dir: 's3://b/tb'}",
            "metrics.tensorboard_dir='s3://b/tb': must be a local path",
        ),
    ],
)
def test_refusals_name_field_and_value(body: str, message: str) -> None:
    with pytest.raises(ValueError) as err:
        parse_training_config(BASE + body + "\n", "run.yaml")
    assert message in str(err.value), str(err.value)


def test_model_source_refusals() -> None:
    with pytest.raises(ValueError, match=r"model.path=None: give exactly one of 'path' and 'spec'"):
        parse_training_config("model: {kind: spec}\n", "run.yaml")
    with pytest.raises(ValueError, match="Input tag 'hf' found using 'kind'"):
        parse_training_config("model: {kind: hf, path: x}\n", "run.yaml")
    with pytest.raises(ValueError, match=r"run.json: not valid JSON"):
        parse_training_config("{", "run.json")
    with pytest.raises(ValueError, match="a training config is a mapping, got list"):
        parse_training_config("- 1\n", "run.yaml")


def test_schedule_curve() -> None:
    s = ScheduleConfig(warmup_steps=4, decay="cosine", min_lr_ratio=0.1, total_steps=12)
    assert [s.lr_at(i, 1.0) for i in range(5)] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert math.isclose(s.lr_at(8, 1.0), 0.1 + 0.9 * 0.5)  # half way: cos(pi/2) = 0
    assert s.lr_at(12, 1.0) == s.lr_at(50, 1.0) == pytest.approx(0.1)
    lin = ScheduleConfig(decay="linear", total_steps=10)
    assert [lin.lr_at(i, 2.0) for i in (0, 5, 10, 11)] == [2.0, 1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="step=-1: must be >= 0"):
        s.lr_at(-1, 1.0)


def test_weight_decay_groups() -> None:
    o = OptimizerConfig()
    assert o.decays("3.attn_q.weight") and o.decays("0.wte.weight")
    assert not o.decays("3.attn_q.bias") and not o.decays("3.ln1.weight")
    assert not o.decays("5.norm.weight")
    assert OptimizerConfig(no_decay=()).decays("3.attn_q.bias")
    tied = OptimizerConfig(no_decay=("embedding",))
    assert not tied.decays("7.lm_head.weight", tied=True) and tied.decays("7.lm_head.weight")


def test_deploy_example_is_valid() -> None:
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "deploy/config/training.example.yaml"
    tc = parse_training_config(path.read_text(), str(path))
    assert isinstance(tc.data, IndexedData) and tc.schedule.decay == "cosine"
    assert tc.lr_at(0) == 0.0 and tc.lr_at(100) == pytest.approx(1e-3)


def test_the_worker_keeps_a_checkpoint_url_as_it_is() -> None:
    """The periodic checkpoint root is taken from the config's directory when relative; an
    absolute path or a URL (an object store every node reaches) stays as it is."""
    from pathlib import Path

    from sailor.megatron_patch.rank_main import _under

    base = Path("/run/gen-3")
    assert _under(base, "ckpt") == "/run/gen-3/ckpt"
    assert _under(base, "/shared/ckpt") == "/shared/ckpt"
    assert _under(base, "s3://bucket/periodic") == "s3://bucket/periodic"
