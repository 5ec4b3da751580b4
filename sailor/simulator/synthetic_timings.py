"""What a cluster whose constants are known would report per rank: synthetic step timings.

The inverse of :mod:`online_fit`: given a plan and the "true" calibration of a cluster (for
instance a GPU type whose ``compute_scale`` is 2.5), the per-rank figures its workers would
measure if the cost model were exact — forward and backward compute per microbatch, the time
outside compute in the 1F1B replay (pipeline waits), gradient sync (the fixed cost, the
simulated all-reduces, and the wait for the last replica of the rank's group to arrive), the
optimizer step and the replay's iteration time. Used by the fit's tests and by the torch-free
toy worker (``sailor.agent.toy_trainer --slowness``) to fake a slow node cheaply. Nothing
here is measured.

Pure: values in, values out.
"""

from __future__ import annotations

from collections.abc import Mapping

from sailor.schemas import (
    Calibration,
    GPUSpec,
    ModelSpec,
    NetworkProfile,
    Plan,
    PriceTable,
    ProfileDB,
)
from sailor.schemas.online_calibration import RankTimings
from sailor.simulator.stage_ends import replay_stage_ends

__all__ = ["expected_rank_timings"]


def expected_rank_timings(
    plan: Plan,
    model: ModelSpec,
    profiles: ProfileDB,
    network: NetworkProfile,
    prices: PriceTable,
    *,
    calibration: Calibration | None = None,
    gpu_specs: Mapping[str, GPUSpec] | None = None,
) -> tuple[RankTimings, ...]:
    """One :class:`RankTimings` per global rank of ``plan`` (one step, no spread)."""
    cal = calibration or Calibration()
    est, end = replay_stage_ends(plan, model, profiles, network, prices, cal, gpu_specs or {})
    rows = {(s.pipeline, s.stage): s for s in est.stages}
    # replica groups: stages sharing a layer segment wait for each other's arrival
    arrive: dict[tuple[int, int], float] = {}
    for pi, p in enumerate(plan.pipelines):
        for si, s in enumerate(p.stages):
            arrive[(pi, si)] = end[(pi, si)] + cal.for_gpu(s.replica.gpu_type).sync_fixed_s
    latest = dict(arrive)
    for seg in plan.segments():
        t = max(arrive[h] for h in seg.holders)
        for h in seg.holders:
            latest[h] = max(latest[h], t)
    out: list[RankTimings] = []
    for rank, (pi, si, _) in enumerate(plan.ranks()):
        p = plan.pipelines[pi]
        st = rows[(pi, si)]
        busy = p.num_microbatches * (st.fwd_s + st.bwd_s)
        fixed = cal.for_gpu(p.stages[si].replica.gpu_type).sync_fixed_s
        wait = latest[(pi, si)] - arrive[(pi, si)]
        out.append(
            RankTimings(
                rank=rank,
                steps=1,
                last_step=0,
                microbatches=p.num_microbatches,
                fwd_s=st.fwd_s,
                bwd_s=st.bwd_s,
                p2p_s=max(0.0, end[(pi, si)] - busy) if p.depth > 1 else 0.0,
                sync_s=fixed + st.grad_sync_s + wait,
                optim_s=st.update_s,
                step_s=est.iteration_time_s,
            )
        )
    return tuple(out)
