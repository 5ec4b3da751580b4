"""When each stage of a plan finishes its pipeline phase, by the simulator's 1F1B replay.

The replay's timeline records every forward and backward of every pipeline (ops copied per
pipeline: ~260,000 ``dataclasses.replace`` for 68 replays of a 32-GPU plan, 6 s). What the
online fit and the synthetic timings need is less: per stage, when its last backward ends.
:func:`replay_stage_ends` gets it through the simulator's ``RankTiming`` hook, from the
replay it runs once per distinct pipeline, with no timeline.

Pure: values in, values out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from sailor.schemas import (
    Calibration,
    Estimate,
    GPUSpec,
    ModelSpec,
    NetworkProfile,
    Pipeline,
    Plan,
    PriceTable,
    ProfileDB,
)
from sailor.simulator.pipeline_kinds import PipelineKind
from sailor.simulator.rank_timing import Method, OwnDevices, PipelineRuns
from sailor.simulator.sim_inputs import Notes
from sailor.simulator.simulate import simulate

__all__ = ["replay_stage_ends"]


class _StageEnds(OwnDevices):
    """The simulator's own timing, keeping each pipeline's stage ends of the 1F1B replay
    (worked out once per distinct pipeline, without recording every operation)."""

    def __init__(self) -> None:
        self.runs: PipelineRuns | None = None

    def run_pipelines(
        self,
        pipelines: Sequence[Pipeline],
        kinds: Sequence[PipelineKind],
        method: Method,
        timeline: bool,
        notes: Notes,
    ) -> PipelineRuns:
        self.runs = super().run_pipelines(pipelines, kinds, method, timeline, notes)
        return self.runs


def replay_stage_ends(
    plan: Plan,
    model: ModelSpec,
    profiles: ProfileDB,
    network: NetworkProfile,
    prices: PriceTable,
    cal: Calibration,
    specs: Mapping[str, GPUSpec],
) -> tuple[Estimate, dict[tuple[int, int], float]]:
    """The replay's estimate of ``plan`` and, per (pipeline, stage), when the stage's last
    backward ends (its pipeline phase, from the iteration's start)."""
    rec = _StageEnds()
    est = simulate(
        plan,
        model,
        profiles,
        network,
        prices,
        calibration=cal,
        gpu_specs=specs,
        method="replay",
        ranks=rec,
    )
    if rec.runs is None:
        raise RuntimeError("the simulator ran no pipeline")
    ends = {(pi, si): t for pi, row in enumerate(rec.runs.stage_end_s) for si, t in enumerate(row)}
    return est, ends
