"""Local Hugging Face model directories: read into any layout, write what ``transformers`` loads.

- :func:`load_config` reads ``config.json`` (never the network: ``local_files_only``).
- :func:`load_stage` fills one rank's stage from the directory's safetensors files, reading
  only the tensors of the stage's layers (``safe_open`` is lazy), so every rank of any plan
  (uneven stages, any TP degree) imports the same model: full tensors are converted to the
  engine's names and sliced to the rank's TP shard (``state.load_full_params``). It checks
  every weight's name and shape from the files' headers first, then reads one layer at a
  time, in the file's dtype, and slices on the host before the copy to the device: a rank
  holds one layer's full tensors at a time, not its whole stage in fp32 (Llama-2-70B at
  PP 4: ~1.7 GB of bf16 per rank instead of ~69 GB of fp32, times the TP ranks of a node).
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
from sailor.megatron_patch.hf.convert import (
    engine_to_hf,
    has_head_weight,
    hf_layer_of,
    hf_to_engine,
)
from sailor.megatron_patch.model import GPTStage, full_shape
from sailor.megatron_patch.state import load_full_params
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


def _index(
    model_dir: Path, spec: ModelSpec, arch: Architecture
) -> dict[int, list[tuple[Path, str]]]:
    """Per engine layer, its HF tensors as (file, name), from the files' headers only."""
    from safetensors import safe_open

    out: dict[int, list[tuple[Path, str]]] = {}
    for path in _files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                layer = hf_layer_of(arch, spec, name)
                if layer is not None:
                    out.setdefault(layer, []).append((path, name))
    return out


def _read(
    index: Mapping[int, list[tuple[Path, str]]],
    spec: ModelSpec,
    arch: Architecture,
    layers: range | list[int],
    dtype: torch.dtype | None,
    *,
    meta: bool = False,
) -> dict[str, torch.Tensor]:
    """Full engine tensors of ``layers`` (in ``dtype``, else the files'); with ``meta``,
    of their shapes only, on the meta device (the headers are read, not the data)."""
    from safetensors import safe_open

    wanted = set(layers)
    head = spec.num_all_layers - 1
    need = set(wanted)
    if head in wanted and (
        spec.tie_embeddings or not has_head_weight(arch, (n for _, n in index.get(head, ())))
    ):
        need.add(0)  # the head takes the embedding's weight
    by_file: dict[Path, list[str]] = {}
    for layer in sorted(need):
        for path, name in index.get(layer, ()):
            by_file.setdefault(path, []).append(name)
    hf: dict[str, torch.Tensor] = {}
    for path, names in by_file.items():
        with safe_open(str(path), framework="pt") as f:
            for name in names:
                if meta:
                    shape = tuple(f.get_slice(name).get_shape())
                    hf[name] = torch.empty(shape, device="meta")
                    continue
                t = f.get_tensor(name)
                hf[name] = t if dtype is None else t.to(dtype)
    return hf_to_engine(spec, arch, hf, wanted)


def read_layers(
    model_dir: str | Path, spec: ModelSpec, arch: Architecture, layers: range | list[int]
) -> dict[str, torch.Tensor]:
    """Full engine tensors of ``layers`` read from the directory's safetensors files, fp32."""
    return _read(_index(Path(model_dir), spec, arch), spec, arch, layers, torch.float32)


def load_stage(stage: GPTStage, model_dir: str | Path) -> None:
    """Load this rank's shards of the stage's layers from a local model directory, one layer
    at a time (see the module docstring)."""
    index = _index(Path(model_dir), stage.spec, stage.arch)
    names = {n for n, _ in stage.keyed_parameters()}
    # every layer's tensors are named by the files' headers: check them all before loading
    layers = range(stage.first_layer, stage.last_layer + 1)
    try:
        shapes = _read(index, stage.spec, stage.arch, layers, None, meta=True)
    except KeyError as exc:  # a tensor the conversion needs is not in the files
        raise KeyError(f"{model_dir}: no weights for {exc.args[0]!r}") from exc
    found = set(shapes)
    missing = sorted(names - found)
    if missing:
        raise KeyError(f"{model_dir}: no weights for {missing[:5]} ({len(missing)} missing)")
    # a converted weight no parameter takes means the engine's model is not the checkpoint's
    # (e.g. a bias the engine does not build): refused, not silently dropped
    unused = sorted(found - names)
    if unused:
        raise KeyError(
            f"{model_dir}: weights {unused[:5]} ({len(unused)}) have no parameter in the "
            "engine's model: its architecture differs from the checkpoint's"
        )
    # and every shape: a copy would broadcast a wrong one, or fail half-way through
    tp = stage.tp.size
    wrong = [
        f"{n} {tuple(shapes[n].shape)} (the model's {full_shape(p, tp)})"
        for n, p in stage.keyed_parameters()
        if tuple(shapes[n].shape) != full_shape(p, tp)
    ]
    if wrong:
        raise ValueError(
            f"{model_dir}: weights of another shape than the engine's model: "
            f"{'; '.join(wrong[:5])} ({len(wrong)} in all)"
        )
    for layer in layers:
        load_full_params(stage, _read(index, stage.spec, stage.arch, [layer], None))


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
