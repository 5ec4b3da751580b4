"""The model and the training config a worker runs, from its arguments.

``--model`` (a tiny model name, a ModelSpec file, or a model file ``{"spec",
"architecture"}``) wins over the training config's model source (a catalog name, a
ModelSpec, or a local ``transformers`` directory), which wins over the plan's model name.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from sailor import catalog
from sailor.megatron_patch.architecture import Architecture
from sailor.megatron_patch.engine import TrainConfig
from sailor.megatron_patch.model import TINY_MODELS, tiny_model
from sailor.schemas.json_text import load_json
from sailor.schemas.model import ModelSpec
from sailor.schemas.plan import Plan
from sailor.schemas.training import (
    BuiltinModel,
    HuggingFaceModel,
    SpecFileModel,
    TrainingConfig,
    parse_training_config,
)

__all__ = ["load_architecture", "load_model", "load_train_config", "model_of", "train_config"]


def load_model(arg: str | None, plan: Plan) -> ModelSpec:
    """A ModelSpec from a JSON file, a tiny model name, or the plan's model name."""
    name = arg or plan.model
    if name in TINY_MODELS:
        return tiny_model(name, plan.global_batch_size)
    path = Path(name)
    if not path.exists():
        raise ValueError(f"--model={name!r}: neither a file nor a tiny model {sorted(TINY_MODELS)}")
    raw = load_json(path.read_text(), f"--model={name!r}")
    spec = ModelSpec.model_validate(raw["spec"] if "architecture" in raw else raw)
    if spec.global_batch_size != plan.global_batch_size:
        spec = spec.model_copy(update={"global_batch_size": plan.global_batch_size})
    return spec


def load_architecture(arg: str | None) -> Architecture | None:
    """The ``Architecture`` of a model file ``{"spec": ..., "architecture": ...}`` (written by
    ``hf.checkpoint.model_file``); None for a plain ModelSpec file or a tiny model."""
    if not arg or not Path(arg).is_file():
        return None
    raw = load_json(Path(arg).read_text(), f"--model={arg!r}")
    return Architecture(**raw["architecture"]) if "architecture" in raw else None


def load_train_config(path: str) -> TrainingConfig:
    """The training config of ``--train-config``; a wrong field is a ``ValueError`` naming
    the file, the field and its value (a configuration error: not retried)."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"--train-config={path!r}: cannot read ({exc.strerror or exc})") from exc
    return parse_training_config(text, path)


def train_config(tc: TrainingConfig | None, args: argparse.Namespace) -> TrainConfig:
    """The engine's ``TrainConfig``: from the training config, else ``--seed/--lr/
    --weight-decay`` with the engine's defaults."""
    if tc is None:
        return TrainConfig(seed=args.seed, lr=args.lr, weight_decay=args.weight_decay)
    return TrainConfig.of(tc)


def _config_model(
    tc: TrainingConfig, base: Path, plan: Plan
) -> tuple[ModelSpec, Architecture | None, Path | None]:
    """The model of the config's source: ``(spec, architecture, weights directory)``."""
    src = tc.model
    gbs = {"global_batch_size": plan.global_batch_size}
    if isinstance(src, BuiltinModel):
        if src.name in TINY_MODELS:
            return tiny_model(src.name, plan.global_batch_size), None, None
        return catalog.model(src.name).model_copy(update=gbs), None, None
    if isinstance(src, SpecFileModel):
        if src.spec is not None:
            return src.spec.model_copy(update=gbs), None, None
        path = str(base / (src.path or ""))
        return load_model(path, plan), load_architecture(path), None
    # A Hugging Face directory: its config.json through transformers (seconds per rank;
    # launchers that start many ranks resolve it once into a model file: hf.model_file).
    from sailor.megatron_patch.hf.checkpoint import load_model as load_hf

    root = base / src.path
    spec, arch = load_hf(root, src.seq_length, plan.global_batch_size)
    return spec, arch, root if src.load_weights else None


def model_of(
    args: argparse.Namespace, tc: TrainingConfig | None, base: Path, plan: Plan
) -> tuple[ModelSpec, Architecture | None, Path | None]:
    """The model: ``--model`` (a name, a ModelSpec file or a model file with its
    architecture) wins, else the training config's source, else the plan's model name."""
    if args.model is None and tc is not None:
        return _config_model(tc, base, plan)
    src = tc.model if tc is not None else None
    weights = base / src.path if isinstance(src, HuggingFaceModel) and src.load_weights else None
    return load_model(args.model, plan), load_architecture(args.model), weights
