"""``anchor_training_paths``: a training config's relative paths made absolute, purely."""

from __future__ import annotations

import pytest

from sailor.schemas.training import (
    BuiltinModel,
    CheckpointConfig,
    HuggingFaceModel,
    IndexedData,
    MetricsConfig,
    SpecFileModel,
    SyntheticData,
    TrainingConfig,
)
from sailor.schemas.training_paths import anchor_training_paths

BASE = "/runs/job"


def test_every_relative_path_is_anchored_and_the_rest_kept() -> None:
    cfg = TrainingConfig(
        model=SpecFileModel(path="models/spec.json"),
        data=IndexedData(prefix="data/corpus", manifest="../shared/corpus.json"),
        checkpoint=CheckpointConfig(dir="ckpt", every_steps=10),
        metrics=MetricsConfig(jsonl="out/metrics-{rank}.jsonl", tensorboard_dir="out/tb"),
        seed=4,
    )
    out = anchor_training_paths(cfg, BASE)
    assert out.model == SpecFileModel(path="/runs/job/models/spec.json")
    assert out.data == IndexedData(
        prefix="/runs/job/data/corpus", manifest="/runs/job/../shared/corpus.json"
    )
    assert out.checkpoint.dir == "/runs/job/ckpt" and out.checkpoint.every_steps == 10
    assert out.metrics.jsonl == "/runs/job/out/metrics-{rank}.jsonl"
    assert out.metrics.tensorboard_dir == "/runs/job/out/tb"
    assert out.seed == 4 and out.optimizer == cfg.optimizer
    assert anchor_training_paths(out, "/elsewhere") == out  # twice changes nothing
    assert cfg.data == IndexedData(prefix="data/corpus", manifest="../shared/corpus.json")


@pytest.mark.parametrize(
    "cfg",
    [
        TrainingConfig(model=BuiltinModel(name="tiny-gpt")),
        TrainingConfig(model=SpecFileModel(path="/abs/spec.json"), data=SyntheticData()),
        TrainingConfig(
            model=HuggingFaceModel(path="/models/gpt2"),
            data=IndexedData(prefix="/data/c"),
            checkpoint=CheckpointConfig(dir="s3://bucket/ckpt"),
            metrics=MetricsConfig(jsonl="/var/m.jsonl"),
        ),
    ],
)
def test_absolute_paths_urls_and_absent_paths_are_kept(cfg: TrainingConfig) -> None:
    assert anchor_training_paths(cfg, BASE) == cfg


def test_hugging_face_directory_is_anchored() -> None:
    cfg = TrainingConfig(model=HuggingFaceModel(path="hf/gpt2", load_weights=True))
    out = anchor_training_paths(cfg, BASE)
    assert out.model == HuggingFaceModel(path="/runs/job/hf/gpt2", load_weights=True)


def test_a_relative_base_is_refused_with_its_value() -> None:
    cfg = TrainingConfig(model=BuiltinModel(name="tiny-gpt"))
    with pytest.raises(ValueError, match="base_dir='runs': must be an absolute directory"):
        anchor_training_paths(cfg, "runs")
