"""Profile every layer kind of a model on the local device and build a ProfileDB from it.

For each TP degree and microbatch size, each layer kind (embedding, transformer block, head
+ loss) is measured by :mod:`layer_bench` (in this process at TP 1, as real gloo TP ranks
above: :mod:`tp_procs`). The database gets one :class:`LayerProfile` per global layer:

* every block gets the measured block's figures. The blocks of a GPT are the same module
  with the same shapes, so their times differ only by noise; measuring one per (TP, mbs)
  and repeating it is cheaper and no less accurate. (The original artifact also copied
  blocks, but timed them with per-layer hooks and borrowed the optimizer step from a
  2-layer model; here each layer kind's update is its own AdamW step.)
* sizes per (TP, layer): parameters per TP rank; the bytes saved for backward fitted over
  the microbatch sizes measured as a part per sample (activations) and a part per
  microbatch (under autocast the compute-dtype copy of the layer's weights, which does not
  grow with the microbatch: :func:`saved_bytes_fit`); the output bytes per sample from the
  largest microbatch measured. Sizes are written
  only when the device computes in the model's precision: a CPU run of an fp16 model runs
  in fp32 (as the engine does on CPU) and its byte counts would be wrong for GPUs.
* on CPU, the process overhead (:mod:`overhead`) as the GPU type's ``DeviceOverhead``, and
  the framework's time outside the layers (:mod:`framework_time`) as its ``FrameworkTime``.
* ``meta``: device, software versions, date, repetition settings, and the peak memory
  growth of each measurement (the schema has no per-layer field for it); the (TP, mbs)
  units skipped because they ran out of GPU memory, with the cause (``<gpu>.skipped``,
  only when there are some).

Each (TP, mbs) is one unit (TP > 1: its own rank processes), freed before the next is built;
after each the caller gets the database so far (``on_unit``) to save, so a failure loses
only the unit it happened in.

I/O: runs torch and child processes; writes nothing (the CLI merges and saves).
"""

from __future__ import annotations

import datetime as dt
import gc
import json
import platform
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from sailor.profiler.layer_bench import measure_kinds
from sailor.profiler.layer_measurement import LayerMeasurement
from sailor.profiler.memory_bound import Window, device_budget, plan_window
from sailor.profiler.merge import SKIPPED
from sailor.profiler.precision import ComputePrecision, compute_precision, sizes_measured
from sailor.profiler.procs import RankFailedError
from sailor.profiler.timing import STATISTICS, CpuClock, RepeatSettings, Stats, throttle_factor
from sailor.schemas import LayerProfile, LayerSize, ModelSpec, ProfileDB
from sailor.schemas.profile import VOCAB_SPLIT_META, DeviceOverhead, FrameworkTime, HostSharing

__all__ = [
    "LayerRun",
    "device_description",
    "plan_windows",
    "preload",
    "profile_layers",
    "saved_bytes_fit",
    "to_profile_db",
]


@dataclass(frozen=True)
class LayerRun:
    """What to profile and how."""

    spec: ModelSpec
    gpu_type: str
    device: str = "cpu"
    tps: tuple[int, ...] = (1,)
    mbs: tuple[int, ...] = (1, 2, 4, 8)
    settings: RepeatSettings = field(default_factory=RepeatSettings)
    threads: int = 1
    """torch intra-op threads on CPU (the worker's default is 1)."""
    measure_memory: bool = True
    measure_overhead: bool = True
    """On CPU: the process memory overhead (overhead.py) and the engine's time outside the
    layers (framework_time.py), both from the real engine on the nano model."""
    statistic: str = "median"
    """Central value written to the database: 'median' (default), 'mean', or 'scaled' (under
    a CPU quota: each layer's median times its measurement's wall over CPU time; timing.py)."""
    in_situ: bool = True
    """Time every layer inside the whole model (in_situ.py), or inside the window of it the
    device holds (memory_bound.py); False: each kind alone."""
    host_ranks: int = 0
    """On CPU: measure how up to this many ranks share the host's cores (CPU test scaffolding,
    cpu_host/sharing.py); 0 (the default): not measured."""
    host_pin: bool = False
    """Measure host sharing with rank r bound to core r % cores (runs that pin their ranks)."""
    memory_limit: int | None = None
    """Bytes the layer measurements may use per device (memory_bound.py). On CUDA the device's
    free memory less a margin bounds it anyway; on the CPU None means no bound."""
    cpu_quota: float | None = None
    """The CPU quota (cores) the caller runs the measurement under, recorded in ``meta``;
    applying it is the caller's (``sailor profile layers --cpu-quota``: a cgroup)."""

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device={self.device!r}: use 'cpu' or 'cuda'")
        bad = [t for t in self.tps if t < 1 or t & (t - 1)]
        if bad or not self.tps:
            raise ValueError(f"tps={self.tps}: need powers of two >= 1")
        for t in self.tps:
            if self.spec.num_heads % t or self.spec.kv_heads % t:
                raise ValueError(
                    f"tps={self.tps}: tp={t} must divide num_heads={self.spec.num_heads} "
                    f"and kv_heads={self.spec.kv_heads}"
                )
        if self.statistic not in STATISTICS:
            raise ValueError(f"statistic={self.statistic!r}: use one of {', '.join(STATISTICS)}")
        if not self.mbs or any(b < 1 for b in self.mbs):
            raise ValueError(f"mbs={self.mbs}: need microbatch sizes >= 1")
        if self.threads < 1:
            raise ValueError(f"threads={self.threads}: torch needs at least 1 intra-op thread")
        if self.host_ranks < 0:
            raise ValueError(f"host_ranks={self.host_ranks}: must be >= 0")
        if self.memory_limit is not None and self.memory_limit <= 0:
            raise ValueError(f"memory_limit={self.memory_limit}: must be > 0 bytes")
        if self.cpu_quota is not None and self.cpu_quota <= 0:
            raise ValueError(f"cpu_quota={self.cpu_quota}: must be > 0 cores")

    @property
    def total(self) -> int:
        return len(self.tps) * len(self.mbs)


def preload() -> None:
    """Import what the measurements import on first use, before the first unit: building the
    first optimizer imports ``torch._dynamo`` (~3 s of CPU here, 7.5 s of wall time at 0.4
    cores), which a run under a CPU quota would spend measuring, and whose import can keep
    the frame that triggered it (``in_situ.measure_model``'s, with the first unit's model)
    alive until a full collection. Cheap once imported: :func:`profile_layers` calls it
    every time."""
    from sailor.megatron_patch.engine import TrainConfig, make_optimizer

    make_optimizer([torch.nn.Parameter(torch.zeros(1))], TrainConfig())


def device_description(device: str) -> str:
    """Human-readable name of the device measured."""
    if device == "cuda":
        return str(torch.cuda.get_device_name(0))
    try:
        for line in open("/proc/cpuinfo").read().splitlines():  # noqa: PTH123, SIM115
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def profile_layers(
    run: LayerRun,
    on_progress: Callable[[str, int], None] | None = None,
    on_unit: Callable[[ProfileDB], None] | None = None,
) -> tuple[ProfileDB, list[LayerMeasurement]]:
    """Measure every (TP, mbs, kind) of ``run``; ``on_progress(description, done)``.

    ``on_unit(db)`` after each (TP, mbs) unit, finished or skipped: the database of every
    unit so far (no overhead, framework time or host sharing yet), for the caller to save, so
    that a failure later loses only the unit it happened in. A unit that runs out of GPU
    memory is skipped, its cause in ``meta["<gpu>.skipped"]``, and the next one runs; any
    other error is raised. Between units the unit's model is freed (:func:`_release`).
    The caller's torch thread count is restored on return, as on an error (a CPU run sets
    it to ``run.threads`` for its measurements).
    """
    threads = torch.get_num_threads()
    try:
        return _profile_layers(run, on_progress, on_unit)
    finally:
        torch.set_num_threads(threads)


def _profile_layers(
    run: LayerRun,
    on_progress: Callable[[str, int], None] | None,
    on_unit: Callable[[ProfileDB], None] | None,
) -> tuple[ProfileDB, list[LayerMeasurement]]:
    """:func:`profile_layers`, leaving the thread count as its measurements set it."""

    def note(desc: str, n: int) -> None:
        if on_progress is not None:
            on_progress(desc, n)

    if run.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device=cuda: CUDA is not available here")
    dev = torch.device("cuda", 0) if run.device == "cuda" else torch.device("cpu")
    if run.device == "cpu":
        torch.set_num_threads(run.threads)
    precision = compute_precision(run.spec, dev)
    windows = plan_windows(run, precision)  # refuses a layer too large before building any
    preload()  # the first optimizer's lazy import would pin the first unit's model (_release)
    units = _Units(run, precision, windows)
    for tp in run.tps:
        for mbs in run.mbs:
            where = "" if tp == 1 else (" gloo ranks" if run.device == "cpu" else " NCCL ranks")
            note(f"tp={tp}{where} mbs={mbs}", 0)
            try:
                ms, slowdown = _measure_unit(run, tp, mbs, dev, windows[(tp, mbs)].blocks)
            except torch.OutOfMemoryError as exc:
                units.skipped[(tp, mbs)] = _first_line(f"{type(exc).__name__}: {exc}")
            except RankFailedError as exc:
                cause = _out_of_memory(exc.stderr)
                if cause is None:
                    raise
                units.skipped[(tp, mbs)] = f"rank {exc.rank}: {cause}"
            else:
                units.out.extend(ms)
                if slowdown is not None:
                    units.slowdown[(tp, mbs)] = slowdown
            _release(dev)  # before the next unit builds its model (or its ranks start)
            note(f"tp={tp} mbs={mbs} done", 1)
            if on_unit is not None:
                on_unit(units.database())
    overhead: int | None = None
    if run.device == "cpu" and run.measure_overhead:
        note("process overhead (2 gloo ranks)", 0)
        from sailor.profiler.overhead import measure_cpu_overhead

        overhead = measure_cpu_overhead(run.threads)
    framework: FrameworkTime | None = None
    if run.device == "cpu" and run.measure_overhead:
        note("framework time (real engine, nano model)", 0)
        from sailor.profiler.framework_time import measure_framework_time

        framework, _ = measure_framework_time(run.spec, run.gpu_type, run.threads, run.statistic)
    host: HostSharing | None = None
    if run.device == "cpu" and run.host_ranks:
        note(f"host sharing (1..{run.host_ranks} ranks at once)", 0)
        from sailor.profiler.cpu_host.sharing import HostRun, measure_host_sharing

        mbs = sorted(run.mbs)[len(run.mbs) // 2]
        host = measure_host_sharing(
            HostRun(
                spec=run.spec,
                gpu_type=run.gpu_type,
                mbs=mbs,
                max_ranks=run.host_ranks,
                threads=run.threads,
                pin=run.host_pin,
            )
        )
    db = units.database(overhead)
    date = db.meta.get(f"{run.gpu_type}.date", "")
    if framework is not None:
        stamped = framework.model_copy(update={"source": f"{framework.source} {date}"})
        db = db.model_copy(update={"framework": (stamped,)})
    if host is not None:
        db = db.model_copy(
            update={"hosts": (host.model_copy(update={"source": f"{host.source} {date}"}),)}
        )
    return db, units.out


@dataclass
class _Units:
    """What the (TP, mbs) units of one run have measured so far, and its database."""

    run: LayerRun
    precision: ComputePrecision
    windows: dict[tuple[int, int], Window]
    out: list[LayerMeasurement] = field(default_factory=list)
    slowdown: dict[tuple[int, int], float] = field(default_factory=dict)
    """Wall over CPU time of each TP 1 unit (timing.CpuClock)."""
    skipped: dict[tuple[int, int], str] = field(default_factory=dict)
    """Units that ran out of GPU memory, with the cause."""

    def database(self, overhead: int | None = None) -> ProfileDB:
        run = self.run
        meta = {
            **_meta(run, self.out),
            f"{run.gpu_type}.precision": self.precision,
            f"{run.gpu_type}.memory_bound": json.dumps(
                {f"tp{tp}.mbs{b}": w.describe(run.spec) for (tp, b), w in self.windows.items()},
                sort_keys=True,
            ),
        }
        if self.skipped:
            meta[run.gpu_type + SKIPPED] = json.dumps(
                {f"tp{tp}.mbs{b}": why for (tp, b), why in self.skipped.items()}, sort_keys=True
            )
        return to_profile_db(
            run.spec,
            run.gpu_type,
            self.out,
            meta,
            sizes_measured(run.spec, self.precision),
            overhead,
            run.statistic,
            self.precision,
            self.slowdown,
        )


def _measure_unit(
    run: LayerRun, tp: int, mbs: int, dev: torch.device, blocks: int
) -> tuple[list[LayerMeasurement], float | None]:
    """One (TP, mbs) unit: in this process at TP 1 (with its wall over CPU time), else as
    ``tp`` fresh rank processes of this mbs alone (a rank that fails loses this unit only)."""
    if tp == 1:
        with CpuClock() as clock:
            ms = measure_kinds(
                run.spec,
                mbs,
                dev,
                run.settings,
                None,
                run.in_situ,
                run.measure_memory,
                blocks=blocks,
            )
        return ms, clock.slowdown
    from sailor.profiler.tp_procs import measure_tp

    ms = measure_tp(
        run.spec,
        tp,
        [mbs],
        run.settings,
        run.threads,
        measure_memory=run.measure_memory,
        in_situ=run.in_situ,
        device=run.device,
        blocks={mbs: blocks},
    )
    return ms, None


_OOM_MARKERS = ("OutOfMemoryError", "CUDA out of memory")
"""What a rank's stderr shows when it ran out of GPU memory (torch.OutOfMemoryError's name
and the caching allocator's message)."""


def _out_of_memory(stderr: str) -> str | None:
    """The line of a failed rank's ``stderr`` saying it ran out of GPU memory, or None."""
    for line in reversed(stderr.splitlines()):
        if any(m in line for m in _OOM_MARKERS):
            return _first_line(line.strip())
    return None


def _first_line(text: str, limit: int = 300) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


def plan_windows(run: LayerRun, precision: ComputePrecision) -> dict[tuple[int, int], Window]:
    """What each (TP, mbs) measurement of ``run`` builds (:mod:`memory_bound`), decided before
    anything is built: the device's budget (the least free memory of the GPUs a TP degree
    uses, less a margin, at most ``run.memory_limit``; on the CPU the limit alone).
    Raises :class:`~sailor.profiler.memory_bound.LayerTooLargeError` for a layer that does
    not fit alone."""
    from sailor.profiler.procs import check_devices

    e = 4 if precision == "fp32" else 2
    out: dict[tuple[int, int], Window] = {}
    for tp in run.tps:
        gpus = list(range(tp)) if run.device == "cuda" else []
        check_devices(run.device, gpus)  # a TP degree above the host's GPUs: refused here
        limit = device_budget(gpus, run.memory_limit)
        for mbs in run.mbs:
            out[(tp, mbs)] = plan_window(run.spec, tp, mbs, e, limit, run.in_situ)
    return out


def _release(dev: torch.device) -> None:
    """Free a finished (TP, mbs) unit before the next one builds its model.

    A full collection first: a reference cycle (a frame kept by a lazy import, an exception's
    traceback) can hold the unit's ``measure_model`` frame, and with it the whole model, its
    optimizer state and activations, until the collector's next full pass, while the next
    unit's model is built beside it. On CUDA the caching allocator then gives the freed
    blocks back to the driver: it would keep them on ``cuda:0`` while the TP > 1 rank 0
    starts there."""
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def _meta(run: LayerRun, ms: list[LayerMeasurement]) -> dict[str, str]:
    g = run.gpu_type
    peaks = {f"tp{m.tp}.mbs{m.mbs}.{m.kind}": m.peak_growth_bytes for m in ms}
    method = (
        "in place: the whole model or a window of it (memory_bound), timestamps between layers"
        if run.in_situ
        else "each alone"
    )
    s = run.settings
    out = {
        "tool": "sailor profile layers",
        f"{g}.device": device_description(run.device),
        f"{g}.date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        f"{g}.torch": torch.__version__,
        f"{g}.python": platform.python_version(),
        f"{g}.platform": platform.platform(),
        f"{g}.threads": str(run.threads),
        f"{g}.clock": "cuda events" if run.device == "cuda" else "time.perf_counter (monotonic)",
        f"{g}.repetitions": (
            f"warmup {s.warmup}, {s.min_reps}..{s.max_reps} reps until {s.min_time_s} s; "
            f"{run.statistic}, spread = stdev"
        ),
        f"{g}.method": method,
        # the engine's embedding and head split by vocabulary at these TP degrees (the
        # simulator notes measured TP > 1 entries without it: an older engine's whole head)
        **{f"{g}.tp{t}.{VOCAB_SPLIT_META}": "true" for t in sorted({m.tp for m in ms})},
        f"{g}.peak_growth_bytes": json.dumps(peaks, sort_keys=True),
        f"{g}.peak_growth_method": (
            "torch.cuda max_memory_allocated"
            if run.device == "cuda"
            else "torch.profiler CPU allocator events (profile_memory=True)"
        ),
    }
    if run.cpu_quota is not None:
        out[f"{g}.cpu_quota"] = f"{run.cpu_quota:g} cores (cgroup cpu controller, 100 ms period)"
    return out


def saved_bytes_fit(points: list[tuple[int, int]]) -> tuple[int, int]:
    """(bytes per sample, bytes per microbatch) of a layer's saved-for-backward bytes,
    fitted over microbatch sizes: ``saved(b) = per_microbatch + b * per_sample``.

    Under autocast a forward saves the compute-dtype cast of every weight once, whatever the
    microbatch size; dividing the saved bytes by the microbatch size would count those copies
    as activations and scale them with it (an 8-block 8B-Llama stage profiled up to
    microbatch 8 and run at microbatch 1 with 4 in flight holds ~14 GB of copies; that
    division predicted ~1.7 GB). Least squares over the measured sizes
    (saved bytes are counted exactly, so the points lie on a line); one size, or a negative
    intercept, gives no per-microbatch part: bytes / size at the largest microbatch.
    """
    by_b = dict(sorted(points))
    bmax = max(by_b)
    through_origin = round(by_b[bmax] / bmax), 0
    if len(by_b) < 2:
        return through_origin
    n = len(by_b)
    mb = sum(by_b) / n
    my = sum(by_b.values()) / n
    var = sum((b - mb) ** 2 for b in by_b)
    slope = sum((b - mb) * (y - my) for b, y in by_b.items()) / var
    intercept = my - slope * mb
    if intercept < 0 or slope < 0:
        return through_origin
    return round(slope), round(intercept)


def to_profile_db(
    spec: ModelSpec,
    gpu_type: str,
    ms: list[LayerMeasurement],
    meta: dict[str, str],
    write_sizes: bool = True,
    overhead_bytes: int | None = None,
    statistic: str = "median",
    precision: ComputePrecision | None = None,
    slowdown: Mapping[tuple[int, int], float] | None = None,
) -> ProfileDB:
    """The ProfileDB of measurements ``ms`` (every global layer gets its kind's figures),
    timed in ``precision`` (:mod:`precision`; None: not recorded). ``statistic="scaled"``
    multiplies the medians of each (TP, mbs) by its ``slowdown`` (wall over CPU time of its
    measurement), or where there is none by its :func:`throttle_factor` (timing.py)."""
    by_kind = {(m.tp, m.mbs, m.kind): m for m in ms if m.layer < 0}
    by_layer = {(m.tp, m.mbs, m.layer): m for m in ms if m.layer >= 0}

    def get(tp: int, mbs: int, layer: int) -> LayerMeasurement | None:
        return by_layer.get((tp, mbs, layer)) or by_kind.get((tp, mbs, spec.layer_kind(layer)))

    def central(stats: Stats, factor: float) -> float:
        return stats.median_s * factor if statistic == "scaled" else stats.central(statistic)

    timings: list[LayerProfile] = []
    for tp, mbs in sorted({(m.tp, m.mbs) for m in ms}):
        group = [m for m in by_layer.values() if (m.tp, m.mbs) == (tp, mbs)]
        factor = (slowdown or {}).get((tp, mbs)) or throttle_factor(
            s for m in group for s in (m.fwd, m.bwd, m.update)
        )
        for layer in range(spec.num_all_layers):
            kind = spec.layer_kind(layer)
            m = get(tp, mbs, layer)
            if m is None:
                raise ValueError(f"no measurement of layer {layer} at tp={tp} mbs={mbs}")
            timings.append(
                LayerProfile(
                    gpu_type=gpu_type,
                    tp=tp,
                    microbatch_size=mbs,
                    layer=layer,
                    kind=kind,
                    fwd_s=central(m.fwd, factor),
                    bwd_s=central(m.bwd, factor),
                    update_s=central(m.update, factor),
                    fwd_spread_s=m.fwd.stdev_s,
                    bwd_spread_s=m.bwd.stdev_s,
                    source="measured",
                    precision=precision,
                )
            )
    sizes: list[LayerSize] = []
    if write_sizes:
        for tp in sorted({m.tp for m in ms}):
            for layer in range(spec.num_all_layers):
                cands = [g for b in {m.mbs for m in ms if m.tp == tp} if (g := get(tp, b, layer))]
                if not cands:
                    continue
                big = max(cands, key=lambda m: m.mbs)
                per_sample, per_mb = saved_bytes_fit([(m.mbs, m.saved_bytes) for m in cands])
                sizes.append(
                    LayerSize(
                        tp=tp,
                        layer=layer,
                        params=big.params,
                        activation_bytes_per_sample=per_sample,
                        per_microbatch_bytes=per_mb,
                        output_bytes_per_sample=round(big.output_bytes / big.mbs),
                        input_bytes_per_sample=round(big.input_bytes / big.mbs),
                        source="measured",
                        precision=precision,
                    )
                )
    overheads: tuple[DeviceOverhead, ...] = ()
    if overhead_bytes is not None:
        from sailor.profiler.overhead import OVERHEAD_SOURCE

        date = meta.get(f"{gpu_type}.date", "")
        overheads = (
            DeviceOverhead(
                gpu_type=gpu_type, tp=1, bytes=overhead_bytes, source=f"{OVERHEAD_SOURCE} {date}"
            ),
        )
    return ProfileDB(
        model=spec.name,
        timings=tuple(timings),
        sizes=tuple(sizes),
        overheads=overheads,
        meta=meta,
    )
