"""How the planner's search time grows with GPUs, GPU types and zones; replan latency.

Every figure is the wall time of one ``search()`` call (cost tables, templates, allocation and
the simulation of the finalists: every precomputation included), with the process CPU time
beside it (the machine is shared: wall time includes waiting for a core). OPT-350 with the
original artifact's profiles, network and prices (``planner_common``).

* GPUs 32 -> 2048: A100-40 + V100-16 at 1:3 in one zone;
* GPU types 1 -> 4: 128 GPUs each of A100-40, V100-16, A100-80, GH-96 in one zone;
* zones 1 -> 8: 128 A100-40 per zone (zones past the five measured ones have no link data:
  the simulator's conservative fallback curve);
* replan: one node (4 GPUs) leaves a 512-GPU pool (128 A100-40 + 384 V100-16); latency of
  ``replan()`` and its throughput gap to a full search of the new pool.

Run: ``python benchmarks/planner_scaling.py [--plot out.png]``. Prints; never asserts a timing.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from planner_common import Setup, load, machine, pool

from sailor.planner import replan, search
from sailor.planner.robust import RISKS, robust_search

A, V, A80, GH = "A100-40", "V100-16", "A100-80", "GH-96"
ZONES = [
    "us-central1-a",
    "us-central1-b",
    "us-central1-c",
    "us-central1-f",
    "us-west1-b",
    "us-east1-b",
    "us-east1-c",
    "europe-west4-a",
]


def timed_search(s: Setup, counts: dict[tuple[str, str], int]) -> tuple[Any, float, float]:
    p = pool(counts)
    w0, c0 = time.perf_counter(), time.process_time()
    res = search(
        s.model,
        s.profiles,
        p,
        s.network,
        s.prices,
        gpu_specs=s.specs,
        calibration=s.calibration,
        top_k=1,
    )
    return res, time.perf_counter() - w0, time.process_time() - c0


def _risk_levels(s: Setup, repeat: int) -> None:
    """CPU s of one search at 512 GPUs of two types: the point search (configured calibration)
    and robust_search at each risk level (best of ``repeat``)."""
    p = pool({(A, ZONES[0]): 128, (V, ZONES[0]): 384})
    print("\n## risk levels: 512 GPUs (128 A100-40 + 384 V100-16, one zone)")
    print("| search | CPU s (best of runs) | wall s | corners searched | plans judged |")
    print("|---|---|---|---|---|")
    runs = []
    for _ in range(repeat):
        w0, c0 = time.perf_counter(), time.process_time()
        search(
            s.model,
            s.profiles,
            p,
            s.network,
            s.prices,
            gpu_specs=s.specs,
            calibration=s.calibration,
            top_k=1,
        )
        runs.append((time.process_time() - c0, time.perf_counter() - w0))
    c, w = min(runs)
    print(f"| point (configured calibration) | {c:.2f} | {w:.2f} | - | - |")
    for risk in RISKS:
        runs2 = []
        for _ in range(repeat):
            w0, c0 = time.perf_counter(), time.process_time()
            res = robust_search(
                s.model,
                s.profiles,
                p,
                s.network,
                s.prices,
                gpu_specs=s.specs,
                calibration=s.calibration,
                risk=risk,
                top_k=1,
            )
            runs2.append((time.process_time() - c0, time.perf_counter() - w0, res))
        c, w, res = min(runs2, key=lambda r: r[0])
        print(f"| risk {risk} | {c:.2f} | {w:.2f} | {','.join(res.searched)} | {res.candidates} |")


def row(label: str, n: int, res: Any, wall: float, cpu: float) -> dict[str, Any]:
    thr = res.plans[0].throughput_iter_s if res.plans else 0.0
    print(
        f"| {label} | {n} | {wall:.3f} | {cpu:.3f} | {thr:.3f} | {res.stats.templates} | "
        f"{res.stats.allocations} | {res.stats.simulated} |"
    )
    return {"label": label, "n": n, "wall": wall, "cpu": cpu}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--plot", default=None, help="write the plot to this PNG")
    ap.add_argument("--repeat", type=int, default=1, help="best of N runs per point")
    ap.add_argument(
        "--sections",
        default="gpus,types,zones,risk,replan",
        help="comma-separated subset of gpus,types,zones,risk,replan",
    )
    args = ap.parse_args()
    want = set(args.sections.split(","))
    s = load("OPT-350")
    print("# planner scaling (OPT-350, GBS 1024; judge: sailor.simulator)")
    print(f"machine: {machine()}")
    hdr = "| sweep | x | search wall s | CPU s | best it/s | templates | allocations | simulated |"
    series: dict[str, list[dict[str, Any]]] = {"GPUs": [], "GPU types": [], "zones": []}

    def best_of(counts: dict[tuple[str, str], int]) -> tuple[Any, float, float]:
        runs = [timed_search(s, counts) for _ in range(args.repeat)]
        return min(runs, key=lambda r: r[1])

    print(f"load average: {os.getloadavg()}")
    if "risk" in want:
        _risk_levels(s, args.repeat)
    print("\n## GPUs (A100-40 : V100-16 = 1 : 3, one zone)")
    print(hdr + "\n|---|---|---|---|---|---|---|---|")
    for n in (32, 64, 128, 256, 512, 1024, 2048) if "gpus" in want else ():
        counts = {(A, ZONES[0]): n // 4, (V, ZONES[0]): 3 * n // 4}
        series["GPUs"].append(row("GPUs", n, *best_of(counts)))
    print("\n## GPU types (128 GPUs each, one zone)")
    print(hdr + "\n|---|---|---|---|---|---|---|---|")
    types = [A, V, A80, GH]
    for k in range(1, 5) if "types" in want else ():
        counts = {(g, ZONES[0]): 128 for g in types[:k]}
        series["GPU types"].append(row("types", k, *best_of(counts)))
    print("\n## zones (128 A100-40 each)")
    print(hdr + "\n|---|---|---|---|---|---|---|---|")
    for k in range(1, 9) if "zones" in want else ():
        counts = {(A, z): 128 for z in ZONES[:k]}
        series["zones"].append(row("zones", k, *best_of(counts)))

    if "replan" not in want:
        return
    print("\n## replan: one node (4 GPUs) leaves a 512-GPU pool")
    print(
        "| node that leaves | replan wall ms | CPU ms | replan it/s | full search it/s | gap | "
        "full search wall s | layer replicas moved |"
    )
    print("|---|---|---|---|---|---|---|---|")
    base = {(A, ZONES[0]): 128, (V, ZONES[0]): 384}
    first = search(
        s.model,
        s.profiles,
        pool(base),
        s.network,
        s.prices,
        gpu_specs=s.specs,
        calibration=s.calibration,
        top_k=1,
    )
    for gone in (V, A):
        after = dict(base)
        after[(gone, ZONES[0])] -= 4
        w0, c0 = time.perf_counter(), time.process_time()
        again = replan(first, pool(after))
        rw, rc = time.perf_counter() - w0, time.process_time() - c0
        full, fw, _ = timed_search(s, after)
        a, f = again.plans[0].throughput_iter_s, full.plans[0].throughput_iter_s
        print(
            f"| {gone} | {rw * 1e3:.0f} | {rc * 1e3:.0f} | {a:.4f} | {f:.4f} | "
            f"{(a - f) / f:+.2%} | {fw:.3f} | {again.plans[0].moved_layer_replicas} |"
        )

    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
        for ax, (name, pts) in zip(axes, series.items(), strict=True):
            ax.plot([p["n"] for p in pts], [p["wall"] for p in pts], "o-", label="wall")
            ax.plot([p["n"] for p in pts], [p["cpu"] for p in pts], "s--", label="CPU")
            ax.set_xlabel(name)
            ax.set_ylabel("search time (s)")
            if name == "GPUs":
                ax.set_xscale("log", base=2)
            ax.set_ylim(bottom=0)
            ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"\nplot: {args.plot}")


if __name__ == "__main__":
    main()
