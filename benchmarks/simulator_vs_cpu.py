"""Close the loop on this machine: profile, simulate, run the real training, compare.

1. Profile the tiny GPT's layers on this CPU (``sailor.profiler.layers``: tp 1, mbs 1..8,
   1 torch thread as the worker uses), the process overhead (2 gloo ranks) and the
   framework's time outside the layers (``sailor.profiler.framework_time``: the real engine
   on the nano model, never these plans).
2. Probe loopback point-to-point bandwidth between two gloo processes
   (``sailor.profiler.network_probe``, 4 KiB..16 MiB: the activations this model sends are
   8-64 KiB) and fit the curve with its per-message latency -> NetworkProfile link
   (local, cpu, 1) <-> (local, cpu, 1).
3. Calibration for ``cpu``: no constant is fitted to the plans. What ``megatron_patch`` does
   is stated, not fitted: it sends only activations (``sends_attention_mask=False``), its
   sends are asynchronous (``blocking_p2p=False``: a link delay), it all-reduces the tied
   embedding gradient in a group of its own (``tied_allreduce``) and ends every iteration
   with a loss all-reduce over all ranks (``loss_allreduce``). The memory overhead is the
   ``DeviceOverhead`` measured in step 1; the other constants are the documented defaults
   (no hook correction, network efficiency 1, no fixed sync cost, no allocator factor).
4. For each plan (1-4 ranks: pipeline depths, uneven splits, microbatch sizes, two
   pipelines), run the real training framework with its local launcher
   (``megatron_patch.launch.launch_local``) through ``sailor.profiler.rss_probe`` (the
   unchanged worker, plus its peak RSS growth); the measured step time is the mean (or
   median, ``--statistic``) of rank 0's ``step_s`` after ``--skip`` warm-up steps, the
   measured memory the largest peak-RSS growth of any rank. Compare with
   ``simulate(method="replay")``.

Steps 1-4 are one **round**; ``--repeats`` rounds are run. The profile brackets each round's
runs: it is taken before them and again after them, and the prediction is the mean of the
two simulations (the "after" profile is the next round's "before"). On this shared host the
speed of everything drifts within minutes; bracketing cancels a drift that is steady over a
round, which a profile taken only before the runs does not.
Per plan: the median over rounds of the measured time, of the prediction and of the error,
with the errors' range.

**Host speed checks** (``sailor.profiler.cpu_host.speed``). The development machine is a 2-vCPU
guest whose cores other tenants slow down by up to 2x for seconds to minutes, invisibly to
the guest (no steal time): one rank of the same plan, 400 steps each, measured 13.6, 25.6 and
13.0 ms a step in three runs a minute apart. So each profile part (layers with overhead and
framework time; host sharing; network probes) and each run sits between two checks (the
model's step on each core alone, then on all cores at once, ~1 s), is taken again (up to
``--tries``) while the host changed speed during it (or, for a run, while it ran at another
speed than around its "before" profile), and the report gives the error twice: over every
round, and over the rounds whose run saw the host of both its profiles (steady, and within
``--tolerance`` of the mean speed around the profiles' parts). Nothing is scaled by the
checks: they only say which comparisons are between the same host.

``--statistic mean`` (default): layer times, probe times, framework time and the measured
step are means. A step is a sum of many layers and messages, so its expectation is the sum
of their means; a sum of medians is biased low when the times are skewed by interference
(they are: bimodal message latencies, 0.06 vs 2 ms).

Prints the machine, the load average of each round, per-plan figures, per-phase times of
rank 0 next to the simulator's breakdown, the host checks, and mean / median / worst |error|.
Never asserts. Run: ``python benchmarks/simulator_vs_cpu.py [--repeats 3] [--steps 60]
[--tries 2] [--tolerance 0.2] [--model-file SPEC.json] [--no-pin]``. By default every rank
is bound to core ``rank % cores`` (``launch_local(pin_cores=True)``) and the host-sharing
profile is measured the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import torch

from sailor import catalog
from sailor.megatron_patch.launch import launch_local
from sailor.profiler.collective_probe import collective_latencies, sweep_sizes
from sailor.profiler.cpu_host.sharing import HostRun, measure_host_sharing
from sailor.profiler.cpu_host.speed import (
    SpeedCheck,
    SpeedProbe,
    drift,
    mean_check,
    nominal,
    same_speed,
)
from sailor.profiler.curve_fit import fit_link, fit_residuals, with_link
from sailor.profiler.layers import LayerRun, device_description, profile_layers
from sailor.profiler.network_probe import ProbeSettings, run_probe
from sailor.profiler.timing import RepeatSettings
from sailor.schemas import (
    Calibration,
    Endpoint,
    Estimate,
    GPUCalibration,
    GPUPrice,
    ModelSpec,
    NetworkProfile,
    Pipeline,
    Plan,
    PriceTable,
    ProfileDB,
    ReplicaGroup,
    Stage,
)
from sailor.simulator.cpu_host import simulate_on_shared_host

MIB = 2**20
EP = Endpoint(zone="local", gpu_type="cpu", gpus_per_node=1)
RG = ReplicaGroup(gpu_type="cpu", zone="local", tp=1, gpus_per_node=1)
PHASES = ("compute", "sync", "optim", "rest")


def _pipe(bounds: list[tuple[int, int]], mbs: int, m: int) -> Pipeline:
    return Pipeline(
        stages=tuple(Stage(first_layer=a, last_layer=b, replica=RG) for a, b in bounds),
        microbatch_size=mbs,
        num_microbatches=m,
    )


def plans(spec: ModelSpec) -> list[Plan]:
    """Plans that run on this machine (1-4 ranks), gbs = the model's global batch."""
    last = spec.num_all_layers - 1  # 5 for tiny-gpt: embedding, 4 blocks, head
    gbs = spec.global_batch_size
    mid = last // 2
    out = {
        "1st-mbs4": [_pipe([(0, last)], 4, gbs // 4)],
        "1st-mbs2": [_pipe([(0, last)], 2, gbs // 2)],
        "1st-mbs8": [_pipe([(0, last)], 8, gbs // 8)],
        "pp2-even-mbs4": [_pipe([(0, mid), (mid + 1, last)], 4, gbs // 4)],
        "pp2-uneven-mbs2": [_pipe([(0, 1), (2, last)], 2, gbs // 2)],
        "pp3-uneven-mbs4": [_pipe([(0, 0), (1, 3), (4, last)], 4, gbs // 4)],
        "pp4-mbs2": [_pipe([(0, 0), (1, 2), (3, 4), (5, last)], 2, gbs // 2)],
        "dp2-mbs4": [_pipe([(0, last)], 4, gbs // 8), _pipe([(0, last)], 4, gbs // 8)],
        "dp2-het": [
            _pipe([(0, mid), (mid + 1, last)], 4, gbs // 8),
            _pipe([(0, last)], 2, gbs // 4),
        ],
    }
    return [
        Plan(plan_id=k, model=spec.name, global_batch_size=gbs, pipelines=tuple(v))
        for k, v in out.items()
    ]


def _run_plan(
    plan: Plan, model_file: Path, steps: int, skip: int, work: Path, statistic: str, pin: bool
) -> tuple[float, dict[str, float], int]:
    """(central step s, median phases of rank 0, max peak RSS growth bytes) of one real run.

    Phases (the engine's ``StepResult``): ``compute`` = zeroing gradients + 1F1B + waiting
    for sends, ``sync`` = gradient all-reduces, ``optim`` = optimizer step, ``rest`` = the
    loss all-reduce and the step's bookkeeping."""
    run = launch_local(
        plan,
        steps,
        work,
        model=str(model_file),
        extra_args=["--rss-out", str(work / "rss-{rank}.json")],
        module="sailor.profiler.rss_probe",
        deadline_s=600,
        pin_cores=pin,
    )
    if not run.ok:
        raise RuntimeError(f"{plan.plan_id}: ranks failed: {run.errors} {run.stderr[0][-2000:]}")
    recs = run.steps(0)[skip:]
    steps_s = [float(e["step_s"]) for e in recs]
    phases = {k: statistics.median(float(e[f"{k}_s"]) for e in recs) for k in PHASES[:3]}
    phases["rest"] = statistics.median(
        float(e["step_s"]) - sum(float(e[f"{k}_s"]) for k in PHASES[:3]) for e in recs
    )
    growth = max(
        json.loads((work / f"rss-{r}.json").read_text())["growth_bytes"]
        for r in range(len(plan.ranks()))
    )
    central = statistics.fmean(steps_s) if statistic == "mean" else statistics.median(steps_s)
    return central, phases, int(growth)


T = TypeVar("T")
Bracket = tuple[SpeedCheck, SpeedCheck]


@dataclass
class _Gate:
    """Host speed checks (``sailor.profiler.cpu_host.speed``) before and after each measurement.

    A measurement is taken again, up to ``tries`` times, while the host changed speed during
    it (its two checks differ by more than ``tolerance``) or, given ``reference`` (the checks
    around the profile a run will be predicted from), while it ran at another speed than
    that; the last try is kept either way, and every round is judged again at the end."""

    probe: SpeedProbe
    tries: int
    tolerance: float
    checks: list[SpeedCheck] = field(default_factory=list)

    def check(self) -> SpeedCheck:
        c = self.probe.check()
        self.checks.append(c)
        return c

    def steady(self, bracket: Bracket) -> bool:
        return same_speed(*bracket, tolerance=self.tolerance)

    def agrees(self, bracket: Bracket, reference: Sequence[Bracket]) -> bool:
        """Steady, and at the speed of the host around ``reference`` (mean of its checks)."""
        return self.steady(bracket) and same_speed(
            mean_check(bracket), _around(reference), self.tolerance
        )

    def run(
        self, label: str, fn: Callable[[], T], reference: Sequence[Bracket] = ()
    ) -> tuple[T, Bracket]:
        for attempt in range(1, self.tries + 1):
            pre = self.check()
            out = fn()
            bracket = (pre, self.check())
            ok = self.agrees(bracket, reference) if reference else self.steady(bracket)
            if not ok or attempt > 1:
                moved = drift(*bracket)
                off = drift(mean_check(bracket), _around(reference)) if reference else 0.0
                print(
                    f"  [{label}] try {attempt}/{self.tries}: host speed moved {100 * moved:.0f}%"
                    + (f" during it, {100 * off:.0f}% off the profile's" if reference else "")
                    + ("" if ok else " -> again" if attempt < self.tries else " -> kept")
                )
            if ok or attempt == self.tries:
                return out, bracket
        raise RuntimeError("unreachable: the last try returns")


def _around(brackets: Sequence[Bracket]) -> SpeedCheck:
    """The host around some measurements: the mean of their checks."""
    return mean_check([c for b in brackets for c in b])


@dataclass(frozen=True)
class _Profile:
    db: ProfileDB
    net: NetworkProfile
    brackets: tuple[Bracket, ...]


@dataclass(frozen=True)
class _Row:
    measured_s: float
    predicted_s: float
    measured_bytes: float
    predicted_bytes: float
    phases: dict[str, float]
    sim: str
    run_bracket: Bracket
    """Host checks before and after the run."""
    profile_brackets: tuple[Bracket, ...]
    """Host checks around every part of both profiles the run was predicted from."""
    baseline_s: float
    """The prediction without the all-reduce entry times (after-barrier latency instead)."""


def _without_entries(db: ProfileDB) -> ProfileDB:
    hosts = tuple(
        h.model_copy(
            update={
                "allreduce_after_compute_s": (),
                "allreduce_after_allreduce_s": (),
                "allreduce_after_update_s": (),
                "allreduce_probe_bytes": 0,
            }
        )
        for h in db.hosts
    )
    return db.model_copy(update={"hosts": hosts})


def _profile(spec: ModelSpec, statistic: str, pin: bool, gate: _Gate) -> _Profile:
    """Steps 1-2 of a round, each part between two host speed checks: layers, overhead and
    framework time; host sharing; p2p and all-reduce probes."""
    t0 = time.time()
    mbs = (1, 2, 4, 8)
    layers, b_layers = gate.run(
        "profile layers",
        lambda: profile_layers(
            LayerRun(
                spec=spec,
                gpu_type="cpu",
                mbs=mbs,
                settings=RepeatSettings(),
                statistic=statistic,
            )
        )[0],
    )
    host, b_host = gate.run(
        "profile host sharing",
        lambda: measure_host_sharing(
            HostRun(spec=spec, gpu_type="cpu", mbs=sorted(mbs)[len(mbs) // 2], pin=pin)
        ),
    )
    db = layers.model_copy(update={"hosts": (host,)})
    print(f"== profile ({time.time() - t0:.0f} s), load {os.getloadavg()[0]:.2f}")
    for t in db.timings:
        if t.layer in (0, 1, spec.num_all_layers - 1) and t.microbatch_size in (1, 8):
            print(
                f"  mbs {t.microbatch_size} {t.kind:9s} fwd {t.fwd_s * 1e3:.3f} "
                f"bwd {t.bwd_s * 1e3:.3f} update {t.update_s * 1e3:.3f} ms "
                f"(± {t.fwd_spread_s * 1e3:.3f}/{t.bwd_spread_s * 1e3:.3f})"
            )
    print(
        f"  host sharing: {host.cores} cores, slowdown with 1..4 ranks computing "
        + " / ".join(
            f"{x:.2f}±{e:.2f}" for x, e in zip(host.slowdown, host.slowdown_spread, strict=True)
        )
        + f", wake-up {host.wake_s * 1e3:.3f} ms, rendezvous {host.rendezvous_s * 1e3:.3f} "
        f"ms (busy host {host.rendezvous_busy_s * 1e3:.3f} ms)"
    )
    print(
        "  all-reduce entered after compute / after an all-reduce / after the update, "
        "2..4 ranks (ms): "
        + "  ".join(
            f"{a * 1e3:.2f}/{b * 1e3:.2f}/{c * 1e3:.2f}"
            for a, b, c in zip(
                host.allreduce_after_compute_s,
                host.allreduce_after_allreduce_s,
                host.allreduce_after_update_s,
                strict=True,
            )
        )
    )
    for o in db.overheads:
        print(f"  process overhead {o.bytes / MIB:.1f} MiB")
    for f in db.framework:
        print(
            f"  framework time: {f.iteration_s * 1e3:.3f} ms per iteration, "
            f"{f.microbatch_s * 1e3:.3f} ms per microbatch, {f.sample_s * 1e6:.1f} us per "
            "sample"
        )
    t0 = time.time()

    def probe_network() -> tuple[NetworkProfile, list[tuple[int, float, float, float, float]]]:
        pts = run_probe(ProbeSettings(min_bytes=4 << 10, max_bytes=16 << 20))
        pairs = [(p.nbytes, p.time.central(statistic)) for p in pts]
        curve = fit_link(pairs)
        res = fit_residuals(curve, pairs)
        net = with_link(NetworkProfile(), EP, EP, curve, source="loopback probe")
        load = f", load {os.getloadavg()[0]:.2f}"
        # every "node" of these plans is a process of this host and their link is the
        # loopback probed above: the loopback all-reduce is what a ring between them does
        coll = collective_latencies(EP, (2, 3, 4), statistic, load=load, sizes=sweep_sizes("cpu"))
        net = net.model_copy(
            update={
                "collectives": tuple(c.model_copy(update={"scope": "inter_node"}) for c in coll)
            }
        )
        rows = [
            (p.nbytes, p.time.median_s, p.time.mean_s, p.time.stdev_s, r)
            for p, r in zip(pts, res, strict=True)
        ]
        return net, rows

    (net, rows), b_net = gate.run("profile network", probe_network)
    print(f"== network probe ({time.time() - t0:.0f} s), load {os.getloadavg()[0]:.2f}")
    for nbytes, med, mean, sd, r in rows:
        if nbytes <= 64 << 10 or nbytes >= 8 << 20:
            print(
                f"  {nbytes:>10,} B one-way median {med * 1e3:7.3f} ms, "
                f"mean {mean * 1e3:.3f} (± {sd * 1e3:.3f}), fit {100 * r:+.0f}%"
            )
    curve = net.links[0].curve
    print(
        f"  p2p latency {curve.latency_s * 1e3:.3f} ms, peak {curve.max_gbps:.2f} GB/s; "
        "all-reduce of 8 B: "
        + ", ".join(f"{c.ranks} ranks {c.latency_s * 1e3:.3f} ms" for c in net.collectives)
        + "; bus bandwidth "
        + ", ".join(f"{c.ranks} ranks {c.bus_gbps or 0:.2f} GB/s" for c in net.collectives)
    )
    return _Profile(db, net, (b_layers, b_host, b_net))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny-gpt", help="catalog model")
    ap.add_argument(
        "--model-file",
        type=Path,
        default=None,
        help="ModelSpec JSON to use instead of --model (e.g. a wider model whose layers take "
        "milliseconds, so that compute, not the host's scheduling of messages, dominates)",
    )
    ap.add_argument("--repeats", type=int, default=3, help="rounds of profile + all plans")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--skip", type=int, default=5, help="warm-up steps not counted")
    ap.add_argument(
        "--statistic", default="mean", help="central value of profiles and steps: mean or median"
    )
    ap.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="bind rank r to core r %% cores, in the runs (launch_local(pin_cores=True)) and in "
        "the host-sharing profile (default; --no-pin leaves placement to the scheduler)",
    )
    ap.add_argument(
        "--tries",
        type=int,
        default=2,
        help="measure a profile part or a run again, up to this many times, while the host "
        "speed check around it finds the host slower than usual",
    )
    ap.add_argument(
        "--tolerance",
        type=float,
        default=0.2,
        help="a host speed check is 'usual' if every core's time is within this fraction of "
        "the fastest seen",
    )
    args = ap.parse_args()
    if args.tries < 1 or args.steps <= args.skip or args.repeats < 1:
        raise SystemExit(
            f"--tries={args.tries} must be >= 1, --steps={args.steps} > --skip={args.skip}, "
            f"--repeats={args.repeats} >= 1"
        )
    spec = (
        ModelSpec.model_validate_json(args.model_file.read_text())
        if args.model_file is not None
        else catalog.model(args.model)
    )
    print("== setup")
    print(f"machine: {platform.platform()}, {device_description('cpu')}, {os.cpu_count()} cores")
    print(f"python {platform.python_version()}, torch {torch.__version__}; 1 thread per rank")
    print(f"statistic: {args.statistic}; {args.repeats} rounds; {args.steps} steps per run")
    print(f"ranks bound to cores (rank % cores): {args.pin}")
    print(f"load average at start: {os.getloadavg()}")
    print(f"model: {spec.model_dump_json()}")
    cal = Calibration(
        gpus=(
            GPUCalibration(
                gpu_type="cpu",
                source="megatron_patch on CPU: no hooks, probe = truth; overhead from the profile",
            ),
        ),
        sends_attention_mask=False,
        blocking_p2p=False,
        tied_allreduce=True,
        loss_allreduce=True,
    )
    prices = PriceTable(
        gpus=(
            GPUPrice(gpu_type="cpu", region="local", on_demand_usd_per_hour=0, spot_usd_per_hour=0),
        )
    )
    rows: dict[str, list[_Row]] = {}
    with (
        tempfile.TemporaryDirectory(prefix="sailor-bench-") as tmp,
        SpeedProbe(spec, mbs=2) as probe,
    ):
        gate = _Gate(probe, args.tries, args.tolerance)
        print(
            "host speed check (the model's step, mbs 2, each core alone then all at once): "
            f"{gate.check().describe()}"
        )
        model_file = Path(tmp) / "model.json"
        model_file.write_text(spec.model_dump_json())
        before = _profile(spec, args.statistic, args.pin, gate)
        for rnd in range(args.repeats):
            print(f"\n===== round {rnd + 1}/{args.repeats}, load {os.getloadavg()}")
            runs = []
            for plan in plans(spec):

                def one(plan: Plan = plan, rnd: int = rnd) -> tuple[float, dict[str, float], int]:
                    work = Path(tmp) / f"{plan.plan_id}-{rnd}-{time.monotonic_ns()}"
                    return _run_plan(
                        plan, model_file, args.steps, args.skip, work, args.statistic, args.pin
                    )

                got, bracket = gate.run(plan.plan_id, one, before.brackets)
                runs.append((plan, got, bracket, os.getloadavg()[0]))
            after = _profile(spec, args.statistic, args.pin, gate)
            for plan, (t, ph, m), bracket, load in runs:

                def predict(db: ProfileDB, net: NetworkProfile, plan: Plan = plan) -> Estimate:
                    return simulate_on_shared_host(
                        plan,
                        spec,
                        db,
                        net,
                        prices,
                        calibration=cal,
                        gpu_specs=catalog.gpus(),
                        method="replay",
                    )

                ests = [predict(prof.db, prof.net) for prof in (before, after)]
                it = statistics.fmean(e.iteration_time_s for e in ests)
                # baseline in the same run: the same profiles without the all-reduce entry
                # times (every all-reduce priced from the collective probe's latency after a
                # barrier and its bus bandwidth)
                base = statistics.fmean(
                    predict(_without_entries(prof.db), prof.net).iteration_time_s
                    for prof in (before, after)
                )
                mem = statistics.fmean(e.peak_memory_bytes for e in ests)
                tb = ests[-1].time
                sim = (
                    f"pipeline {(tb.compute_s + tb.p2p_s + tb.bubble_s) * 1e3:.2f} "
                    f"sync+end {tb.grad_sync_s * 1e3:.2f} update {tb.update_s * 1e3:.2f}"
                )
                rows.setdefault(plan.plan_id, []).append(
                    _Row(t, it, m, mem, ph, sim, bracket, (*before.brackets, *after.brackets), base)
                )
                pre, post = (e.iteration_time_s * 1e3 for e in ests)
                print(
                    f"  {plan.plan_id:16s} meas {t * 1e3:7.2f} ms sim {it * 1e3:7.2f} ms "
                    f"({100 * (it - t) / t:+6.1f}%; profile before {pre:.2f}, after {post:.2f}), "
                    f"load {load:.1f}, host speed "
                    + (
                        "as for its profiles"
                        if gate.agrees(bracket, (*before.brackets, *after.brackets))
                        else "not as for its profiles"
                    )
                )
            before = after
    _report(rows, args.repeats, gate)


def _table(rows: dict[str, list[_Row]], title: str) -> tuple[list[float], list[float]]:
    print(f"\n== {title}")
    print(
        f"{'plan':16s} {'rounds':>6s} {'meas ms':>8s} {'sim ms':>8s} {'err':>7s} "
        f"{'err range':>17s} {'meas MiB':>9s} {'sim MiB':>8s} {'err':>7s}"
    )
    terr: list[float] = []
    merr: list[float] = []
    for pid, rs in rows.items():
        if not rs:
            print(f"{pid:16s} {0:6d}   (no round)")
            continue
        errs = [(r.predicted_s - r.measured_s) / r.measured_s for r in rs]
        et = statistics.median(errs)
        em = statistics.median(
            (r.predicted_bytes - r.measured_bytes) / r.measured_bytes for r in rs
        )
        terr.append(abs(et))
        merr.append(abs(em))
        print(
            f"{pid:16s} {len(rs):6d} {statistics.median(r.measured_s for r in rs) * 1e3:8.2f} "
            f"{statistics.median(r.predicted_s for r in rs) * 1e3:8.2f} {100 * et:+6.1f}% "
            f"{f'[{100 * min(errs):+.0f}..{100 * max(errs):+.0f}%]':>17s} "
            f"{statistics.median(r.measured_bytes for r in rs) / MIB:9.1f} "
            f"{statistics.median(r.predicted_bytes for r in rs) / MIB:8.1f} {100 * em:+6.1f}%"
        )
        ph = {k: statistics.median(r.phases[k] for r in rs) for k in PHASES}
        print(
            "    rank 0 ms: "
            + " ".join(f"{k} {v * 1e3:.2f}" for k, v in ph.items())
            + f" | sim (last round): {rs[-1].sim}"
        )
    return terr, merr


def _summary(terr: list[float], merr: list[float], what: str) -> None:
    if not terr:
        print(f"\n|error| {what}: no plan")
        return
    print(
        f"\n|error| {what}, {len(terr)} plans: step time mean "
        f"{100 * statistics.fmean(terr):.1f}% / median {100 * statistics.median(terr):.1f}% / "
        f"worst {100 * max(terr):.1f}%; peak memory mean {100 * statistics.fmean(merr):.1f}% / "
        f"median {100 * statistics.median(merr):.1f}% / worst {100 * max(merr):.1f}%"
    )


def _report(rows: dict[str, list[_Row]], repeats: int, gate: _Gate) -> None:
    usual = nominal(gate.checks)
    slow = [c.slowest_ratio(usual) for c in gate.checks]
    print(
        f"\n== host speed: fastest seen {usual.describe()}; {len(gate.checks)} checks, "
        f"slowest time in each over the fastest seen: median x{statistics.median(slow):.2f}, "
        f"worst x{max(slow):.2f}"
    )
    terr, merr = _table(rows, "every round: median over rounds (errors' range), replay")
    if repeats > 1:
        # how far the same plan's measured step moves between rounds: no prediction from a
        # profile can be closer to a round than this, on this host at this load
        moves = [
            (max(r.measured_s for r in rs) - min(r.measured_s for r in rs))
            / statistics.median(r.measured_s for r in rs)
            for rs in rows.values()
        ]
        print(
            "\nrepeatability: a plan's measured step moves by "
            f"{100 * statistics.median(moves):.0f}% "
            f"(median over plans; worst {100 * max(moves):.0f}%) between its {repeats} rounds "
            "((max - min) / median)"
        )
    _summary(terr, merr, f"over every round ({repeats} per plan)")
    base = [
        abs(statistics.median((r.baseline_s - r.measured_s) / r.measured_s for r in rs))
        for rs in rows.values()
    ]
    print(
        "|error| in the same runs without the all-reduce entry times (every all-reduce "
        "priced from the collective probe's latency after a barrier): step time mean "
        f"{100 * statistics.fmean(base):.1f}% / median {100 * statistics.median(base):.1f}% / "
        f"worst {100 * max(base):.1f}%"
    )
    same = {
        pid: [r for r in rs if gate.agrees(r.run_bracket, r.profile_brackets)]
        for pid, rs in rows.items()
    }
    kept = sum(len(rs) for rs in same.values())
    total = sum(len(rs) for rs in rows.values())
    qerr, qmerr = _table(
        same,
        "rounds whose run saw the host of its profiles (steady during the run, and within "
        f"{100 * gate.tolerance:.0f}% of the mean speed around both profiles' parts): "
        f"{kept} of {total}",
    )
    _summary(qerr, qmerr, "over those rounds")
    print(f"load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
