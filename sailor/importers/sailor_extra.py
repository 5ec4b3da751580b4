"""The original artifact's remaining formats: Varuna memory profiles, per-GPU-type network
coefficients, spot availability traces and DeepSpeed configs; and a dispatcher that imports
any of its files by recognising the format.

- ``varuna_profile_*.json``: ``{mbs: {tp: {layer: bytes}}}`` → ``ProfileDB.memory``.
- ``network_coeffs_all_homo.json``: ``{"inter"|"intra": {gpu: {gpus_per_node: [[c0, c1, c2],
  max_bytes_per_s]}}}`` → NetworkProfile curves that hold inside any one zone (zone ``*``).
- ``traces/*.json``: ``[{"Time": s, "GPUs": n}]`` → ``(time, Pool)`` states of one GPU type.
- ``ds_config.json``: DeepSpeed batching, ZeRO stage and optimizer → ``DeepSpeedSettings``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field

from sailor.importers._read import ImportFormatError, as_float, as_int, get, load_json
from sailor.importers.sailor_network import import_egress, import_network, parse_curve
from sailor.schemas import (
    Endpoint,
    Frozen,
    LayerMemory,
    Link,
    NetworkProfile,
    Pool,
    PoolEntry,
    ProfileDB,
)

__all__ = [
    "DeepSpeedSettings",
    "import_any",
    "import_availability_trace",
    "import_ds_config",
    "import_network_coeffs",
    "import_varuna_memory",
]


def import_varuna_memory(path: str | Path, model: str, *, gpu_type: str = "*") -> ProfileDB:
    """Per-layer memory footprints per (microbatch size, TP degree)."""
    data = load_json(path)
    entries: list[LayerMemory] = []
    for mbs_s, by_tp in _obj(data, path, "<root>").items():
        mbs = as_int(mbs_s, path, "<mbs>", min_value=1)
        for tp_s, by_layer in _obj(by_tp, path, mbs_s).items():
            tp = as_int(tp_s, path, f"{mbs_s}.<tp>", min_value=1)
            for layer_s, v in _obj(by_layer, path, f"{mbs_s}.{tp_s}").items():
                f = f"{mbs_s}.{tp_s}.{layer_s}"
                entries.append(
                    LayerMemory(
                        gpu_type=gpu_type,
                        tp=tp,
                        microbatch_size=mbs,
                        layer=as_int(layer_s, path, f + ".<layer>", min_value=0),
                        bytes=int(as_float(v, path, f, min_value=0)),
                    )
                )
    return ProfileDB(model=model, memory=tuple(entries), meta={"from": Path(path).name})


def import_network_coeffs(path: str | Path) -> NetworkProfile:
    """Per-GPU-type inter- and intra-node fits; inter-node curves apply inside one zone."""
    data = _obj(load_json(path), path, "<root>")
    links: list[Link] = []
    intra: list[Link] = []
    for part, target in (("inter", links), ("intra", intra)):
        for gpu, by_n in _obj(get(data, part, path, part), path, part).items():
            for n, v in _obj(by_n, path, f"{part}.{gpu}").items():
                k = as_int(n, path, f"{part}.{gpu}.<gpus_per_node>", min_value=1)
                ep = Endpoint(zone="*", gpu_type=gpu, gpus_per_node=k)
                target.append(Link(src=ep, dst=ep, curve=parse_curve(v, path, f"{part}.{gpu}.{n}")))
    return NetworkProfile(
        links=tuple(links), intra_node=tuple(intra), source=f"imported from {Path(path).name}"
    )


def import_availability_trace(
    path: str | Path, *, gpu_type: str, zone: str, gpus_per_node: int = 1, spot: bool = True
) -> list[tuple[float, Pool]]:
    """``[{"Time": s, "GPUs": n}]`` → pools over time (whole nodes of ``gpus_per_node``)."""
    data = load_json(path)
    if not isinstance(data, list) or not data:
        raise ImportFormatError(path, "<root>", "expected a non-empty list of {Time, GPUs}")
    out: list[tuple[float, Pool]] = []
    last = -1.0
    for i, row in enumerate(data):
        t = as_float(get(row, "Time", path, f"[{i}].Time"), path, f"[{i}].Time", min_value=0)
        if t < last:
            raise ImportFormatError(path, f"[{i}].Time", f"{t} goes back in time (after {last})")
        last = t
        n = as_int(get(row, "GPUs", path, f"[{i}].GPUs"), path, f"[{i}].GPUs", min_value=0)
        entry = PoolEntry(
            gpu_type=gpu_type,
            zone=zone,
            nodes=n // gpus_per_node,
            gpus_per_node=gpus_per_node,
            spot=spot,
        )
        out.append((t, Pool(entries=(entry,))))
    return out


class DeepSpeedSettings(Frozen):
    """What a DeepSpeed JSON config says about batching and the optimizer."""

    train_batch_size: int = Field(gt=0, description="Global batch size.")
    micro_batch_size: int = Field(gt=0, description="Microbatch size per GPU.")
    gradient_accumulation_steps: int = Field(gt=0, description="Microbatches per step.")
    zero_stage: int = Field(ge=0, le=3, description="ZeRO stage (0 = off).")
    optimizer: str = Field(description="Optimizer type, e.g. 'AdamW'.")
    lr: float = Field(ge=0, description="Learning rate.")
    betas: tuple[float, float] = Field(description="Adam betas.")
    eps: float = Field(gt=0, description="Adam epsilon.")
    weight_decay: float = Field(ge=0, description="Weight decay.")
    precision: str = Field(description="'fp16', 'bf16' or 'fp32'.")


def import_ds_config(path: str | Path) -> DeepSpeedSettings:
    d = _obj(load_json(path), path, "<root>")
    opt = _obj(d.get("optimizer", {}), path, "optimizer")
    params = _obj(opt.get("params", {}), path, "optimizer.params")
    betas = params.get("betas", [0.9, 0.999])
    if not isinstance(betas, list) or len(betas) != 2:
        raise ImportFormatError(path, "optimizer.params.betas", f"expected two numbers: {betas!r}")
    zero = _obj(d.get("zero_optimization", {}), path, "zero_optimization")
    precision = (
        "fp16"
        if _obj(d.get("fp16", {}), path, "fp16").get("enabled")
        else "bf16"
        if _obj(d.get("bf16", {}), path, "bf16").get("enabled")
        else "fp32"
    )
    return DeepSpeedSettings(
        train_batch_size=as_int(
            get(d, "train_batch_size", path, "train_batch_size"),
            path,
            "train_batch_size",
            min_value=1,
        ),
        micro_batch_size=as_int(
            d.get("train_micro_batch_size_per_gpu", 1),
            path,
            "train_micro_batch_size_per_gpu",
            min_value=1,
        ),
        gradient_accumulation_steps=as_int(
            d.get("gradient_accumulation_steps", 1),
            path,
            "gradient_accumulation_steps",
            min_value=1,
        ),
        zero_stage=as_int(zero.get("stage", 0), path, "zero_optimization.stage", min_value=0),
        optimizer=str(opt.get("type", "Adam")),
        lr=as_float(params.get("lr", 1e-3), path, "optimizer.params.lr", min_value=0),
        betas=(
            as_float(betas[0], path, "optimizer.params.betas[0]"),
            as_float(betas[1], path, "optimizer.params.betas[1]"),
        ),
        eps=as_float(params.get("eps", 1e-8), path, "optimizer.params.eps", min_value=0),
        weight_decay=as_float(
            params.get("weight_decay", 0.0), path, "optimizer.params.weight_decay", min_value=0
        ),
        precision=precision,
    )


def import_any(
    path: str | Path, *, model: str = "OPT-350", reference_dir: Path | None = None
) -> Any:
    """Import one file of the original artifact by recognising its format.

    ``reference_dir`` is the artifact's root, for formats that need a companion file (cluster
    config for quotas and CSV traces; per-layer sizes for profiles).
    """
    from sailor.importers.sailor_cluster import import_pool, import_trace, import_training_config
    from sailor.importers.sailor_plan import import_plan, plan_from_dict
    from sailor.importers.sailor_profiles import import_profiles, profile_models

    p = Path(path)
    root = reference_dir or p.parent.parent
    cluster = root / "configs" / "basic_cluster_config.json"
    name = p.name
    if name == "profiles_tmp.json":
        info = p.with_name("llm_info.json")
        return [import_profiles(p, info if info.exists() else None, m) for m in profile_models(p)]
    if name == "llm_info.json":
        return [import_profiles_sizes(p, m) for m in _obj(load_json(p), p, "<root>")]
    if name.startswith("varuna_profile_"):
        return import_varuna_memory(p, name.removeprefix("varuna_profile_").removesuffix(".json"))
    if name.startswith("multizone_bandwidths") or name == "intra_node_bandwidths.json":
        if name == "intra_node_bandwidths.json":
            return _intra_only(p)
        return import_network(p)
    if name == "network_coeffs_all_homo.json":
        return import_network_coeffs(p)
    if name == "communication_cost.json":
        return import_egress(p)
    if name == "ds_config.json":
        return import_ds_config(p)
    if name == "basic_cluster_config.json":
        return _cluster_table(p)
    if name.endswith("quotas_dict.json"):
        return import_pool(p, cluster)
    if name.startswith("gpu_trace_") and p.suffix == ".csv":
        return import_trace(p, cluster)
    if p.parent.name == "traces":
        return import_availability_trace(p, gpu_type="A100-40", zone="us-central1-a")
    if name.startswith("plan_config_"):
        return import_plan(p, model)
    if p.parent.name == "planner_results":
        return _planner_results(p, model, plan_from_dict)
    if name.startswith("training_config_") or name == "dummy_config.json":
        return import_training_config(p)
    raise ImportFormatError(p, "<file>", "not a format of the original artifact that Sailor knows")


def import_profiles_sizes(path: Path, model: str) -> ProfileDB:
    from sailor.importers.sailor_profiles import import_sizes

    return ProfileDB(model=model, sizes=tuple(import_sizes(path, model, 2)))


def _intra_only(path: Path) -> NetworkProfile:
    data = _obj(load_json(path), path, "<root>")
    intra = []
    for g, by_n in data.items():
        for n, v in _obj(by_n, path, g).items():
            k = as_int(n, path, f"{g}.<gpus>", min_value=1)
            ep = Endpoint(zone="*", gpu_type=g, gpus_per_node=k)
            intra.append(Link(src=ep, dst=ep, curve=parse_curve(v, path, f"{g}.{n}")))
    return NetworkProfile(intra_node=tuple(intra), source=f"imported from {path.name}")


def _cluster_table(path: Path) -> dict[str, tuple[int, int]]:
    data = _obj(load_json(path), path, "<root>")
    out: dict[str, tuple[int, int]] = {}
    for g, v in data.items():
        if not isinstance(v, dict):
            continue  # e.g. the "zone" entry
        out[g] = (
            as_int(
                get(v, "gpus_per_node", path, f"{g}.gpus_per_node"),
                path,
                f"{g}.gpus_per_node",
                min_value=1,
            ),
            as_int(
                get(v, "mem_per_gpu", path, f"{g}.mem_per_gpu"),
                path,
                f"{g}.mem_per_gpu",
                min_value=1,
            ),
        )
    return out


def _planner_results(path: Path, model: str, plan_from_dict: Any) -> list[Any]:
    data = load_json(path)
    results = [r for v in data.values() for r in v] if isinstance(data, dict) else data
    out: list[Any] = []
    for i, r in enumerate(results):
        if not isinstance(r, dict) or not r.get("plan"):
            out.append(None)
            continue
        try:
            out.append(
                plan_from_dict(r["plan"], model, file=f"{path}[{i}]", global_batch_size=1024)
            )
        except ImportFormatError as exc:
            out.append(exc)  # stage-wise data parallelism: reported, not representable
    return out


def _obj(d: Any, file: str | Path, field: str) -> dict[str, Any]:
    if not isinstance(d, dict):
        raise ImportFormatError(file, field, f"expected an object, got {type(d).__name__}")
    return {str(k): v for k, v in d.items()}
