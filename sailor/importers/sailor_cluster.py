"""Import the original artifact's training configs, cluster configs and availability traces."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from sailor.importers._read import ImportFormatError, as_int, get, load_json
from sailor.schemas import ModelSpec, Pool, PoolEntry, Precision

__all__ = ["import_pool", "import_trace", "import_training_config"]


def import_training_config(path: str | Path, *, precision: Precision = "fp16") -> ModelSpec:
    """``training_config_*.json`` → ModelSpec (the original trains GPT-2 style blocks, Adam)."""
    d = load_json(path)

    def i(key: str) -> int:
        return as_int(get(d, key, path, key), path, key, min_value=1)

    hidden = i("hidden_size")
    heads = i("heads")
    try:
        return ModelSpec(
            name=str(get(d, "model", path, "model")),
            num_layers=i("num_layers"),
            hidden_size=hidden,
            num_heads=heads,
            ffn_hidden_size=as_int(d.get("ffn_hidden_size", 4 * hidden), path, "ffn_hidden_size"),
            seq_length=i("sequence_length"),
            vocab_size=i("vocab_size"),
            global_batch_size=i("global_batch_size"),
            precision=precision,
            optimizer="adam",
        )
    except ValueError as exc:
        raise ImportFormatError(path, "<model>", str(exc)) from exc


def _gpus_per_node(cluster_config: Any, gpu: str, file: str | Path) -> int:
    entry = get(cluster_config, gpu, file, gpu)
    return as_int(
        get(entry, "gpus_per_node", file, f"{gpu}.gpus_per_node"),
        file,
        f"{gpu}.gpus_per_node",
        min_value=1,
    )


def import_pool(
    quotas_json: str | Path, cluster_config_json: str | Path, *, spot: bool = False
) -> Pool:
    """``dummy_quotas_dict.json`` (GPUs per type and zone) + ``basic_cluster_config.json``."""
    quotas = load_json(quotas_json)
    cfg = load_json(cluster_config_json)
    entries: list[PoolEntry] = []
    for gpu, by_zone in quotas.items():
        k = _gpus_per_node(cfg, gpu, cluster_config_json)
        for zone, n in by_zone.items():
            gpus = as_int(n, quotas_json, f"{gpu}.{zone}", min_value=0)
            entries.append(
                PoolEntry(gpu_type=gpu, zone=zone, nodes=gpus // k, gpus_per_node=k, spot=spot)
            )
    return Pool(entries=tuple(entries))


def import_trace(
    trace_csv: str | Path, cluster_config_json: str | Path, *, spot: bool = True
) -> list[tuple[float, Pool]]:
    """``gpu_trace_*.csv``: rows of (timestamp, GPUs per ``<GPU>_<zone>`` column) → pools."""
    cfg = load_json(cluster_config_json)
    out: list[tuple[float, Pool]] = []
    with Path(trace_csv).open(newline="") as fh:
        rows = list(csv.DictReader(fh))
    if not rows:
        raise ImportFormatError(trace_csv, "<rows>", "no rows")
    for ri, row in enumerate(rows):
        if "Timestamp" not in row:
            raise ImportFormatError(trace_csv, "Timestamp", "missing column")
        try:
            t = float(row["Timestamp"])
        except ValueError as exc:
            raise ImportFormatError(
                trace_csv, f"row {ri}.Timestamp", repr(row["Timestamp"])
            ) from exc
        entries: list[PoolEntry] = []
        for col, val in row.items():
            if not col or col == "Timestamp" or "_" not in col:
                continue
            gpu, zone = col.split("_", 1)
            k = _gpus_per_node(cfg, gpu, cluster_config_json)
            gpus = as_int(val, trace_csv, f"row {ri}.{col}", min_value=0)
            entries.append(
                PoolEntry(gpu_type=gpu, zone=zone, nodes=gpus // k, gpus_per_node=k, spot=spot)
            )
        out.append((t, Pool(entries=tuple(entries))))
    return out
