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
   unchanged worker, plus its peak RSS growth), ``--repeats`` times; the measured step time
   is the median of rank 0's ``step_s`` after ``--skip`` warm-up steps, the measured memory
   the largest peak-RSS growth of any rank. Compare with ``simulate(method="replay")``.

Prints the machine, the load average before and after (this host is shared: other jobs
make timings noisy), per-plan figures with the spread over repeats, and mean |error|.
Never asserts. Run: ``python benchmarks/simulator_vs_cpu.py [--repeats 3] [--steps 12]``.
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
    plan: Plan, model_file: Path, steps: int, skip: int, work: Path
) -> tuple[float, dict[str, float], int]:
    """(median step s, median phases of rank 0, max peak RSS growth bytes) of one real run.

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
    return statistics.median(steps_s), phases, int(growth)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny-gpt", help="catalog model")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--skip", type=int, default=3, help="warm-up steps not counted")
    ap.add_argument("--statistic", default="median", help="profile central value: median or mean")
    args = ap.parse_args()
    spec = catalog.model(args.model)
    print("== setup")
    print(f"machine: {platform.platform()}, {device_description('cpu')}, {os.cpu_count()} cores")
    print(f"python {platform.python_version()}, torch {torch.__version__}; 1 thread per rank")
    print(f"profile statistic: {args.statistic}; {args.repeats} repeats of {args.steps} steps")
    print(f"load average at start: {os.getloadavg()}")
    print(f"model: {spec.model_dump_json()}")

    t0 = time.time()
    db, _ = profile_layers(
        LayerRun(
            spec=spec,
            gpu_type="cpu",
            mbs=(1, 2, 4, 8),
            settings=RepeatSettings(),
            statistic=args.statistic,
        )
    )
    print(f"\n== profile ({time.time() - t0:.0f} s)")
    for t in db.timings:
        if t.layer in (0, 1, spec.num_all_layers - 1):
            print(
                f"  mbs {t.microbatch_size} {t.kind:9s} fwd {t.fwd_s * 1e3:.3f} "
                f"bwd {t.bwd_s * 1e3:.3f} update {t.update_s * 1e3:.3f} ms "
                f"(± {t.fwd_spread_s * 1e3:.3f}/{t.bwd_spread_s * 1e3:.3f})"
            )
    for o in db.overheads:
        print(f"  process overhead {o.bytes / MIB:.1f} MiB ({o.source})")
    for f in db.framework:
        print(
            f"  framework time: {f.iteration_s * 1e3:.3f} ms per iteration, "
            f"{f.microbatch_s * 1e3:.3f} ms per microbatch, {f.sample_s * 1e6:.1f} us per "
            f"sample ({f.source})"
        )

    t0 = time.time()
    pts = run_probe(ProbeSettings(min_bytes=4 << 10, max_bytes=16 << 20))
    pairs = [(p.nbytes, p.time.central(args.statistic)) for p in pts]
    curve = fit_link(pairs)
    res = fit_residuals(curve, pairs)
    net = with_link(NetworkProfile(), EP, EP, curve, source="loopback probe")
    print(f"\n== network probe ({time.time() - t0:.0f} s), load {os.getloadavg()[0]:.2f}")
    for p, r in zip(pts, res, strict=True):
        print(
            f"  {p.nbytes:>10,} B one-way {p.time.median_s * 1e3:7.3f} ms "
            f"(mean {p.time.mean_s * 1e3:.3f}) "
            f"(± {p.time.stdev_s * 1e3:.3f}) {p.gbps:6.3f} GB/s, fit {100 * r:+.0f}%"
        )
    print(f"  fit: {curve.model_dump_json()}")
    print(f"  per-message latency {curve.latency_s * 1e3:.3f} ms")

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
    _compare(spec, db, net, cal, prices, args)


def _compare(
    spec: ModelSpec,
    db: ProfileDB,
    net: NetworkProfile,
    cal: Calibration,
    prices: PriceTable,
    args: argparse.Namespace,
) -> None:
    print("\n== plans: measured (median over repeats, [min..max]) vs simulated (replay)")
    head = (
        f"{'plan':16s} {'ranks':>5s} {'meas ms':>9s} {'spread':>17s} {'sim ms':>8s} "
        f"{'err':>7s} {'meas MiB':>9s} {'sim MiB':>8s} {'err':>7s}"
    )
    print(head)
    terr: list[float] = []
    merr: list[float] = []
    with tempfile.TemporaryDirectory(prefix="sailor-bench-") as tmp:
        model_file = Path(tmp) / "model.json"
        model_file.write_text(spec.model_dump_json())
        for plan in plans(spec):
            est = simulate(
                plan,
                spec,
                db,
                net,
                prices,
                calibration=cal,
                gpu_specs=catalog.gpus(),
                method="replay",
            )
            meas_t: list[float] = []
            meas_m: list[int] = []
            meas_p: list[dict[str, float]] = []
            for rep in range(args.repeats):
                work = Path(tmp) / f"{plan.plan_id}-{rep}"
                t, ph, m = _run_plan(plan, model_file, args.steps, args.skip, work)
                meas_t.append(t)
                meas_m.append(m)
                meas_p.append(ph)
            t_med = statistics.median(meas_t)
            m_med = statistics.median(meas_m)
            et = (est.iteration_time_s - t_med) / t_med
            em = (est.peak_memory_bytes - m_med) / m_med
            terr.append(abs(et))
            merr.append(abs(em))
            spread = f"[{min(meas_t) * 1e3:.1f}..{max(meas_t) * 1e3:.1f}]"
            print(
                f"{plan.plan_id:16s} {len(plan.ranks()):5d} {t_med * 1e3:9.2f} {spread:>17s} "
                f"{est.iteration_time_s * 1e3:8.2f} {100 * et:+6.1f}% {m_med / MIB:9.1f} "
                f"{est.peak_memory_bytes / MIB:8.1f} {100 * em:+6.1f}%"
            )
            ph = {k: statistics.median(p[k] for p in meas_p) for k in PHASES}
            tb = est.time
            print(
                "    rank 0 ms: "
                + " ".join(f"{k} {v * 1e3:.2f}" for k, v in ph.items())
                + f" | sim: pipeline {(tb.compute_s + tb.p2p_s + tb.bubble_s) * 1e3:.2f} "
                f"(compute {tb.compute_s * 1e3:.2f}) sync+end {tb.grad_sync_s * 1e3:.2f} "
                f"update {tb.update_s * 1e3:.2f}"
            )
    print(
        f"\nmean |error|: step time {100 * statistics.fmean(terr):.1f}% "
        f"(worst {100 * max(terr):.1f}%), peak memory {100 * statistics.fmean(merr):.1f}% "
        f"(worst {100 * max(merr):.1f}%) over {len(terr)} plans, {args.repeats} repeats each"
    )
    print(f"load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
