"""``sailor profile``: measure layers and links on this machine; estimate GPUs not at hand.

* ``sailor profile layers --model M --device cpu|cuda --tp 1,2,4 --mbs 1,2,4,8 -o DB.json``
  (``--kind cpu-slow --cpu-quota 0.4``: a CPU kind, measured under its nodes' quota)
* ``sailor profile network -o NET.json [--zone Z --gpu-type G --gpus-per-node K ...]``
* ``sailor profile estimate --gpu H100-80 --from DB.json [-o OUT.json]``

Each command merges into its output file (measured beats imported beats estimated; a re-run
replaces its own earlier figures) and prints a summary table.
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from sailor import catalog
from sailor.cli._io import fail, load_model, write_json
from sailor.cli.tables import print_table
from sailor.profiler.merge import SKIPPED, merge_db, save_db
from sailor.schemas import BandwidthCurve, Endpoint, ModelSpec, NetworkProfile, ProfileDB
from sailor.schemas.device_kind import is_cpu_type
from sailor.schemas.network import CollectiveLatency

if TYPE_CHECKING:
    from sailor.profiler.calibrated_estimate import LooRow
    from sailor.profiler.layer_measurement import LayerMeasurement
    from sailor.profiler.layers import LayerRun
    from sailor.profiler.network_probe import ProbePoint

__all__ = ["profile_app"]

_QUOTA_MIN_TIME_S = 2.0
"""Timed span per measurement under a CPU quota: 20 periods of 100 ms (cgroup_layout). The
slowdown a quota causes (wall over CPU time, ``timing.CpuClock``) is exact over whole
periods; a span of 20 keeps the part period at its ends to a few per cent."""
_QUOTA_MAX_REPS = 100_000
"""Under a quota the timed span, not the repetition count, ends a measurement."""


def _existing_db(path: Path) -> ProfileDB | None:
    """The database to merge into: None if ``path`` does not exist yet."""
    return load_model(path, ProfileDB) if path.exists() else None


def _check_db_out(path: Path, model: str) -> None:
    """Before measuring: the output is a ProfileDB of ``model`` (or new), not a directory,
    so a measurement of minutes to hours is never thrown away at the merge."""
    if path.is_dir():
        raise fail(f"-o {path}: is a directory: give the ProfileDB file to merge into")
    old = _existing_db(path)
    if old is not None and old.model != model:
        raise fail(
            f"-o {path}: holds profiles of model {old.model!r}, not {model!r}: one file per "
            "model (give another -o)"
        )


profile_app = typer.Typer(
    help="Measure layer times/sizes and link bandwidth here; estimate other GPUs.",
    no_args_is_help=True,
)


def _ints(text: str, what: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise fail(f"--{what}={text!r}: expected comma-separated integers") from exc
    if not vals:
        raise fail(f"--{what}: empty")
    return vals


_UNITS = {"": 1, "B": 1, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}
_UNITS |= {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "KB": 10**3, "MB": 10**6, "GB": 10**9}


def _bytes(text: str, what: str) -> int:
    """A byte count with an optional unit (KiB/MiB/GiB/TiB, K/M/G binary, KB/MB/GB decimal)."""
    t = text.strip().upper()
    num = t.rstrip("KMGTIB")
    unit = t[len(num) :]
    try:
        value = float(num) * _UNITS[unit]
    except (ValueError, KeyError) as exc:
        raise fail(f"--{what}={text!r}: expected bytes, e.g. 40GiB, 512MiB or 1000000") from exc
    if value <= 0:
        raise fail(f"--{what}={text!r}: must be > 0")
    return int(value)


def _next_port(master: str) -> str:
    """``host:port+1``: where the collective probe's rank 0 listens after the link probe."""
    host, _, port = master.rpartition(":")
    try:
        return f"{host}:{int(port) + 1}"
    except ValueError as exc:
        raise fail(f"--master={master!r}: expected HOST:PORT") from exc


def _model(name: str, model_file: Path | None) -> ModelSpec:
    if model_file is not None:
        return load_model(model_file, ModelSpec)
    try:
        return catalog.model(name)
    except KeyError as exc:
        raise fail(str(exc.args[0]) + "; or pass --model-file") from exc


def _local_gpu_type(device: str) -> str:
    """The catalog type of this host's CUDA device 0 (cuda), or 'cpu'; a device the catalog
    does not know is refused with its name, memory and the types it could be."""
    import torch

    if device != "cuda" or not torch.cuda.is_available():
        return "cpu"
    from sailor.catalog.cuda_names import UnknownGPUError, catalog_gpu_name

    props = torch.cuda.get_device_properties(0)
    try:
        return catalog_gpu_name(props.name, props.total_memory, catalog.gpus())
    except UnknownGPUError as exc:
        raise fail(str(exc)) from exc


def _ms(s: float) -> str:
    return f"{s * 1e3:.3f}"


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
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise fail(
                f"--device=cuda: no CUDA device here (torch {torch.__version__}, "
                f"built for CUDA {torch.version.cuda or 'none'}): profile on a GPU host, or "
                "use --device cpu"
            )
    spec = _model(model, model_file)
    if gpu_type is None:
        gpu_type = _local_gpu_type(device)
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
            tps=_ints(tp, "tp"),
            mbs=_ints(mbs, "mbs"),
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
            memory_limit=None if memory_limit is None else _bytes(memory_limit, "memory-limit"),
        )
    except ValueError as exc:
        raise fail(str(exc)) from exc
    _check_db_out(out, spec.name)
    saver = _UnitSaver(out, _existing_db(out))
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
            _ms(m.fwd.median_s),
            _ms(m.fwd.stdev_s),
            _ms(m.bwd.median_s),
            _ms(m.bwd.stdev_s),
            _ms(m.update.median_s),
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


@profile_app.command("network")
def network_cmd(
    out: Path = typer.Option(..., "-o", "--out", help="NetworkProfile JSON to merge into."),
    zone: str = typer.Option(
        "local",
        help="Zone of the sending endpoint: the zone of the pool's nodes, which the simulator "
        "matches (a GPU node's records under 'local' are warned about).",
    ),
    gpu_type: str | None = typer.Option(
        None,
        help="GPU type of the sending endpoint (default: 'cpu', or the catalog type of CUDA "
        "device 0 with --device cuda).",
    ),
    gpus_per_node: int | None = typer.Option(
        None,
        help="GPUs per node of the sending endpoint (default: on cuda the GPUs this process "
        "sees, torch.cuda.device_count(); on cpu 1).",
    ),
    dst_zone: str | None = typer.Option(None, help="Receiving zone (default: --zone)."),
    dst_gpu_type: str | None = typer.Option(None, help="Receiving GPU type (default: same)."),
    dst_gpus_per_node: int | None = typer.Option(None, help="Receiving VM shape (default: same)."),
    intra: bool = typer.Option(
        False,
        help="Record as the intra-node curve of the endpoint. Implied with --device cuda on "
        "loopback (two GPUs of this node); refused with --rank (two nodes).",
    ),
    min_bytes: int = typer.Option(64 << 10, help="Smallest message, bytes (64 KiB)."),
    max_bytes: int = typer.Option(256 << 20, help="Largest message, bytes (up to 1 GiB)."),
    bytes_per_size: int = typer.Option(256 << 20, help="Bytes to move per message size."),
    latency: bool = typer.Option(True, help="Fit a per-message latency before the curve."),
    statistic: str = typer.Option("median", help="Per-size time: median or mean (with stalls)."),
    collectives: str | None = typer.Option(
        None,
        help="Rank counts for the all-reduce probe on this node, comma-separated ('' skips it; "
        "default 2,3,4, on cuda those up to the GPUs this process sees: one rank per GPU). "
        "With --rank: one rank per node, 2 ranks.",
    ),
    collective_sizes: str = typer.Option(
        "auto",
        help="All-reduce sizes (bytes) for the backend's bus bandwidth, fitted by least squares "
        "('auto': 1 KiB..256 MiB on cuda, 64 KiB..4 MiB on cpu; '' skips it).",
    ),
    device: str = typer.Option(
        "cpu", help="cpu (gloo, host memory) or cuda (NCCL, GPU memory: one GPU per rank)."
    ),
    rank: int | None = typer.Option(
        None,
        help="Between two nodes: run only this side (0 or 1) here; the other node runs the "
        "other side with the same --master. Rank 0 writes --out. Default: both on loopback.",
    ),
    master: str | None = typer.Option(
        None,
        help="HOST:PORT where rank 0 listens (with --rank): the link probe on PORT, the "
        "all-reduce probe on PORT+1 (both must be free there).",
    ),
    gpu: int = typer.Option(0, help="With --rank and cuda: the GPU of this node to use."),
) -> None:
    """Point-to-point bandwidth vs message size between two ranks with the training backend
    (gloo on cpu, NCCL on cuda): both on loopback here, or one per node (--rank, --master).
    On cuda on loopback the two ranks are GPUs 0 and 1 of this node: the curve is recorded
    as the node's intra-node curve.

    Then the fixed cost of a tiny all-reduce (what the simulator charges a ring once, instead
    of the p2p latency per ring step) and the all-reduce's bus bandwidth fitted over
    ``--collective-sizes``: on this node among each of ``--collectives`` rank counts
    (recorded as intra-node: rings inside one node), or with --rank between the two nodes,
    one rank each, at the port after --master's (recorded as inter-node: rings across nodes).
    The link is written first, then each all-reduce as it finishes.
    """
    from sailor.profiler.curve_fit import fit_link, fit_residuals, with_link
    from sailor.profiler.network_probe import ProbeSettings, run_probe

    gpus = _visible_gpus(device)
    gpu_loopback = device == "cuda" and rank is None
    if gpu_loopback and gpus < 2:
        raise fail(
            f"--device cuda on loopback: the two ranks need a GPU each, but this process sees "
            f"{gpus} GPU(s): probe between two nodes with --rank 0|1 --master HOST:PORT"
        )
    if rank is not None and intra:
        raise fail(
            f"--intra with --rank {rank}: the two ranks are on two nodes, an inter-node link "
            "(--intra is for a link between GPUs of one node: run on loopback)"
        )
    ranks, sizes = _collective_plan(collectives, collective_sizes, rank, master, device, gpus)
    if rank != 1:  # rank 0 (or both on loopback) writes --out: check it before probing
        if out.is_dir():
            raise fail(f"-o {out}: is a directory: give the NetworkProfile file to merge into")
        if out.exists():
            load_model(out, NetworkProfile)
    if gpu_type is None:
        gpu_type = _local_gpu_type(device)
    if gpus_per_node is None:
        gpus_per_node = gpus if device == "cuda" and gpus > 0 else 1
    try:
        settings = ProbeSettings(
            min_bytes=min_bytes, max_bytes=max_bytes, bytes_per_size=bytes_per_size, device=device
        )
        src = Endpoint(zone=zone, gpu_type=gpu_type, gpus_per_node=gpus_per_node)
        dst = Endpoint(
            zone=dst_zone or zone,
            gpu_type=dst_gpu_type or gpu_type,
            gpus_per_node=dst_gpus_per_node or gpus_per_node,
        )
    except ValueError as exc:
        raise fail(str(exc)) from exc
    if statistic not in ("median", "mean"):
        raise fail(f"--statistic={statistic!r}: use median or mean")
    if gpu_loopback:
        if dst != src:
            raise fail(
                "--dst-zone/--dst-gpu-type/--dst-gpus-per-node: on cuda on loopback both ranks "
                "are GPUs of this node, one endpoint, recorded as its intra-node curve; probe "
                "between two nodes with --rank 0|1 --master HOST:PORT"
            )
        intra = True
    elif intra and dst != src:
        raise fail(f"--intra: an intra-node curve has one endpoint, got {src} and {dst}")
    for warning in _endpoint_warnings(src, device, gpus, bool(ranks)):
        _warn(warning)
    con = Console()
    backend = "gloo" if device == "cpu" else "NCCL"
    where = "on loopback" if rank is None else f"rank {rank} of 2, rank 0 at {master}"
    try:
        with con.status(f"probing 2 {backend} ranks ({where})..."):
            points = run_probe(settings, rank=rank, master=master, gpu=gpu)
    except (RuntimeError, ValueError) as exc:
        raise fail(str(exc)) from exc
    probe = _CollectiveProbe(
        src,
        statistic,
        sizes,
        device,
        rank,
        None if master is None else _next_port(master),
        gpu,
    )
    if rank == 1:
        for n in ranks:
            try:
                probe.run(con, n)
            except (RuntimeError, ValueError) as exc:
                raise fail(f"all-reduce among {n} ranks: {exc}") from exc
        con.print(f"rank 1 done: rank 0 at {master} writes the link and the all-reduce")
        return
    pairs = [(p.nbytes, p.time.central(statistic)) for p in points]
    curve = fit_link(pairs, latency=latency)
    resid = fit_residuals(curve, pairs)
    load = os.getloadavg()[0]
    source = (
        f"sailor profile network: torch.distributed {backend} send/recv ping-pong "
        f"({device}), 2 processes "
        + (
            ("on loopback" + (" (GPUs 0 and 1 of one node)" if gpu_loopback else ""))
            if rank is None
            else f"on two nodes (rank 0 at {master})"
        )
        + f", {len(points)} sizes {min_bytes}..{max_bytes} B, load average {load:.2f}"
    )
    old = load_model(out, NetworkProfile) if out.exists() else None
    net = with_link(old, src, dst, curve, intra=intra, source=source)
    write_json(net, out)  # the link is kept whatever the all-reduces do
    lats: list[CollectiveLatency] = []
    failed = ""
    for n in ranks:
        try:
            lat = probe.run(con, n)
        except (RuntimeError, ValueError) as exc:
            failed = f"all-reduce among {n} ranks: {exc}"
            break
        lats.append(lat)
        net = _with_collectives(net, src, (n,), [lat])
        write_json(net, out)
    _print_link(con, src, dst, points, statistic, curve, resid, load, intra)
    for c in lats:
        bus = f", bus bandwidth {c.bus_gbps:.2f} GB/s" if c.bus_gbps else ""
        con.print(
            f"all-reduce among {c.ranks} ranks ({c.scope.replace('_', '-')}): latency "
            f"{c.latency_s * 1e3:.3f} ms{bus}"
        )
    if failed:
        done = "".join(f", the all-reduce among {c.ranks} ranks" for c in lats)
        raise fail(f"{failed}\n(the link{done} written to {out})")
    con.print(f"written to {out}")


_DEFAULT_COLLECTIVES: tuple[int, ...] = (2, 3, 4)


def _visible_gpus(device: str) -> int:
    """GPUs this process sees on cuda (``torch.cuda.device_count()``: CUDA_VISIBLE_DEVICES
    applies); 0 on cpu."""
    if device != "cuda":
        return 0
    import torch

    return int(torch.cuda.device_count())


def _warn(msg: str) -> None:
    typer.echo(f"warning: {msg}", err=True)


def _endpoint_warnings(src: Endpoint, device: str, gpus: int, collectives: bool) -> list[str]:
    """Why the records of a GPU node are unlikely to be found (pure). The simulator finds an
    all-reduce record by its exact endpoint (``NetworkProfile.collective_latency``) and a
    link by its zones first (``NetworkProfile.inter``): a GPU pool's nodes are in a real zone
    and have their GPU count, not 'local' and 1 (the CPU loopback convention)."""
    if device != "cuda":
        return []
    out: list[str] = []
    what = "the link and the all-reduces" if collectives else "the link"
    if src.zone == "local":
        out.append(
            f"--zone local (the default): {what} are recorded for zone 'local'; the simulator "
            "matches all-reduce records by their exact endpoint (zone, GPU type, GPUs per "
            "node) and inter-node links by their zones, so a pool whose nodes are in another "
            "zone will not use them: pass --zone with the nodes' zone"
        )
    if gpus and src.gpus_per_node != gpus:
        out.append(
            f"--gpus-per-node {src.gpus_per_node}, but this process sees {gpus} GPU(s): "
            f"{what} are recorded for nodes of {src.gpus_per_node} GPUs, and all-reduce "
            "records match only nodes of exactly that many (CUDA_VISIBLE_DEVICES hiding "
            "some of the node's GPUs?)"
        )
    return out


def _collective_plan(
    collectives: str | None,
    collective_sizes: str,
    rank: int | None,
    master: str | None,
    device: str,
    gpus: int = 0,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The all-reduce probe's rank counts and sizes from the options, checked before any
    probe runs. On cuda on loopback (one rank per GPU of this node) the default counts are
    clamped to the ``gpus`` this process sees, with a warning; counts given that exceed them
    are refused."""
    from sailor.profiler.collective_probe import sweep_sizes

    ranks: tuple[int, ...]
    if collectives is None:
        ranks = _DEFAULT_COLLECTIVES
    else:
        ranks = _ints(collectives, "collectives") if collectives.strip() else ()
    if rank is not None and (rank not in (0, 1) or not master):
        raise fail(f"--rank={rank}, --master={master!r}: a side is --rank 0 or 1, with --master")
    if any(n < 2 for n in ranks):
        raise fail(f"--collectives={collectives!r}: an all-reduce needs at least 2 ranks")
    if rank is not None and ranks:
        ranks = (2,)  # one rank per node
    elif device == "cuda" and ranks:
        over = [n for n in ranks if n > gpus]
        if over and collectives is not None:
            raise fail(
                f"--collectives={collectives!r}: one rank per GPU, but this process sees "
                f"{gpus} GPU(s): give rank counts up to {gpus} (CUDA_VISIBLE_DEVICES?)"
            )
        if over:
            ranks = tuple(n for n in ranks if n <= gpus)
            among = ", ".join(map(str, ranks)) if ranks else "no"
            _warn(
                f"--collectives (default {','.join(map(str, _DEFAULT_COLLECTIVES))}): this "
                f"process sees {gpus} GPU(s), one rank per GPU: all-reduces among {among} "
                f"ranks only (not {', '.join(map(str, over))})"
            )
    if collective_sizes.strip() == "auto":
        sizes = sweep_sizes(device)
    else:
        sizes = _ints(collective_sizes, "collective-sizes") if collective_sizes.strip() else ()
    if any(b < 8 for b in sizes):
        raise fail(f"--collective-sizes={collective_sizes!r}: sizes are bytes, at least 8")
    return ranks, sizes


@dataclass(frozen=True)
class _CollectiveProbe:
    """The all-reduce probe as ``sailor profile network`` runs it after the link probe."""

    src: Endpoint
    statistic: str
    sizes: tuple[int, ...]
    device: str
    rank: int | None
    master: str | None
    """Where rank 0 listens for it (the port after the link probe's), with --rank."""
    gpu: int

    def run(self, con: Console, ranks: int) -> CollectiveLatency:
        """The all-reduce among ``ranks`` ranks (each count is saved before the next runs)."""
        from sailor.profiler.collective_probe import collective_latencies

        between = (
            "on this node" if self.rank is None else f"between 2 nodes (rank 0 at {self.master})"
        )
        with con.status(f"timing all-reduces {between}: {ranks} ranks..."):
            (lat,) = collective_latencies(
                self.src,
                (ranks,),
                self.statistic,
                load=f", load average {os.getloadavg()[0]:.2f}",
                sizes=self.sizes,
                device=self.device,
                rank=self.rank,
                master=self.master,
                gpu=self.gpu,
            )
        return lat


def _with_collectives(
    net: NetworkProfile, src: Endpoint, ranks: tuple[int, ...], lats: list[CollectiveLatency]
) -> NetworkProfile:
    """``net`` with ``lats`` replacing its all-reduces of ``src`` at those rank counts and
    scope."""
    if not lats:
        return net
    scope = lats[0].scope
    kept = tuple(
        c
        for c in net.collectives
        if not (c.endpoint == src and c.ranks in set(ranks) and c.scope == scope)
    )
    return NetworkProfile.model_validate(
        {**net.model_dump(), "collectives": [c.model_dump() for c in (*kept, *lats)]}
    )


def _print_link(
    con: Console,
    src: Endpoint,
    dst: Endpoint,
    points: Sequence[ProbePoint],
    statistic: str,
    curve: BandwidthCurve,
    resid: Sequence[float],
    load: float,
    intra: bool = False,
) -> None:
    """The probe's points against the fitted curve, then the curve."""
    title = (
        f"intra-node {src.zone}/{src.gpu_type}x{src.gpus_per_node}"
        if intra
        else f"{src.zone}/{src.gpu_type}x{src.gpus_per_node} -> {dst.zone}/"
        f"{dst.gpu_type}x{dst.gpus_per_node}"
    )
    t = Table(title=title)
    for col in ("bytes", "one-way ms", "±", "GB/s", "fit GB/s", "fit time err"):
        t.add_column(col, justify="right")
    for p, r in zip(points, resid, strict=True):
        t.add_row(
            f"{p.nbytes:,}",
            _ms(p.time.central(statistic)),
            _ms(p.time.stdev_s),
            f"{p.nbytes / p.time.central(statistic) / 1e9:.3f}",
            f"{curve.gbps(p.nbytes):.3f}",
            f"{100 * r:+.1f}%",
        )
    print_table(con, t)
    c0, c1, c2 = curve.coeffs
    con.print(
        f"GB/s = {c0:.4g}·L² + {c1:.4g}·L + {c2:.4g} (L = log2(bytes/1e6)), "
        f"max {curve.max_gbps:.3f} GB/s, latency {curve.latency_s * 1e3:.3f} ms; "
        f"mean |time error| {100 * statistics.fmean(abs(r) for r in resid):.1f}%; "
        f"load average {load:.2f}"
    )


@profile_app.command("estimate")
def estimate_cmd(
    gpu: str = typer.Option(..., help="GPU type to estimate (catalog name, e.g. H100-80)."),
    from_db: Path = typer.Option(..., "--from", help="ProfileDB with measured/imported GPUs."),
    out: Path | None = typer.Option(None, "-o", "--out", help="Output (default: --from)."),
    model_file: Path | None = typer.Option(None, help="ModelSpec file (default: catalog)."),
    tp: str | None = typer.Option(None, help="TP degrees (default: those measured)."),
    mbs: str | None = typer.Option(None, help="Microbatch sizes (default: those measured)."),
    affine: bool = typer.Option(False, help="Fit latency + scale instead of a pure scale."),
) -> None:
    """Roofline scaled by measured efficiency; leave-one-GPU-out error on the database."""
    from sailor.profiler.calibrated_estimate import (
        calibrated_efficiencies,
        estimate_gpu,
        leave_one_gpu_out,
        measured_grid,
    )

    db = load_model(from_db, ProfileDB)
    spec = _model(db.model, model_file)
    specs = catalog.gpus()
    if gpu not in specs:
        raise fail(f"--gpu={gpu!r}: not in the catalog (known: {', '.join(specs)})")
    table = calibrated_efficiencies(db, spec, specs, affine=affine)
    measured = sorted({k for g in db.gpu_types() for k in measured_grid(db, g)})
    tps = _ints(tp, "tp") if tp else tuple(sorted({t for t, _ in measured})) or (1,)
    bs = _ints(mbs, "mbs") if mbs else tuple(sorted({b for _, b in measured})) or (1,)
    est = estimate_gpu(spec, specs[gpu], table, [(t, b) for t in tps for b in bs])
    est = est.model_copy(
        update={
            "meta": {
                f"{gpu}.estimated_from": ",".join(
                    g for g in db.gpu_types() if g in specs and g != gpu
                )
            }
        }
    )
    target = out or from_db
    merged, dropped = merge_db(_existing_db(target), est)
    save_db(merged, target)
    con = Console()
    con.print(
        f"{gpu}: {len(est.timings)} estimated entries for {spec.name} (tp {tps}, mbs {bs}) "
        f"written to {target}; {dropped} kept from a measured/imported source"
    )
    rows = leave_one_gpu_out(db, spec, specs, affine=affine)
    if not rows:
        con.print("leave-one-GPU-out: needs at least two measured GPU types with spec sheets")
        return
    t = Table(
        title=f"leave-one-GPU-out on {from_db.name} ({spec.name}): |error| of fwd+bwd "
        "(all layers) and of the update, calibrated vs plain roofline"
    )
    for col in ("gpu", "points", "fwd+bwd cal.", "roofline", "update cal.", "roofline"):
        t.add_column(col, justify="right")
    by: dict[str, list[LooRow]] = {}
    for r in rows:
        by.setdefault(r.gpu_type, []).append(r)
    for g, rs in sorted(by.items()):
        t.add_row(g, str(len(rs)), *_errs(rs))
    t.add_row("all", str(len(rows)), *_errs(rows), style="bold")
    print_table(con, t)


def _errs(rs: list[LooRow]) -> list[str]:
    def m(f: str) -> str:
        return f"{100 * statistics.fmean(abs(getattr(r, f)) for r in rs):.1f}%"

    return [m("err"), m("roofline_err"), m("update_err"), m("roofline_update_err")]
