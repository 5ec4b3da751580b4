"""``sailor profile layers``: time and size the layers of a model on this machine.

The command, the per-(TP, mbs) saves that keep a long run's finished units, the run under
a CPU quota, and the summary table. The ProfileDB is merged into its file (measured beats
imported beats estimated). Registered on
``profile_group.profile_app``; ``profile_cmd`` imports this module so the command exists.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from sailor.cli._io import fail
from sailor.cli.profile_group import (
    check_db_out,
    check_kind,
    existing_db,
    fmt_ms,
    local_gpu_type,
    model_spec,
    parse_bytes,
    parse_ints,
    profile_app,
)
from sailor.cli.tables import print_table
from sailor.profiler.merge import SKIPPED, merge_db, precision_clash, save_db, split_clash
from sailor.schemas import ModelSpec, ProfileDB
from sailor.schemas.device_kind import is_cpu_type

if TYPE_CHECKING:
    from sailor.profiler.layer_measurement import LayerMeasurement
    from sailor.profiler.layers import LayerRun

__all__ = ["layers_cmd"]


_QUOTA_MIN_TIME_S = 2.0
"""Timed span per measurement under a CPU quota: 20 periods of 100 ms (cgroup_layout). The
slowdown a quota causes (wall over CPU time, ``timing.CpuClock``) is exact over whole
periods; a span of 20 keeps the part period at its ends to a few per cent."""


_QUOTA_MAX_REPS = 100_000
"""Under a quota the timed span, not the repetition count, ends a measurement."""


@profile_app.command("layers")
def layers_cmd(
    model: str = typer.Option("tiny-gpt", help="Catalog model name."),
    model_file: Path | None = typer.Option(None, help="ModelSpec file (instead of --model)."),
    device: str = typer.Option("cpu", help="cpu or cuda."),
    tp: str = typer.Option(
        "1",
        help="TP degrees, comma-separated (TP>1: gloo ranks on CPU; on cuda one NCCL rank per "
        "GPU of this host).",
    ),
    mbs: str = typer.Option("1,2,4,8", help="Microbatch sizes, comma-separated."),
    out: Path = typer.Option(..., "-o", "--out", help="ProfileDB JSON to merge into."),
    gpu_type: str | None = typer.Option(
        None,
        "--kind",
        "--gpu-type",
        help="Device type the profile is recorded under: a GPU type, or a CPU kind "
        "(cpu-<kind>, e.g. cpu-slow) whose nodes the planner tells apart by this profile "
        "(default: 'cpu', or the catalog type of CUDA device 0, e.g. H100-80 for "
        "'NVIDIA H100 80GB HBM3').",
    ),
    new_gpu_type: bool = typer.Option(
        False,
        "--new-gpu-type",
        help="--kind names a GPU type the catalog does not list yet (with --device cuda): "
        "record the profile under it anyway (the planner needs a catalog entry of that name "
        "to price and plan it). Without it an unknown --kind is refused.",
    ),
    cpu_quota: float | None = typer.Option(
        None,
        help="Measure under a CPU quota of this many cores (the cgroup cpu controller, as an "
        "agent's cpu_quota; e.g. 0.4): the speed of a kind whose nodes run under it. Needs a "
        "writable cpu controller (refused without one). Under a quota the defaults become "
        f"--statistic scaled, --min-time {_QUOTA_MIN_TIME_S:g} and --max-reps "
        f"{_QUOTA_MAX_REPS} (see the docs).",
    ),
    threads: int = typer.Option(1, help="torch intra-op threads on CPU (worker default: 1)."),
    warmup: int = typer.Option(3, help="Untimed runs before timing."),
    min_reps: int = typer.Option(5, help="At least this many timed runs."),
    max_reps: int | None = typer.Option(
        None, help=f"At most this many timed runs (default 50; {_QUOTA_MAX_REPS} under a quota)."
    ),
    min_time: float | None = typer.Option(
        None,
        help="Repeat until the timed runs add up to this (s; default 0.2, "
        f"{_QUOTA_MIN_TIME_S:g} under a quota).",
    ),
    memory: bool = typer.Option(True, help="Measure peak memory growth (a separate pass)."),
    overhead: bool = typer.Option(True, help="Measure the process overhead (CPU only)."),
    host_ranks: int = typer.Option(
        0,
        help="CPU test scaffolding, opt-in: measure how 1..N ranks on this host share its "
        "cores (0, the default: skip). Only the CPU closed-loop benchmark "
        "(benchmarks/simulator_vs_cpu.py) uses it; GPU ranks have a device each.",
    ),
    host_pin: bool = typer.Option(
        False,
        help="CPU: measure host sharing with rank r bound to core r % cores, for runs that "
        "bind their ranks the same way (launch_local(pin_cores=True)).",
    ),
    statistic: str | None = typer.Option(
        None,
        help="median (the layer's own cost; the default), mean (includes a busy host's "
        "stalls), or scaled (each layer's median times the measurement's wall over CPU time: "
        "a quota's stalls shared out by the layers' costs; the default under --cpu-quota).",
    ),
    in_situ: bool = typer.Option(
        True,
        help="Time the layers in place inside the model (a window of it when the whole does "
        "not fit the device); --no-in-situ: each layer kind alone.",
    ),
    memory_limit: str | None = typer.Option(
        None,
        help="Bytes the measurements may use per device (e.g. 40GiB, 512MiB, 1000000). On cuda "
        "the GPU's free memory less a margin bounds it anyway; on cpu default: no bound.",
    ),
) -> None:
    """Time and size each layer kind of the training framework per TP degree and mbs."""

    from sailor.profiler.layers import LayerRun
    from sailor.profiler.timing import RepeatSettings

    if device not in ("cpu", "cuda"):
        raise fail(f"--device={device!r}: use cpu or cuda")
    if gpu_type is not None:
        check_kind(
            "--kind",
            gpu_type,
            device,
            new_gpu_type,
            "CPU timings recorded under a GPU type would be read as that GPU's speed",
        )
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise fail(
                f"--device=cuda: no CUDA device here (torch {torch.__version__}, "
                f"built for CUDA {torch.version.cuda or 'none'}): profile on a GPU host, or "
                "use --device cpu"
            )
    spec = model_spec(model, model_file)
    if gpu_type is None:
        gpu_type = local_gpu_type(device)
    if is_cpu_type(gpu_type) and device != "cpu":
        raise fail(f"--kind={gpu_type!r} is a CPU kind: measure it with --device cpu")
    con = Console()
    throttled = cpu_quota is not None
    if throttled and statistic == "median":
        con.print(
            "[yellow]warning:[/] --statistic median under --cpu-quota: the median repetition "
            "ran before its period's quota was spent, so it shows the unthrottled speed "
            "(the default under a quota, scaled, keeps the stalls)"
        )
    try:
        run = LayerRun(
            spec=spec,
            gpu_type=gpu_type,
            device=device,
            tps=parse_ints(tp, "tp"),
            mbs=parse_ints(mbs, "mbs"),
            settings=RepeatSettings(
                warmup,
                min_reps,
                max_reps if max_reps is not None else (_QUOTA_MAX_REPS if throttled else 50),
                min_time if min_time is not None else (_QUOTA_MIN_TIME_S if throttled else 0.2),
            ),
            threads=threads,
            measure_memory=memory,
            measure_overhead=overhead and device == "cpu",
            statistic=statistic or ("scaled" if throttled else "median"),
            cpu_quota=cpu_quota,
            host_ranks=host_ranks if device == "cpu" else 0,
            host_pin=host_pin,
            in_situ=in_situ,
            memory_limit=None
            if memory_limit is None
            else parse_bytes(memory_limit, "memory-limit"),
        )
    except ValueError as exc:
        raise fail(str(exc)) from exc
    check_db_out(out, spec.name)
    saver = _UnitSaver(out, existing_db(out))
    from sailor.profiler.precision import compute_precision, sizes_measured

    units = [(t, m) for t in run.tps for m in run.mbs]
    precision = compute_precision(spec, device)
    clash = precision_clash(
        saver.original, gpu_type, units, precision, sizes=sizes_measured(spec, precision)
    )
    clash = clash or split_clash(saver.original, gpu_type, units)
    if clash:
        raise fail(f"-o {out}: {clash}")
    title = f"profiling {spec.name} on {gpu_type}"
    if cpu_quota is None:
        db, ms = _profile_with_bar(con, run, title, saver)
    else:
        db, ms = _profile_under_quota(con, run, f"{title} (quota {cpu_quota:g} cores)", saver)
    merged, dropped = merge_db(saver.original, db)
    save_db(merged, out)
    _print_layers(con, spec, gpu_type, device, db, ms)
    con.print(
        f"merged into {out} ({len(merged.timings)} timings; {dropped} entries kept from "
        "a better source)"
    )


@dataclass
class _UnitSaver:
    """Merges the database so far into ``out`` after each (TP, mbs) unit, atomically, so a
    failure (or ^C) hours into a run loses only the unit it happened in. Each save merges
    into the file as it was before the run, as the final save does."""

    out: Path
    original: ProfileDB | None
    units: int = 0
    """Units saved so far."""

    def __call__(self, db: ProfileDB) -> None:
        save_db(merge_db(self.original, db)[0], self.out)
        self.units += 1


def _profile_under_quota(
    con: Console, run: LayerRun, title: str, saver: _UnitSaver
) -> tuple[ProfileDB, list[LayerMeasurement]]:
    """``_profile_with_bar`` with this process (and the ranks it starts) in a cgroup of
    ``run.cpu_quota`` cores; refused where no writable cpu controller exists, since timings
    recorded under a kind's name must have been measured at its speed."""
    from sailor.agent.cpu_quota import CpuQuotaUnavailableError, process_quota
    from sailor.profiler.layers import preload

    cores = run.cpu_quota
    if cores is None:
        return _profile_with_bar(con, run, title, saver)
    preload()  # its import cost outside the quota (profile_layers calls it again: cheap)
    try:
        with process_quota(cores, run.gpu_type) as cg:
            con.print(f"measuring under {cores:g} cores: cgroup {cg.path}")
            return _profile_with_bar(con, run, title, saver)
    except CpuQuotaUnavailableError as exc:
        raise fail(
            f"--cpu-quota={cores:g}: {exc}; refusing to record {run.gpu_type!r} timings unthrottled"
        ) from exc
    except (OSError, ValueError) as exc:
        raise fail(f"--cpu-quota={cores:g}: {exc}") from exc


def _profile_with_bar(
    con: Console, run: LayerRun, title: str, saver: _UnitSaver
) -> tuple[ProfileDB, list[LayerMeasurement]]:
    """``profile_layers(run)`` under a progress bar, saving after each unit; its errors as
    one-line CLI errors that say what was saved."""
    from sailor.profiler.layers import profile_layers

    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=con,
    ) as bar:
        task = bar.add_task(title, total=run.total)

        def progress(desc: str, n: int) -> None:
            bar.update(task, description=desc, advance=n)

        try:
            db, ms = profile_layers(run, progress, saver)
        except KeyboardInterrupt:  # ^C: say what of the run is kept, then end as ^C does
            raise fail(
                f"interrupted: the {saver.units} (TP, mbs) unit(s) finished before it are "
                f"merged into {saver.out}"
                if saver.units
                else f"interrupted before a (TP, mbs) unit finished: {saver.out} unchanged",
                code=130,
            ) from None
        except (RuntimeError, ValueError) as exc:
            kept = (
                f"\n(the {saver.units} (TP, mbs) unit(s) before it are merged into {saver.out})"
                if saver.units
                else ""
            )
            raise fail(f"{exc}{kept}") from exc
        bar.update(task, description="done")
    return db, ms


def _print_layers(
    con: Console,
    spec: ModelSpec,
    gpu_type: str,
    device: str,
    db: ProfileDB,
    ms: list[LayerMeasurement],
) -> None:
    """The measured layers (embedding, first and last block, head), then what else the
    profile holds: overhead, framework time, host sharing, memory bound, precision."""
    t = Table(title=f"{spec.name} on {gpu_type} ({db.meta.get(f'{gpu_type}.device', device)})")
    for col in ("layer", "kind", "tp", "mbs", "fwd ms", "±", "bwd ms", "±", "update ms"):
        t.add_column(col, justify="right")
    for col in ("params/rank", "saved KiB", "peak KiB"):
        t.add_column(col, justify="right")
    n = spec.num_all_layers
    shown = {0, 1, n - 2, n - 1}  # embedding, first and last block, head
    for m in ms:
        if m.layer >= 0 and m.layer not in shown:
            continue
        t.add_row(
            str(m.layer) if m.layer >= 0 else "-",
            m.kind,
            str(m.tp),
            str(m.mbs),
            fmt_ms(m.fwd.median_s),
            fmt_ms(m.fwd.stdev_s),
            fmt_ms(m.bwd.median_s),
            fmt_ms(m.bwd.stdev_s),
            fmt_ms(m.update.median_s),
            f"{m.params:,}",
            f"{m.saved_bytes / 1024:.1f}",
            f"{m.peak_growth_bytes / 1024:.1f}",
        )
    print_table(con, t)
    if n > len(shown):
        con.print(f"(blocks 2..{n - 3} are in the database, not shown)")
    for o in db.overheads:
        con.print(f"process overhead ({o.gpu_type}): {o.bytes / 2**20:.1f} MiB — {o.source}")
    for f in db.framework:
        con.print(
            f"framework time ({f.gpu_type}): {f.iteration_s * 1e3:.3f} ms per iteration, "
            f"{f.microbatch_s * 1e3:.3f} ms per microbatch, {f.sample_s * 1e6:.1f} us per "
            "sample outside the layers"
        )
    for h in db.hosts:
        con.print(
            f"host sharing ({h.gpu_type}, {h.cores} cores): slowdown with 1..{len(h.slowdown)} "
            "ranks computing "
            + " / ".join(f"{x:.2f}" for x in h.slowdown)
            + f"; wake-up {h.wake_s * 1e3:.3f} ms"
        )
    bound = json.loads(db.meta.get(f"{gpu_type}.memory_bound", "{}"))
    for key, desc in bound.items():
        con.print(f"memory bound {key}: {desc}")
    con.print(f"precision: {db.meta.get(f'{gpu_type}.precision', '?')}")
    for unit, why in json.loads(db.meta.get(gpu_type + SKIPPED, "{}")).items():
        con.print(f"[yellow]skipped {unit} (out of GPU memory, not in the database): {why}")
    if not db.sizes:
        con.print(
            "[yellow]sizes not written: this device does not compute in the model's precision"
        )
