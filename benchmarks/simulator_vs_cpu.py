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
   (``megatron_patch.launch.launch_local``) through ``sailor.profiler.rss_worker`` (the
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

``--statistic mean`` (default): layer times, probe times, framework time and the measured
step are means. A step is a sum of many layers and messages, so its expectation is the sum
of their means; a sum of medians is biased low when the times are skewed by interference
(they are: bimodal message latencies, 0.06 vs 2 ms).

Prints the machine, the load average of each round, per-plan figures, per-phase times of
rank 0 next to the simulator's breakdown, and mean / median / worst |error|. Never
asserts. Run: ``python benchmarks/simulator_vs_cpu.py [--repeats 3] [--steps 12]
[--model-file SPEC.json] [--no-pin]``. By default every rank is bound to core ``rank % cores``
(``launch_local(pin_cores=True)``) and the host-sharing profile is measured the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from sailor import catalog
from sailor.megatron_patch.launch import launch_local
from sailor.profiler.collective_probe import collective_latencies
from sailor.profiler.curve_fit import fit_link, fit_residuals, with_link
from sailor.profiler.layers import LayerRun, device_description, profile_layers
from sailor.profiler.network_probe import ProbeSettings, run_probe
from sailor.profiler.timing import RepeatSettings
from sailor.schemas import (
    Calibration,
    Endpoint,
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
from sailor.simulator import simulate

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
        module="sailor.profiler.rss_worker",
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


def _profile(spec: ModelSpec, statistic: str, pin: bool) -> tuple[ProfileDB, NetworkProfile]:
    """Steps 1-2 of a round: layers, overheads, framework time, p2p and all-reduce probes."""
    t0 = time.time()
    db, _ = profile_layers(
        LayerRun(
            spec=spec,
            gpu_type="cpu",
            mbs=(1, 2, 4, 8),
            settings=RepeatSettings(),
            statistic=statistic,
            host_ranks=4,
            host_pin=pin,
        )
    )
    print(f"== profile ({time.time() - t0:.0f} s), load {os.getloadavg()[0]:.2f}")
    for t in db.timings:
        if t.layer in (0, 1, spec.num_all_layers - 1) and t.microbatch_size in (1, 8):
            print(
                f"  mbs {t.microbatch_size} {t.kind:9s} fwd {t.fwd_s * 1e3:.3f} "
                f"bwd {t.bwd_s * 1e3:.3f} update {t.update_s * 1e3:.3f} ms "
                f"(± {t.fwd_spread_s * 1e3:.3f}/{t.bwd_spread_s * 1e3:.3f})"
            )
    for host in db.hosts:
        print(
            f"  host sharing: {host.cores} cores, slowdown with 1..4 "
            "ranks computing "
            + " / ".join(
                f"{x:.2f}±{e:.2f}" for x, e in zip(host.slowdown, host.slowdown_spread, strict=True)
            )
            + f", wake-up {host.wake_s * 1e3:.3f} ms, rendezvous {host.rendezvous_s * 1e3:.3f} "
            f"ms (busy host {host.rendezvous_busy_s * 1e3:.3f} ms), collective wake-up "
            f"{host.collective_wake_s * 1e3:.3f} ms"
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
    pts = run_probe(ProbeSettings(min_bytes=4 << 10, max_bytes=16 << 20))
    pairs = [(p.nbytes, p.time.central(statistic)) for p in pts]
    curve = fit_link(pairs)
    res = fit_residuals(curve, pairs)
    net = with_link(NetworkProfile(), EP, EP, curve, source="loopback probe")
    load = f", load {os.getloadavg()[0]:.2f}"
    net = net.model_copy(
        update={
            "collectives": tuple(
                collective_latencies(
                    EP, (2, 3, 4), statistic, load=load, sizes=(256 << 10, 4 << 20)
                )
            )
        }
    )
    print(f"== network probe ({time.time() - t0:.0f} s), load {os.getloadavg()[0]:.2f}")
    for p, r in zip(pts, res, strict=True):
        if p.nbytes <= 64 << 10 or p.nbytes >= 8 << 20:
            print(
                f"  {p.nbytes:>10,} B one-way median {p.time.median_s * 1e3:7.3f} ms, "
                f"mean {p.time.mean_s * 1e3:.3f} (± {p.time.stdev_s * 1e3:.3f}), "
                f"fit {100 * r:+.0f}%"
            )
    print(
        f"  p2p latency {curve.latency_s * 1e3:.3f} ms, peak {curve.max_gbps:.2f} GB/s; "
        "all-reduce of 8 B: "
        + ", ".join(f"{c.ranks} ranks {c.latency_s * 1e3:.3f} ms" for c in net.collectives)
        + "; bus bandwidth "
        + ", ".join(f"{c.ranks} ranks {c.bus_gbps or 0:.2f} GB/s" for c in net.collectives)
    )
    return db, net


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
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--skip", type=int, default=3, help="warm-up steps not counted")
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
    args = ap.parse_args()
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
    rows: dict[str, list[tuple[float, float, float, float, dict[str, float], str]]] = {}
    with tempfile.TemporaryDirectory(prefix="sailor-bench-") as tmp:
        model_file = Path(tmp) / "model.json"
        model_file.write_text(spec.model_dump_json())
        before = _profile(spec, args.statistic, args.pin)
        for rnd in range(args.repeats):
            print(f"\n===== round {rnd + 1}/{args.repeats}, load {os.getloadavg()}")
            runs = []
            for plan in plans(spec):
                work = Path(tmp) / f"{plan.plan_id}-{rnd}"
                runs.append(
                    (
                        plan,
                        _run_plan(
                            plan, model_file, args.steps, args.skip, work, args.statistic, args.pin
                        ),
                        os.getloadavg()[0],
                    )
                )
            after = _profile(spec, args.statistic, args.pin)
            for plan, (t, ph, m), load in runs:
                ests = [
                    simulate(
                        plan,
                        spec,
                        db,
                        net,
                        prices,
                        calibration=cal,
                        gpu_specs=catalog.gpus(),
                        method="replay",
                        shared_host=True,
                    )
                    for db, net in (before, after)
                ]
                it = statistics.fmean(e.iteration_time_s for e in ests)
                mem = statistics.fmean(e.peak_memory_bytes for e in ests)
                tb = ests[-1].time
                sim = (
                    f"pipeline {(tb.compute_s + tb.p2p_s + tb.bubble_s) * 1e3:.2f} "
                    f"sync+end {tb.grad_sync_s * 1e3:.2f} update {tb.update_s * 1e3:.2f}"
                )
                rows.setdefault(plan.plan_id, []).append((t, it, m, mem, ph, sim))
                pre, post = (e.iteration_time_s * 1e3 for e in ests)
                print(
                    f"  {plan.plan_id:16s} meas {t * 1e3:7.2f} ms sim {it * 1e3:7.2f} ms "
                    f"({100 * (it - t) / t:+6.1f}%; profile before {pre:.2f}, after {post:.2f}), "
                    f"load {load:.1f}"
                )
            before = after
    _report(rows, args.repeats)


def _report(
    rows: dict[str, list[tuple[float, float, float, float, dict[str, float], str]]],
    repeats: int,
) -> None:
    print("\n== plans: median over rounds (errors' range over rounds), simulated with replay")
    print(
        f"{'plan':16s} {'meas ms':>8s} {'sim ms':>8s} {'err':>7s} {'err range':>17s} "
        f"{'meas MiB':>9s} {'sim MiB':>8s} {'err':>7s}"
    )
    terr: list[float] = []
    merr: list[float] = []
    for pid, rs in rows.items():
        errs = [(sim - t) / t for t, sim, *_ in rs]
        et = statistics.median(errs)
        em = statistics.median((sm - mm) / mm for _, _, mm, sm, _, _ in rs)
        terr.append(abs(et))
        merr.append(abs(em))
        print(
            f"{pid:16s} {statistics.median(r[0] for r in rs) * 1e3:8.2f} "
            f"{statistics.median(r[1] for r in rs) * 1e3:8.2f} {100 * et:+6.1f}% "
            f"{f'[{100 * min(errs):+.0f}..{100 * max(errs):+.0f}%]':>17s} "
            f"{statistics.median(r[2] for r in rs) / MIB:9.1f} "
            f"{statistics.median(r[3] for r in rs) / MIB:8.1f} {100 * em:+6.1f}%"
        )
        ph = {k: statistics.median(r[4][k] for r in rs) for k in PHASES}
        print(
            "    rank 0 ms: "
            + " ".join(f"{k} {v * 1e3:.2f}" for k, v in ph.items())
            + f" | sim (last round): {rs[-1][5]}"
        )
    if repeats > 1:
        # how far the same plan's measured step moves between rounds: no prediction from a
        # profile can be closer to a round than this, on this host at this load
        moves = [
            (max(r[0] for r in rs) - min(r[0] for r in rs)) / statistics.median(r[0] for r in rs)
            for rs in rows.values()
        ]
        print(
            "\nrepeatability: a plan's measured step moves by "
            f"{100 * statistics.median(moves):.0f}% "
            f"(median over plans; worst {100 * max(moves):.0f}%) between its {repeats} rounds "
            "((max - min) / median)"
        )
    print(
        f"\n|error| over {len(terr)} plans, {repeats} rounds each: step time mean "
        f"{100 * statistics.fmean(terr):.1f}% / median {100 * statistics.median(terr):.1f}% / "
        f"worst {100 * max(terr):.1f}%; peak memory mean {100 * statistics.fmean(merr):.1f}% / "
        f"median {100 * statistics.median(merr):.1f}% / worst {100 * max(merr):.1f}%"
    )
    print(f"load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
