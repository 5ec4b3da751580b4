"""Incremental replanning time: ``sailor.planner.replan`` after a leave, a join, a preemption.

Setup: the pools of ``runtime_decision_latency.py`` — OPT-350 (catalog, global batch 1024),
spot 4-GPU nodes, half A100-40 and half V100-16, in us-central1-a, analytic profiles, the
catalog's prices and calibration, built with the controller's own ``SailorPlanner`` and
``pool_of`` — at 64, 512 and 2048 nodes. Per size: one full ``search`` (timed once), then
``--reps`` times each of

- leave: a node of the running layout's most used type is gone (n - 1 nodes);
- join: a node of the other type joins (n + 1 nodes);
- notice: a preempted node leaves and, as the controller does, the replan starts from the
  plan that was running before it (the leave's replanned result).

Each replan starts from a deep copy of its previous result, so every repetition does the
same work as the first (a replan writes its shortlist back into the warm state); the copy
shares the search's immutable inputs (model, profiles, GPU specs), as the controller's next
replan does, so the simulator's memoized layer tables of those inputs are not rebuilt. Reported:
p50/p95 of CPU time (``time.process_time``) and wall time in ms, the planner's objective
against a full ``search`` on the new pool (gap = 1 - replan/full; replan's tolerance is 2 %),
the layer replicas each plan moves, nproc and load average. ``--profile`` prints a cProfile
summary (by own time and cumulative) of the replans of one size (``--profile-nodes``, 512).

Run: ``.venv/bin/python benchmarks/planner_replan.py [--sizes 64,512,2048] [--reps 7]``.
Prints; asserts nothing.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import gc
import io
import os
import platform
import pstats
import sys
import time
from dataclasses import dataclass
from typing import TypeVar

from sailor import catalog
from sailor.controller.planning import SailorPlanner, load_model_spec, pool_of
from sailor.planner import moved_layers, replan, search
from sailor.planner.judge import SearchResult
from sailor.planner.robust import RobustResult, robust_replan, robust_search
from sailor.schemas.hardware import NodeSpec, Pool

MODEL = "OPT-350"
GLOBAL_BATCH = 1024
ZONE = "us-central1-a"
GPU_TYPES = ("A100-40", "V100-16")


def node_spec(i: int) -> NodeSpec:
    """The runtime benchmark's node ``i`` (types alternate)."""
    return NodeSpec(
        node_id=f"n{i:05d}",
        gpu_type=GPU_TYPES[i % len(GPU_TYPES)],
        gpus=4,
        zone=ZONE,
        spot=True,
        address=f"10.0.{i // 250}.{i % 250 + 1}",
    )


def _full_search(planner: SailorPlanner, pool: Pool) -> SearchResult:
    """What ``SailorPlanner`` runs for a first layout."""
    return search(
        planner.model,
        planner.profiles,
        pool,
        planner.network,
        planner.prices,
        planner.objective,
        planner.constraints,
        gpu_specs=catalog.gpus(),
        calibration=planner.calibration,
        spot=planner.spot,
        top_k=3,
    )


@dataclass
class Timing:
    cpu: list[float]
    wall: list[float]

    def row(self) -> str:
        def p(xs: list[float], q: float) -> float:
            s = sorted(xs)
            return 1000 * s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]

        return (
            f"cpu p50 {p(self.cpu, 0.5):7.1f} p95 {p(self.cpu, 0.95):7.1f}   "
            f"wall p50 {p(self.wall, 0.5):7.1f} p95 {p(self.wall, 0.95):7.1f}"
        )


def _objective(res: SearchResult) -> float:
    if not res.plans:
        return 0.0
    e = res.plans[0].estimate
    if res.objective == "throughput":
        return e.throughput_iter_s
    if res.objective == "cost":
        return -e.cost_per_iter_usd
    return e.throughput_iter_s / res.plans[0].cost_per_hour_usd


def _gpus(res: SearchResult) -> int:
    return res.plans[0].plan.num_gpus if res.plans else 0


_R = TypeVar("_R", SearchResult, RobustResult)


def _warm_copy(result: _R) -> _R:
    """A deep copy of a search result that shares its immutable inputs (model, profiles,
    network, prices, GPU specs), as the controller's next replan does."""
    states = (
        [result.state]
        if isinstance(result, SearchResult)
        else [r.state for r in result.results.values()]
    )
    shared: dict[int, object] = {}
    for st in states:
        inp = st.tables.inputs
        for o in (inp.model, inp.profiles, inp.network, inp.prices, inp.gpu_specs):
            shared[id(o)] = o
    return copy.deepcopy(result, shared)


def run_size(planner: SailorPlanner, n: int, reps: int, prof: cProfile.Profile | None) -> None:
    nodes = [node_spec(i) for i in range(n)]
    c0, w0 = time.process_time(), time.perf_counter()
    first = _full_search(planner, pool_of(nodes))
    c1, w1 = time.process_time() - c0, time.perf_counter() - w0
    print(
        f"\n{n} nodes ({4 * n} GPUs): full search cpu {1000 * c1:.0f} ms, wall {1000 * w1:.0f} ms;"
        f" plan {_gpus(first)} GPUs, {_objective(first):.4g} it/s"
    )
    used = first.plans[0].plan.pipelines[0].stages[0].replica.gpu_type
    leave_nodes = list(nodes)
    drop = next(i for i in range(len(nodes) // 2, len(nodes)) if nodes[i].gpu_type == used)
    del leave_nodes[drop]
    join_nodes = [*nodes, node_spec(n + 1 if node_spec(n).gpu_type == used else n)]
    notice_nodes = list(leave_nodes)
    drop2 = next(i for i in range(len(notice_nodes) // 3, len(notice_nodes)))
    del notice_nodes[drop2]

    cases: list[tuple[str, SearchResult, Pool]] = [
        ("leave", first, pool_of(leave_nodes)),
        ("join", first, pool_of(join_nodes)),
    ]
    after_leave = replan(_warm_copy(first), cases[0][2])
    cases.append(("notice", after_leave, pool_of(notice_nodes)))
    for kind, prev, pool in cases:
        frozen = _warm_copy(prev)
        tm = Timing([], [])
        res: SearchResult | None = None
        for _ in range(reps):
            warm = _warm_copy(frozen)  # outside the clock, and its garbage collected
            gc.collect()
            if prof is not None:
                prof.enable()
            c0, w0 = time.process_time(), time.perf_counter()
            res = replan(warm, pool)
            tm.cpu.append(time.process_time() - c0)
            tm.wall.append(time.perf_counter() - w0)
            if prof is not None:
                prof.disable()
        assert res is not None
        full = _full_search(planner, pool)
        got, ref = _objective(res), _objective(full)
        gap = 1 - got / ref if ref > 0 else float("nan")
        moved = res.plans[0].moved_layer_replicas if res.plans else -1
        moved_full = "-"
        if full.plans and prev.plans:
            moved_full = str(moved_layers(prev.plans[0].plan, full.plans[0].plan)[1])
        print(
            f"  {kind:<6} {pool.total_gpus:>5} GPUs  {tm.row()}   "
            f"objective {got:.4g} vs full search {ref:.4g} (gap {100 * gap:+.2f} %), "
            f"plan {_gpus(res)} GPUs, moves {moved} layer replicas (full search's plan: "
            f"{moved_full})"
        )


def _full_robust(planner: SailorPlanner, pool: Pool) -> RobustResult:
    """``sailor plan --risk robust``'s search of ``pool``."""
    return robust_search(
        planner.model,
        planner.profiles,
        pool,
        planner.network,
        planner.prices,
        planner.objective,
        planner.constraints,
        gpu_specs=catalog.gpus(),
        calibration=planner.calibration,
        spot=planner.spot,
        top_k=3,
    )


def run_size_robust(
    planner: SailorPlanner, n: int, reps: int, prof: cProfile.Profile | None = None
) -> None:
    """``robust_replan`` after a leave and a join; quality = the plan's it/s in its worst
    corner (the interval's low end) against a full robust search of the new pool."""
    nodes = [node_spec(i) for i in range(n)]
    c0 = time.process_time()
    first = _full_robust(planner, pool_of(nodes))
    print(
        f"\n{n} nodes ({4 * n} GPUs), risk robust: full robust search cpu "
        f"{1000 * (time.process_time() - c0):.0f} ms"
    )
    leave = list(nodes)
    del leave[len(nodes) // 2]
    for kind, pool in (("leave", pool_of(leave)), ("join", pool_of([*nodes, node_spec(n)]))):
        tm = Timing([], [])
        res: RobustResult | None = None
        for _ in range(reps):
            warm = _warm_copy(first)
            gc.collect()
            c0, w0 = time.process_time(), time.perf_counter()
            if prof is not None:
                prof.enable()
            res = robust_replan(warm, pool)
            if prof is not None:
                prof.disable()
            tm.cpu.append(time.process_time() - c0)
            tm.wall.append(time.perf_counter() - w0)
        assert res is not None and res.plans
        full = _full_robust(planner, pool)
        got = res.plans[0].interval.throughput_iter_s.low
        ref = full.plans[0].interval.throughput_iter_s.low
        print(
            f"  {kind:<6} {pool.total_gpus:>5} GPUs  {tm.row()}   worst-corner it/s {got:.4g} vs "
            f"full robust search {ref:.4g} (gap {100 * (1 - got / ref):+.2f} %), "
            f"{res.candidates} plans judged, moves {res.plans[0].moved_layer_replicas}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    ap.add_argument("--sizes", default="64,512,2048")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--profile", action="store_true", help="cProfile the replans of one pool size")
    ap.add_argument(
        "--profile-nodes", type=int, default=512, help="the pool size --profile profiles"
    )
    ap.add_argument(
        "--risk",
        choices=("point", "robust"),
        default="point",
        help="point: replan() in the configured calibration; robust: robust_replan()",
    )
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    print(
        f"machine: {platform.machine()} nproc={os.cpu_count()} load average "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; python {sys.version.split()[0]}"
    )
    print(
        f"{MODEL} (gbs {GLOBAL_BATCH}), spot 4-GPU nodes {'/'.join(GPU_TYPES)} in {ZONE}, "
        f"analytic profiles; {args.reps} replans per case; times in ms"
    )
    planner = SailorPlanner(load_model_spec(MODEL, GLOBAL_BATCH))
    for n in sizes:
        prof = cProfile.Profile() if args.profile and n == args.profile_nodes else None
        if args.risk == "robust":
            run_size_robust(planner, n, args.reps, prof)
        else:
            run_size(planner, n, args.reps, prof)
        if prof is not None:
            for key in ("tottime", "cumulative"):
                buf = io.StringIO()
                pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(25)
                print(f"\n  cProfile of the {n}-node replans, by {key}:")
                print("\n".join("    " + ln for ln in buf.getvalue().splitlines()[6:40]))
    print(f"\nload average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
