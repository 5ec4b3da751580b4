"""Local Hugging Face model directories: read into any layout, write what ``transformers`` loads.

- :func:`load_config` reads ``config.json`` (never the network: ``local_files_only``).
- :func:`load_stage` fills one rank's stage from the directory's safetensors files, reading
  only the tensors of the stage's layers (``safe_open`` is lazy), so every rank of any plan
  (uneven stages, any TP degree) imports the same model: full tensors are converted to the
  engine's names and sliced to the rank's TP shard (``state.load_full_state``).
- :func:`model_file` is the resolved model (spec and architecture) the worker's ``--model``
  takes, so ranks need not import ``transformers`` (seconds per process);
- :func:`export` writes ``config.json`` and ``model.safetensors`` from the engine's full
  (gathered) tensors; ``AutoModelForCausalLM.from_pretrained(dir)`` loads it.

The only module of the engine that touches ``transformers`` and ``safetensors`` files, so the
engine itself keeps no dependency on them (HF conversion stays at the edge).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from sailor.megatron_patch.architecture import Architecture
from sailor.megatron_patch.hf.config import from_hf_config
from sailor.megatron_patch.hf.convert import engine_to_hf, hf_layer_of, hf_to_engine
from sailor.megatron_patch.model import GPTStage
from sailor.megatron_patch.state import load_full_state
from sailor.schemas.model import ModelSpec

__all__ = [
    "export",
    "load_config",
    "load_model",
    "load_stage",
    "model_file",
    "read_layers",
]


def load_config(model_dir: str | Path) -> Any:
    """The ``transformers`` config of a local model directory."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(model_dir), local_files_only=True)


def load_model(
    model_dir: str | Path, seq_length: int | None = None, global_batch_size: int = 1
) -> tuple[ModelSpec, Architecture]:
    """``(ModelSpec, Architecture)`` of a local model directory's config."""
    return from_hf_config(load_config(model_dir), seq_length, global_batch_size)


def model_file(spec: ModelSpec, arch: Architecture) -> str:
    """The JSON the worker's ``--model`` takes for this model (no ``transformers`` import
    needed by the ranks): ``{"spec": ModelSpec, "architecture": Architecture}``."""
    return json.dumps(
        {"spec": spec.model_dump(mode="json"), "architecture": dataclasses.asdict(arch)}
    )


def _files(model_dir: Path) -> list[Path]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors weights")
    return files


def read_layers(
    model_dir: str | Path, spec: ModelSpec, arch: Architecture, layers: range | list[int]
) -> dict[str, torch.Tensor]:
    """Full engine tensors of ``layers`` read from the directory's safetensors files."""
    from safetensors import safe_open

    wanted = set(layers)
    head = spec.num_all_layers - 1
    need_embedding = 0 in wanted or (head in wanted and spec.tie_embeddings)
    hf: dict[str, torch.Tensor] = {}
    for path in _files(Path(model_dir)):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                layer = hf_layer_of(arch, spec, name)
                if layer is None:
                    continue
                if layer in wanted or (layer == 0 and need_embedding):
                    hf[name] = f.get_tensor(name).float()
    return hf_to_engine(spec, arch, hf, wanted)


def load_stage(stage: GPTStage, model_dir: str | Path) -> None:
    """Load this rank's shards of the stage's layers from a local model directory."""
    layers = range(stage.first_layer, stage.last_layer + 1)
    full = read_layers(model_dir, stage.spec, stage.arch, layers)
    names = {n for n, _ in stage.keyed_parameters()}
    missing = sorted(names - set(full))
    if missing:
        raise KeyError(f"{model_dir}: no weights for {missing[:5]} ({len(missing)} missing)")
    # a converted weight no parameter takes means the engine's model is not the checkpoint's
    # (e.g. a bias the engine does not build): refused, not silently dropped
    unused = sorted(set(full) - names)
    if unused:
        raise KeyError(
            f"{model_dir}: weights {unused[:5]} ({len(unused)}) have no parameter in the "
            "engine's model: its architecture differs from the checkpoint's"
        )
    load_full_state(stage, full)


def export(
    params: Mapping[str, torch.Tensor],
    spec: ModelSpec,
    arch: Architecture,
    config: Any,
    out_dir: str | Path,
) -> Path:
    """Write ``config`` and the full engine tensors as a directory ``transformers`` loads."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.float().cpu() for k, v in engine_to_hf(spec, arch, params).items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(str(out))
    return out
