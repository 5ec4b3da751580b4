"""Derive one GPU type's calibration constants from measured runs of plans.

Each constant comes from the measurement that isolates it, one measurement per constant (the
p2p pair shares one), in order, each using those before it (docs/simulator-model.md, sections
1, 4, 6 and 7):

* ``profiler_overhead_s`` (h): two runs of one single-stage, single-pipeline plan that differ
  only in the number of microbatches; their time difference per microbatch is the real time
  of one microbatch. ``h = (Σ_l profiled(f+g) − ΔT/Δm) / layers``. Without such a pair,
  the single-stage, single-pipeline run with the most microbatches whose reduce time was
  measured: ``(T − reduce − update) / m`` is its microbatch time. 0 without either.
* ``sync_fixed_s`` (c): median measured gradient-reduce time of the runs without data
  parallelism (one pipeline: no network involved); 0 without such runs.
* ``network_efficiency`` (η): geometric mean, over the runs with data parallelism, of the
  simulated all-reduce time of the first stage at η = 1 divided by the measured reduce time
  minus ``c``. Readings where the reduce time exceeds half the iteration are dropped (they
  include waiting for a straggling replica, not communication).
* ``p2p_efficiency`` (η_p2p) and ``p2p_fixed_s`` (c_p2p), from the runs with multi-stage
  pipelines: their pipeline phase (iteration minus gradient sync, simulated) against the
  measured iteration minus the measured reduce time. First each run's η_p2p at c_p2p = 0
  (bisection on log η_p2p over [0.01, 1]: the phase grows as η_p2p falls); a run faster than
  simulated even at η_p2p = 1, or slower even at 0.01, says only that it lies outside the
  range and is left out, as are straggler readings (as for η). With at least three readings
  at two or more microbatch sizes, the pair is fitted by least squares on the relative
  error of the phases (:func:`_two_terms`): the bytes per transfer differ with the
  microbatch size, the number of transfers little, which tells the fixed cost from the
  bandwidth. Otherwise c_p2p = 0 and η_p2p is the readings' geometric mean. Without a
  reading both are left unset (transfers then use η). The fixed cost holds the pipeline
  engine's work around each transfer (instruction dispatch, buffer handling), which the
  profile of the layers alone does not see; the efficiency, the bandwidth the transfers
  reach against the probed link (docs/simulator-model.md section 7b).
* ``efficiency_link_gbps``: the median over the runs of the peak of their node-to-node
  link (the link of the first stage's nodes among themselves), what the two efficiencies
  above are read on: on another link the simulator takes them there
  (``schemas.calibration.eta_on``).
* ``alloc_factor`` (κ): measured Δpeak / modelled Δactivations between the single-stage
  runs with the smallest and largest activation footprint; 1 without two such runs.
* ``communicator_bytes`` and ``memory_overhead_bytes`` (M0), from the memory residuals
  (measured − modelled peak, without either) and the number of NCCL communicators of each
  run's peak GPU under the runs' process groups: with two or more counts among the runs and
  residuals that grow with the count (the least-squares slope beyond twice its standard
  error), the slope is the bytes per communicator and M0 the median of residual − bytes ×
  count. Otherwise (one count, or residuals that do not grow: GH200's fall by 124 MB per
  communicator over 3-7) M0 is the median residual and holds up to the runs' most
  communicators (``communicators_covered``); a rank holding more is priced at ``base``'s
  bytes for each one beyond, outside what was measured.

The runs are simulated with ``base``'s deployment structure, which must be the one they ran
on (η is relative to the gradient bytes it implies); the result records it as
``fitted_under``, so that replays of the same runs use it whatever deployment is planned.

Pure: measurements come in as values; nothing is read from disk here.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from sailor.schemas import (
    Calibration,
    Deployment,
    Estimate,
    GPUCalibration,
    GPUSpec,
    ModelSpec,
    NetworkProfile,
    Plan,
    PriceTable,
    ProfileDB,
)
from sailor.simulator.lookup import StageCosts, layer_table
from sailor.simulator.network_model import inter_curve
from sailor.simulator.simulate import simulate

__all__ = ["MeasuredRun", "calibrate_gpu"]

_STRAGGLER_FRACTION = 0.5
"""A reduce time above this fraction of the iteration is waiting, not communication."""

_P2P_RANGE = (0.01, 1.0)
"""Bounds of the η_p2p a run can read."""

_P2P_HALVINGS = 24
"""Bisection steps on log η_p2p over _P2P_RANGE: 2e-7 relative precision."""


_TWO_TERM_STEPS = 12
"""Gauss-Newton steps of the two-term p2p fit (it converges in two on the GH200 runs)."""

_TWO_TERM_STARTS = (0.02, 0.1, 0.5)
"""Starting efficiencies tried beside the readings' geometric mean: the squared error is
not convex (phases are maxima of paths), and one start can stop in a local minimum."""

_HALVINGS_PER_STEP = 8
_FIXED_STEP_S = 1e-4
"""Forward-difference steps: 0.1 ms on the fixed cost, 1% on u = 1/η_p2p."""
_U_STEP = 0.01


@dataclass(frozen=True)
class MeasuredRun:
    """One measured iteration of a plan."""

    name: str
    plan: Plan
    iteration_time_s: float
    peak_memory_bytes: int
    grad_reduce_s: float | None = None


def _gpu_of(plan: Plan) -> str:
    types = {s.replica.gpu_type for p in plan.pipelines for s in p.stages}
    if len(types) != 1:
        raise ValueError(f"plan {plan.plan_id}: calibration needs one GPU type, got {types}")
    return types.pop()


def _single_stage(plan: Plan) -> bool:
    return all(p.depth == 1 for p in plan.pipelines)


def _hook(
    runs: Sequence[MeasuredRun],
    model: ModelSpec,
    profiles: ProfileDB,
    gpu: str,
    base: Calibration,
    specs: Mapping[str, GPUSpec],
    network: NetworkProfile | None = None,
) -> tuple[float, str]:
    singles = [r for r in runs if len(r.plan.pipelines) == 1 and _single_stage(r.plan)]
    best: tuple[MeasuredRun, MeasuredRun] | None = None
    for i, a in enumerate(singles):
        for b in singles[i + 1 :]:
            pa, pb = a.plan.pipelines[0], b.plan.pipelines[0]
            same = pa.stages == pb.stages and pa.microbatch_size == pb.microbatch_size
            if not same or pa.num_microbatches == pb.num_microbatches:
                continue
            gap = abs(pa.num_microbatches - pb.num_microbatches)
            if best is None or gap > abs(
                best[0].plan.pipelines[0].num_microbatches
                - best[1].plan.pipelines[0].num_microbatches
            ):
                best = (a, b)
    if best is not None:
        a, b = best
        pa, pb = a.plan.pipelines[0], b.plan.pipelines[0]
        per_mb = (b.iteration_time_s - a.iteration_time_s) / (
            pb.num_microbatches - pa.num_microbatches
        )
        what = f"{a.name} vs {b.name}"
    else:
        # one run alone, its reduce time measured: what is left after the reduce and the
        # optimizer step is its microbatches (the run with the most of them)
        timed = [r for r in singles if r.grad_reduce_s is not None]
        if not timed:
            return 0.0, (
                "h: no pair of runs differing only in microbatches, nor a single-stage run "
                "with its reduce time; 0"
            )
        a = max(timed, key=lambda r: r.plan.pipelines[0].num_microbatches)
        pa = a.plan.pipelines[0]
        update = sum(
            c.update_s for c in _table(profiles, model, gpu, a.plan, base, specs, network).layers
        )
        per_mb = (a.iteration_time_s - (a.grad_reduce_s or 0.0) - update) / pa.num_microbatches
        what = f"{a.name} alone (minus its reduce and update)"
    table = _table(profiles, model, gpu, a.plan, base, specs, network)
    prof = sum(c.fwd_s + c.bwd_s for c in table.layers)
    h = max(0.0, (prof - per_mb) / len(table.layers))
    return h, (
        f"h={h * 1e3:.3f} ms/layer from {what}: {per_mb * 1e3:.1f} ms per "
        f"microbatch measured, {prof * 1e3:.1f} ms profiled"
    )


def _table(
    profiles: ProfileDB,
    model: ModelSpec,
    gpu: str,
    plan: Plan,
    base: Calibration,
    specs: Mapping[str, GPUSpec],
    network: NetworkProfile | None = None,
) -> StageCosts:
    """The raw profile's layer table of a single-stage plan's stage (no calibration), in the
    structure the runs are simulated under (``base``: a whole or split head, the embedding's
    all-reduce width, the link efficiency of estimated TP all-reduces; ``network``: their
    links, as the simulation of the runs prices them)."""
    p = plan.pipelines[0]
    r = p.stages[0].replica
    return layer_table(
        profiles,
        model,
        GPUCalibration(
            gpu_type=gpu,
            tp_link_efficiency=base.for_gpu(gpu).tp_link_efficiency,
            tp_link_efficiency_pcie=base.for_gpu(gpu).tp_link_efficiency_pcie,
        ),
        specs,
        gpu,
        r.tp,
        p.microbatch_size,
        base.vocab_parallel,
        base.activations,
        network,
        base.mixed_precision,
    )


def _reduce_readable(r: MeasuredRun) -> bool:
    """``r`` has a reduce time that is communication, not waiting for a straggler."""
    return (
        r.grad_reduce_s is not None and r.grad_reduce_s <= _STRAGGLER_FRACTION * r.iteration_time_s
    )


def _p2p_reading(phase: Callable[[float], float], measured: float) -> float:
    """log η_p2p at which ``phase(η_p2p)`` (falling as η_p2p grows) equals ``measured``."""
    lo, hi = math.log(_P2P_RANGE[0]), math.log(_P2P_RANGE[1])
    if phase(math.exp(hi)) >= measured:
        return hi
    if phase(math.exp(lo)) <= measured:
        return lo
    for _ in range(_P2P_HALVINGS):
        mid = (lo + hi) / 2
        if phase(math.exp(mid)) > measured:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _two_terms(
    phases: Sequence[Callable[[float, float], float]], measured: Sequence[float], eta0: float
) -> tuple[float, float]:
    """(fixed cost per transfer, η_p2p) minimizing the squared relative error of the
    simulated pipeline phases ``phases[i](η_p2p, fixed)`` against ``measured``, with
    ``fixed >= 0`` and η_p2p in ``_P2P_RANGE``: the best of a descent from (0, ``eta0``) and
    from (0, each of ``_TWO_TERM_STARTS``)."""
    u_lo, u_hi = 1.0 / _P2P_RANGE[1], 1.0 / _P2P_RANGE[0]
    best: tuple[float, float, float] | None = None
    for eta in (eta0, *_TWO_TERM_STARTS):
        c, u, sse = _descend(phases, measured, min(u_hi, max(u_lo, 1.0 / eta)), u_lo, u_hi)
        if best is None or sse < best[0]:
            best = (sse, c, u)
    assert best is not None
    return best[1], 1.0 / best[2]


def _descend(
    phases: Sequence[Callable[[float, float], float]],
    measured: Sequence[float],
    u: float,
    u_lo: float,
    u_hi: float,
) -> tuple[float, float, float]:
    """Gauss-Newton from (0, ``u``) on (fixed, u = 1/η_p2p), in which a phase is piecewise
    linear (every transfer time is ``fixed + bytes·u/BW + gather``), with forward
    differences and steps halved until the error falls; each step solves the 2 × 2 least
    squares on the box. Returns (fixed, u, squared relative error)."""

    def err(c: float, u: float) -> tuple[list[float], float]:
        p = [f(1.0 / u, c) for f in phases]
        return p, sum((x / m - 1.0) ** 2 for x, m in zip(p, measured, strict=True))

    c = 0.0
    p, sse = err(c, u)
    for _ in range(_TWO_TERM_STEPS):
        dc, du = _FIXED_STEP_S, u * _U_STEP
        jc = [(f(1.0 / u, c + dc) - x) / dc for f, x in zip(phases, p, strict=True)]
        ju = [(f(1.0 / (u + du), c) - x) / du for f, x in zip(phases, p, strict=True)]
        # linear model of the relative residual: a·(c', u') − y
        rows = [(gc / m, gu / m) for gc, gu, m in zip(jc, ju, measured, strict=True)]
        ys = [
            1.0 - (x - gc * c - gu * u) / m
            for x, gc, gu, m in zip(p, jc, ju, measured, strict=True)
        ]
        target = _box_lsq(rows, ys, u_lo, u_hi)
        if target is None:
            break
        moved = False
        for k in range(_HALVINGS_PER_STEP):
            w = 0.5**k
            cn, un = c + w * (target[0] - c), u + w * (target[1] - u)
            pn, sn = err(cn, un)
            if sn < sse:
                moved = abs(cn - c) > 1e-7 or abs(un - u) > 1e-6 * u
                c, u, p, sse = cn, un, pn, sn
                break
        if not moved:
            break
    return c, u, sse


def _box_lsq(
    rows: Sequence[tuple[float, float]], ys: Sequence[float], u_lo: float, u_hi: float
) -> tuple[float, float] | None:
    """argmin over c >= 0, u_lo <= u <= u_hi of Σ (a_i·c + b_i·u − y_i)²; None if singular."""

    def sse(c: float, u: float) -> float:
        return sum((a * c + b * u - y) ** 2 for (a, b), y in zip(rows, ys, strict=True))

    saa = sum(a * a for a, _ in rows)
    sbb = sum(b * b for _, b in rows)
    sab = sum(a * b for a, b in rows)
    say = sum(a * y for (a, _), y in zip(rows, ys, strict=True))
    sby = sum(b * y for (_, b), y in zip(rows, ys, strict=True))
    det = saa * sbb - sab * sab
    cands: list[tuple[float, float]] = []
    if det > 1e-12 * saa * sbb:
        c, u = (say * sbb - sby * sab) / det, (sby * saa - say * sab) / det
        if c >= 0 and u_lo <= u <= u_hi:
            return c, u
    if sbb > 0:  # c = 0
        cands.append((0.0, min(u_hi, max(u_lo, sby / sbb))))
    if saa > 0:  # u at a bound
        for ub in (u_lo, u_hi):
            cands.append((max(0.0, (say - sab * ub) / saa), ub))
    return min(cands, key=lambda x: sse(*x)) if cands else None


def _memory_residual(est: Estimate, run: MeasuredRun) -> tuple[int, int]:
    """(measured − modelled peak memory, communicators of the modelled peak's GPU) of a run
    simulated without communicator bytes or M0."""
    peak = max(est.memory, key=lambda m: m.total)
    return run.peak_memory_bytes - peak.total, peak.num_communicators


def _communicators_and_m0(
    readings: Sequence[tuple[int, int]], prior_bytes: int
) -> tuple[int, int, int, str]:
    """(bytes per communicator, communicators M0 holds, M0, why) from (residual, count) per
    run. Where the runs hold two counts or more and their residuals grow with the count
    (the least-squares slope above twice its standard error), the slope is the bytes per
    communicator and M0 the median of what is left (it holds none). Otherwise the runs show
    no cost per communicator within their counts: M0 is the median residual and holds up
    to their most, and a rank holding more is priced at ``prior_bytes`` per communicator
    beyond it (outside what was measured)."""
    counts = [n for _, n in readings]
    most = max(counts, default=0)
    if len(set(counts)) >= 2:
        mean_n = statistics.mean(counts)
        mean_r = statistics.mean(r for r, _ in readings)
        sxx = sum((n - mean_n) ** 2 for n in counts)
        sxy = sum((n - mean_n) * (r - mean_r) for r, n in readings)
        slope = sxy / sxx
        # its standard error: a slope within two of it is the runs' spread, not a cost
        ssr = sum((r - mean_r - slope * (n - mean_n)) ** 2 for r, n in readings)
        se = math.sqrt(ssr / (len(readings) - 2) / sxx) if len(readings) > 2 else math.inf
        span = (
            f"their {min(counts)}-{most} NCCL communicators ({slope / 1e6:+.0f} ± "
            f"{se / 1e6:.0f} MB each)"
        )
        if slope > 2 * se:
            comm, covered = int(slope), 0
            why = f"communicator_bytes={comm / 1e6:.0f} MB: slope of {len(readings)} runs' "
            why += f"memory residuals on {span}"
        else:
            comm, covered = prior_bytes, most
            why = (
                f"communicators_covered={most}: {len(readings)} runs' memory residuals do not "
                f"grow with {span} beyond twice its standard error, so M0 holds up to {most}; "
                f"more are priced at the base's {comm / 1e6:.0f} MB each"
            )
    else:
        comm, covered = prior_bytes, most
        why = (
            f"communicators_covered={most}: every run holds {most} communicators (the runs "
            f"cannot separate them from M0); more are priced at the base's {comm / 1e6:.0f} MB"
        )
    m0 = max(0, int(statistics.median(r - comm * max(0, n - covered) for r, n in readings)))
    why += f"; M0={m0 / 2**30:.2f} GiB: median residual of {len(readings)} runs"
    return comm, covered, m0, why


def calibrate_gpu(
    runs: Sequence[MeasuredRun],
    model: ModelSpec,
    profiles: ProfileDB,
    network: NetworkProfile,
    prices: PriceTable,
    *,
    gpu_specs: Mapping[str, GPUSpec] | None = None,
    base: Calibration | None = None,
    deployment_name: str = "measured",
) -> GPUCalibration:
    """Constants of the one GPU type the ``runs`` used (see the module docstring), with
    ``base``'s structure recorded as ``fitted_under`` (named ``deployment_name``)."""
    if not runs:
        raise ValueError("runs=[]: calibration needs at least one measured run")
    gpu = _gpu_of(runs[0].plan)
    for r in runs:
        if _gpu_of(r.plan) != gpu:
            raise ValueError(f"run {r.name}: GPU type differs from {gpu}")
    base = base or Calibration()
    specs = gpu_specs or {}
    why: list[str] = []

    h, note = _hook(runs, model, profiles, gpu, base, specs, network)
    why.append(note)

    dp1 = [r.grad_reduce_s for r in runs if len(r.plan.pipelines) == 1 and r.grad_reduce_s]
    c = statistics.median(dp1) if dp1 else 0.0
    why.append(f"c={c * 1e3:.1f} ms: median reduce time of {len(dp1)} runs without DP")

    def estimate(cal: GPUCalibration, run: MeasuredRun) -> Estimate:
        """``run``'s plan simulated with ``cal`` in ``base``'s structure."""
        return simulate(
            run.plan,
            model,
            profiles,
            network,
            prices,
            calibration=base.with_gpu(cal),
            gpu_specs=specs,
        )

    def sim(cal: GPUCalibration, run: MeasuredRun) -> tuple[float, int]:
        """(simulated all-reduce time of the first stage, simulated peak memory)."""
        est = estimate(cal, run)
        first = next(s for s in est.stages if s.pipeline == 0 and s.stage == 0)
        return first.grad_sync_s, est.peak_memory_bytes

    # the base's TP link efficiencies are kept: the runs' tables were read with them
    kept = base.for_gpu(gpu)
    peak = _link_peak(runs, network)
    why.append(f"efficiencies read on links of peak {peak:.4g} GB/s")
    step = GPUCalibration(
        gpu_type=gpu,
        profiler_overhead_s=h,
        sync_fixed_s=c,
        tp_link_efficiency=kept.tp_link_efficiency,
        tp_link_efficiency_pcie=kept.tp_link_efficiency_pcie,
        efficiency_link_gbps=peak,
    )
    logs: list[float] = []
    for r in runs:
        if len(r.plan.pipelines) < 2 or not _reduce_readable(r):
            continue
        assert r.grad_reduce_s is not None
        ar, _ = sim(step, r)
        if ar > 0:
            logs.append(math.log(ar / max(r.grad_reduce_s - c, 1e-4)))
    eta = min(1.0, math.exp(statistics.mean(logs))) if logs else 1.0
    why.append(f"eta={eta:.3f}: geometric mean over {len(logs)} DP runs' reduce times")

    step = step.model_copy(update={"network_efficiency": eta})

    def phase(r: MeasuredRun, p2p: float, fixed: float = 0.0) -> float:
        """Simulated iteration minus gradient sync at η_p2p = ``p2p`` and a fixed cost
        ``fixed`` per transfer."""
        est = estimate(step.model_copy(update={"p2p_efficiency": p2p, "p2p_fixed_s": fixed}), r)
        return est.iteration_time_s - est.time.grad_sync_s

    piped = [r for r in runs if any(p.depth > 1 for p in r.plan.pipelines)]
    usable = [r for r in piped if _reduce_readable(r)]
    readings = [
        _p2p_reading(functools.partial(phase, r), r.iteration_time_s - (r.grad_reduce_s or 0.0))
        for r in usable
    ]
    # a reading at a bound says only that the run lies outside the range (its time barely
    # moves with the transfers, or something else is slower or faster than modelled): it
    # would pull the mean to the bound, so it is left out
    bounds = (math.log(_P2P_RANGE[0]), math.log(_P2P_RANGE[1]))
    read = [(r, x) for r, x in zip(usable, readings, strict=True) if x not in bounds]
    p2p_logs = [x for _, x in read]
    if p2p_logs:
        p2p_eta = math.exp(statistics.mean(p2p_logs))
        dropped = len(readings) - len(p2p_logs)
        left_out = f" ({dropped} at a bound of [0.01, 1] left out)" if dropped else ""
        if len(read) >= 3 and len({r.plan.pipelines[0].microbatch_size for r, _ in read}) >= 2:
            fixed, p2p_eta = _two_terms(
                [functools.partial(phase, r) for r, _ in read],
                [r.iteration_time_s - (r.grad_reduce_s or 0.0) for r, _ in read],
                p2p_eta,
            )
            step = step.model_copy(update={"p2p_efficiency": p2p_eta, "p2p_fixed_s": fixed})
            why.append(
                f"eta_p2p={p2p_eta:.3f}, p2p_fixed={fixed * 1e3:.2f} ms: least squares over "
                f"{len(read)} multi-stage runs' pipeline phases{left_out}"
            )
        else:
            step = step.model_copy(update={"p2p_efficiency": p2p_eta})
            few = "fewer than three readings" if len(read) < 3 else "one microbatch size"
            why.append(
                f"eta_p2p={p2p_eta:.3f}: geometric mean over {len(p2p_logs)} multi-stage runs' "
                f"pipeline phases{left_out}; p2p_fixed=0 ({few}: the two terms cannot be "
                "told apart)"
            )
    elif not piped:
        why.append("eta_p2p: no multi-stage run; transfers use eta")
    else:
        why.append(
            f"eta_p2p: none of {len(piped)} multi-stage runs gives a reading (reduce time "
            "missing, a straggler, or at a bound of [0.01, 1]); transfers use eta"
        )

    step = step.model_copy(update={"memory_overhead_bytes": 0})
    kappa = 1.0
    singles = [r for r in runs if _single_stage(r.plan)]
    if len(singles) >= 2:
        acts = []
        for r in singles:
            est = estimate(step, r)
            acts.append((max(m.activations for m in est.memory), r))
        acts.sort(key=lambda x: x[0])
        (a0, r0), (a1, r1) = acts[0], acts[-1]
        if a1 > a0:
            kappa = max(1.0, (r1.peak_memory_bytes - r0.peak_memory_bytes) / (a1 - a0))
            why.append(f"kappa={kappa:.3f} from {r0.name} and {r1.name}")
    step = step.model_copy(update={"alloc_factor": kappa})
    comm, covered, m0, note = _communicators_and_m0(
        [_memory_residual(estimate(step, r), r) for r in runs], kept.communicator_bytes
    )
    why.append(note)
    return step.model_copy(
        update={
            "memory_overhead_bytes": m0,
            "communicator_bytes": comm,
            "communicators_covered": covered,
            "source": "; ".join(why),
            "fitted_under": Deployment(
                name=deployment_name,
                description="the structure the runs were simulated with (calibrate_gpu base)",
                **base.structure(),
            ),
        }
    )


def _link_peak(runs: Sequence[MeasuredRun], network: NetworkProfile) -> float:
    """The median over ``runs`` of the peak bandwidth (GB/s) of the node-to-node link of
    their first stage's nodes: the links their all-reduces and transfers crossed."""
    peaks = []
    for r in runs:
        g = r.plan.pipelines[0].stages[0].replica
        peaks.append(inter_curve(network, g, g)[0].max_gbps)
    return statistics.median(peaks)
