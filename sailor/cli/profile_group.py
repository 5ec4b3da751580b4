"""The ``sailor profile`` command group (its Typer app) and what its commands share.

The app the commands register on (``profile_cmd`` adds it to the ``sailor`` CLI), the
parsing of their list and byte-count options, the model a command profiles, this host's
catalog GPU type and the check of a type a command records under, and the ProfileDB file a
command merges into (checked before measuring). Commands: ``profile_layers_cmd`` (layers),
``profile_network_cmd`` (network), ``profile_cmd`` (estimate). Holds no command itself.
"""

from __future__ import annotations

import math
from pathlib import Path

import typer

from sailor import catalog
from sailor.cli._io import check_out, fail, load_model
from sailor.schemas import ModelSpec, ProfileDB
from sailor.schemas.device_kind import is_cpu_type

__all__ = [
    "check_db_out",
    "check_grid",
    "check_kind",
    "existing_db",
    "fmt_ms",
    "local_gpu_type",
    "model_spec",
    "parse_bytes",
    "parse_ints",
    "profile_app",
]


def existing_db(path: Path) -> ProfileDB | None:
    """The database to merge into: None if ``path`` does not exist yet."""
    return load_model(path, ProfileDB) if path.exists() else None


def check_db_out(path: Path, model: str) -> None:
    """Before measuring: the output is a ProfileDB of ``model`` (or new), not a directory,
    so a measurement of minutes to hours is never thrown away at the merge."""
    check_out(path, "-o", "the ProfileDB file to merge into")
    old = existing_db(path)
    if old is not None and old.model != model:
        raise fail(
            f"-o {path}: holds profiles of model {old.model!r}, not {model!r}: one file per "
            "model (give another -o)"
        )


profile_app = typer.Typer(
    help="Measure layer times/sizes and link bandwidth here; estimate other GPUs.",
    no_args_is_help=True,
)


def parse_ints(text: str, what: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise fail(f"--{what}={text!r}: expected comma-separated integers") from exc
    if not vals:
        raise fail(f"--{what}: empty")
    return vals


_UNITS = {"": 1, "B": 1, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}


_UNITS |= {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "KB": 10**3, "MB": 10**6, "GB": 10**9}


def parse_bytes(text: str, what: str) -> int:
    """A byte count with an optional unit (KiB/MiB/GiB/TiB, K/M/G binary, KB/MB/GB decimal)."""
    t = text.strip().upper()
    num = t.rstrip("KMGTIB")
    unit = t[len(num) :]
    try:
        value = float(num) * _UNITS[unit]
    except (ValueError, KeyError) as exc:
        raise fail(f"--{what}={text!r}: expected bytes, e.g. 40GiB, 512MiB or 1000000") from exc
    if not math.isfinite(value):  # 'inf', 'nan', '1e400': no byte count
        raise fail(f"--{what}={text!r}: expected a finite byte count, e.g. 40GiB")
    if value < 1:
        raise fail(f"--{what}={text!r}: must be at least 1 byte")
    return int(value)


def check_grid(
    spec: ModelSpec, tps: tuple[int, ...], mbs: tuple[int, ...], tp: str, mb: str
) -> None:
    """TP degrees are powers of two >= 1 that divide ``spec``'s heads, microbatch sizes
    >= 1 (the options' text ``tp``, ``mb`` named in the error), before anything is
    measured or estimated (``LayerRun`` checks the same for a measurement)."""
    if any(t < 1 or t & (t - 1) for t in tps):
        raise fail(f"--tp={tp!r}: TP degrees are powers of two >= 1 (1, 2, 4, ...)")
    for t in tps:
        if spec.num_heads % t or spec.kv_heads % t:
            raise fail(
                f"--tp={tp!r}: tp={t} must divide {spec.name}'s num_heads={spec.num_heads} "
                f"and kv_heads={spec.kv_heads}"
            )
    if any(b < 1 for b in mbs):
        raise fail(f"--mbs={mb!r}: microbatch sizes are >= 1")


def model_spec(name: str, model_file: Path | None) -> ModelSpec:
    if model_file is not None:
        return load_model(model_file, ModelSpec)
    try:
        return catalog.model(name)
    except KeyError as exc:
        raise fail(str(exc.args[0]) + "; or pass --model-file") from exc


def local_gpu_type(device: str) -> str:
    """The catalog type of this host's CUDA device 0 (cuda), or 'cpu'; a device the catalog
    does not know is refused with its name, memory and the types it could be. Imports torch
    only for cuda (a CPU probe's parent process needs none: its ranks import it)."""
    if device != "cuda":
        return "cpu"
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    from sailor.catalog.cuda_names import UnknownGPUError, catalog_gpu_name

    props = torch.cuda.get_device_properties(0)
    try:
        return catalog_gpu_name(props.name, props.total_memory, catalog.gpus())
    except UnknownGPUError as exc:
        raise fail(str(exc)) from exc


def check_kind(option: str, gpu_type: str, device: str, new_gpu_type: bool, misread: str) -> None:
    """Refuse a device type (``option``'s value) the planner would not read as the device
    measured: a GPU type on ``--device cpu`` (``misread`` says how it would be taken), or a
    name that is neither a catalog GPU type nor a CPU kind (``cpu`` or ``cpu-<kind>``)
    unless ``--new-gpu-type`` says it is a GPU type the catalog lacks."""
    if is_cpu_type(gpu_type):
        return
    known = sorted(g for g in catalog.gpus() if not is_cpu_type(g))
    if device == "cpu":
        raise fail(
            f"{option}={gpu_type!r} on --device cpu: {misread}: name the CPU nodes' kind cpu "
            "or cpu-<kind> (e.g. cpu-slow), or measure the GPU with --device cuda on it"
        )
    if gpu_type not in known and not new_gpu_type:
        raise fail(
            f"{option}={gpu_type!r}: not a GPU type of the catalog ({', '.join(known)}): give "
            "one of them, or pass --new-gpu-type to record a GPU type the catalog does not "
            "list yet"
        )


def fmt_ms(s: float) -> str:
    return f"{s * 1e3:.3f}"
