"""The homogeneous grid search a practitioner runs by hand (Megatron-style PP x TP x DP).

One GPU type in one zone at a time; uniform stages (extra layers to the last stages); TP
inside a node; DP = as many pipelines as the GPUs allow such that DP x microbatch size
divides the global batch; one microbatch size; every pipeline the same number of
microbatches. Grid points are prefiltered by the 1F1B closed form of their stage times and
the best few are simulated.
"""

from __future__ import annotations

from collections.abc import Mapping

from sailor.planner.api import Constraints, Objective, RankedPlan
from sailor.planner.baselines._common import data_parallel, grid_of, grid_point, judge, uniform_cuts
from sailor.planner.tables import Inputs, Kind
from sailor.planner.templates import with_cuts
from sailor.planner.upper_bound import mbs_candidates, tp_candidates
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
    Stage,
)

__all__ = ["megatron_grid"]


def megatron_grid(
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
    """Best homogeneous PP x TP x DP plans of the pool (one GPU type and zone each)."""
    inputs = Inputs(model, profiles, network, prices, gpu_specs, calibration or Calibration(), spot)
    grid = grid_of(inputs, pool, constraints)
    tables = grid.tables
    gbs = model.global_batch_size
    n_layers = model.num_all_layers
    points: list[tuple[float, Plan, float]] = []
    for (g, z, k), n_gpus in sorted(grid.caps.items()):
        for tp in tp_candidates(k):
            for b in mbs_candidates(tables.inputs, g):
                for pp in range(1, n_layers + 1):
                    dp = data_parallel(n_gpus, tp, pp, b, gbs)
                    if dp == 0:
                        continue
                    t = with_cuts(tables, Kind(g, tp, z, k), b, uniform_cuts(n_layers, pp))
                    if t is None:
                        continue
                    m = gbs // (dp * b)
                    it = t.pipe_time(m)
                    pipe = Pipeline(
                        stages=tuple(
                            Stage(
                                first_layer=s.first_layer,
                                last_layer=s.last_layer,
                                replica=s.kind.replica(),
                            )
                            for s in t.stages
                        ),
                        microbatch_size=b,
                        num_microbatches=m,
                    )
                    plan = Plan(model=model.name, global_batch_size=gbs, pipelines=(pipe,) * dp)
                    points.append(grid_point(grid, objective, plan, it, {(g, z): dp * pp * tp}))
    return judge(grid, points, objective, top_k, simulate_top, "megatron")
