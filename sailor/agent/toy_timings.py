"""Plausible step timings for the toy trainer: a cluster whose node kinds are X times slower.

The toy trainer (``toy_trainer --slowness "V100-16=2.5"``) trains nothing, yet online
calibration needs each rank's timings. This module makes them up from the cost model:
the plan the rank belongs to is simulated (:func:`sailor.simulator.synthetic_timings.
expected_rank_timings`) on what a controller configured with only a catalog model name plans
with — the catalog model at the plan's batch size, no profile files (analytic estimates from
the catalog GPU specs), the default network and the catalog calibration — except that each
named GPU type's layer compute is ``compute_scale`` = X times slower. Every step reports
those figures with a deterministic relative noise per (rank, step). So a "slow node" is faked
without running anything slowly; the figures are simulated, never measured.

The slowness is given for the whole cluster (every toy worker of the job gets the same
``--slowness``), so that the pipeline waits and gradient-sync waits each rank reports are
consistent with its neighbours' speeds; to make one node slow, give it a kind of its own.

Imported only by a toy trainer given ``--slowness`` (pydantic and the simulator add to its
start-up).
"""

from __future__ import annotations

import random
from pathlib import Path

from sailor import catalog
from sailor.schemas import NetworkProfile, Plan, ProfileDB
from sailor.schemas.online_calibration import RankTimings
from sailor.simulator.fit_corners import with_constant
from sailor.simulator.synthetic_timings import expected_rank_timings

__all__ = ["ToyTimings", "parse_slowness"]


def parse_slowness(spec: str) -> dict[str, float]:
    """``"KIND=X,KIND2=Y"`` -> {kind: factor}; raises ValueError naming the bad part."""
    out: dict[str, float] = {}
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        kind, sep, value = part.partition("=")
        try:
            factor = float(value)
        except ValueError:
            factor = -1.0
        if not sep or not kind or factor <= 0:
            raise ValueError(f"--slowness part {part!r}: expected KIND=FACTOR with FACTOR > 0")
        out[kind.strip()] = factor
    return out


class ToyTimings:
    """The step figures of one rank of a plan on a cluster with the given slowness."""

    def __init__(self, plan_file: Path, rank: int, slowness: dict[str, float], noise: float):
        plan = Plan.model_validate_json(plan_file.read_text())
        model = catalog.model(plan.model).model_copy(
            update={"global_batch_size": plan.global_batch_size}
        )
        cal = catalog.calibration()
        for kind, factor in slowness.items():
            cal = with_constant(cal, kind, compute_scale=factor)
        every = expected_rank_timings(
            plan,
            model,
            ProfileDB(model=model.name),
            NetworkProfile(),
            catalog.prices(),
            calibration=cal,
            gpu_specs=catalog.gpus(),
        )
        self.base: RankTimings = every[rank]
        self.rank = rank
        self.noise = noise

    def step(self, step: int) -> dict[str, float | int]:
        """The fields of one step line (``fwd_s``, ``bwd_s``, ``p2p_s``, ``sync_s``,
        ``optim_s``, ``step_s``, ``microbatches``), each with its own noise."""
        rng = random.Random(self.rank * 1_000_003 + step)
        b = self.base

        def jitter(x: float) -> float:
            return max(0.0, x * (1.0 + self.noise * rng.gauss(0.0, 1.0)))

        fields = {
            "fwd_s": jitter(b.fwd_s),
            "bwd_s": jitter(b.bwd_s),
            "p2p_s": jitter(b.p2p_s),
            "sync_s": jitter(b.sync_s),
            "optim_s": jitter(b.optim_s),
        }
        step_s = max(jitter(b.step_s), 1e-9)
        return {**fields, "step_s": step_s, "microbatches": b.microbatches}
