"""A heterogeneity-blind planner: it plans as if every GPU were the slowest type of the pool.

It picks PP x TP x DP, one microbatch size and a uniform split with the slowest type's
profile (per-GPU compute rate) and the smallest memory among the pool's types, over all GPUs
of the pool as if they were one kind, then hands the GPUs out in pool order (so a pipeline's
stages may land on different types and zones). Every pipeline gets the same number of
microbatches. Plans are scored by the simulator on the GPUs they really run on.
"""

from __future__ import annotations

from collections.abc import Mapping

from sailor.planner.api import Constraints, Objective, RankedPlan
from sailor.planner.baselines._common import data_parallel, grid_of, grid_point, judge, uniform_cuts
from sailor.planner.tables import Inputs, Kind
from sailor.planner.templates import with_cuts
from sailor.planner.upper_bound import mbs_candidates, per_gpu_rate, tp_candidates
from sailor.schemas import (
    Calibration,
    GPUSpec,
    ModelSpec,
    NetworkProfile,
    Pipeline,
    Plan,
    Pool,
    PriceTable,
    ProfileDB,
    ReplicaGroup,
    Stage,
)

__all__ = ["heterogeneity_blind"]


def heterogeneity_blind(
    model: ModelSpec,
    profiles: ProfileDB,
    pool: Pool,
    network: NetworkProfile,
    prices: PriceTable,
    objective: Objective = "throughput",
    constraints: Constraints | None = None,
    *,
    gpu_specs: Mapping[str, GPUSpec],
    calibration: Calibration | None = None,
    spot: bool = False,
    top_k: int = 3,
    simulate_top: int = 6,
) -> list[RankedPlan]:
    """Best plans of a planner that sees N identical GPUs of the slowest type."""
    inputs = Inputs(model, profiles, network, prices, gpu_specs, calibration or Calibration(), spot)
    grid = grid_of(inputs, pool, constraints)
    tables, caps = grid.tables, grid.caps
    gbs = model.global_batch_size
    n_layers = model.num_all_layers
    # the slowest type, and the smallest node of the pool (TP must fit every node)
    slow = min(caps, key=lambda r: per_gpu_rate(tables, r[0], r[2]))
    node = min(r[2] for r in caps)
    smallest = min(caps, key=lambda r: tables.capacity(r[0]))
    total = sum(caps.values())
    # GPUs in pool order, as (type, zone, gpus per node) slots
    slots: list[tuple[str, str, int]] = []
    for e in pool.entries:
        r = (e.gpu_type, e.zone, e.gpus_per_node)
        n = min(e.gpus, caps.get(r, 0) - sum(1 for s in slots if s == r))
        slots.extend([r] * max(0, n))
    points: list[tuple[float, Plan, float]] = []
    for tp in tp_candidates(node):
        for b in mbs_candidates(tables.inputs, slow[0]):
            for pp in range(1, n_layers + 1):
                dp = data_parallel(total, tp, pp, b, gbs)
                if dp == 0:
                    continue
                cuts = uniform_cuts(n_layers, pp)
                t = with_cuts(tables, Kind(slow[0], tp, slow[1], slow[2]), b, cuts)
                # memory as seen by the blind planner: the smallest GPU must hold the stage
                if t is None or (
                    smallest[0] != slow[0]
                    and with_cuts(tables, Kind(smallest[0], tp, smallest[1], smallest[2]), b, cuts)
                    is None
                ):
                    continue
                m = gbs // (dp * b)
                it = t.pipe_time(m)
                plan = _place(model.name, gbs, slots, cuts, tp, dp, b, m)
                if plan is None:
                    continue
                used: dict[tuple[str, str], int] = {}
                for p in plan.pipelines:
                    for s in p.stages:
                        k = (s.replica.gpu_type, s.replica.zone)
                        used[k] = used.get(k, 0) + s.replica.tp
                points.append(grid_point(grid, objective, plan, it, used))
    return judge(grid, points, objective, top_k, simulate_top, "blind")


def _place(
    model: str,
    gbs: int,
    slots: list[tuple[str, str, int]],
    cuts: tuple[int, ...],
    tp: int,
    dp: int,
    b: int,
    m: int,
) -> Plan | None:
    """Hand out GPUs in pool order: stage by stage, pipeline by pipeline, ``tp`` at a time."""
    i = 0
    pipes: list[Pipeline] = []
    for _ in range(dp):
        stages: list[Stage] = []
        first = 0
        for last in cuts:
            if i + tp > len(slots):
                return None
            g, z, k = slots[i]
            if any(s != slots[i] for s in slots[i : i + tp]) or k % tp:
                return None
            i += tp
            stages.append(
                Stage(
                    first_layer=first,
                    last_layer=last,
                    replica=ReplicaGroup(gpu_type=g, zone=z, tp=tp, gpus_per_node=k),
                )
            )
            first = last + 1
        pipes.append(Pipeline(stages=tuple(stages), microbatch_size=b, num_microbatches=m))
    return Plan(model=model, global_batch_size=gbs, pipelines=tuple(pipes))
