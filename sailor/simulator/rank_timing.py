"""How the placement of a plan's ranks times its pipelines and collectives.

:class:`RankTiming` is the small interface :func:`~sailor.simulator.simulate.simulate` (its
``ranks``) runs the 1F1B schedules and the all-reduces through; :class:`OwnDevices` is the
simulator's own, the GPU case where every rank owns its device. The CPU test scaffolding
(:mod:`sailor.simulator.cpu_host`) supplies another, and this module must never import it.

Pure: values in, values out; no I/O, no clock, no globals.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from sailor.schemas import Pipeline
from sailor.simulator.network_model import AllReduce
from sailor.simulator.pipeline import TimelineOp, closed_form_1f1b, replay_1f1b
from sailor.simulator.pipeline_kinds import PipelineKind
from sailor.simulator.sim_inputs import Notes

__all__ = [
    "Method",
    "OwnDevices",
    "PipelineRuns",
    "RankTiming",
    "StageRef",
]

Method = Literal["closed_form", "replay"]


StageRef = tuple[int, int]
"""(pipeline, stage) of a plan."""


@dataclass
class PipelineRuns:
    """Each pipeline's end, each of its stages' end of last backward, and the recorded ops."""

    end_s: list[float]
    stage_end_s: list[tuple[float, ...]]
    ops: list[TimelineOp]


class RankTiming(Protocol):
    """How the placement of a plan's ranks times its pipelines and collectives.

    The simulator's own, :class:`OwnDevices`, is the GPU case: every rank owns its device. The
    CPU test scaffolding (:mod:`sailor.simulator.cpu_host`) supplies ranks sharing one host's
    cores. One object per simulation: it may keep state between calls, which come in the
    order of the iteration (pipelines, gradient all-reduces, loss all-reduce).
    """

    def run_pipelines(
        self,
        pipelines: Sequence[Pipeline],
        kinds: Sequence[PipelineKind],
        method: Method,
        timeline: bool,
        notes: Notes,
    ) -> PipelineRuns:
        """Run 1F1B on every pipeline (``kinds[i]``: the figures of ``pipelines[i]``)."""
        ...

    def end_slowdown(self, pipelines: Sequence[Pipeline]) -> float:
        """How many times slower than alone the end of iteration and the optimizer step run."""
        ...

    def grad_allreduce_s(
        self, ar: AllReduce, holders: Sequence[StageRef], node_bytes: float, *, chains: bool
    ) -> float:
        """Time of gradient all-reduce ``ar`` among the stages ``holders`` (``chains``: a
        segment's, which the next one may follow at once; the tied embedding's does not)."""
        ...

    def loss_allreduce_s(self, ar: AllReduce, ranks: int, node_bytes: float) -> float:
        """Time of the loss all-reduce ``ar`` over every rank, right after the step."""
        ...


class OwnDevices:
    """Every rank owns its device (GPUs): pipelines run on their own, collectives take the
    modelled ring's time."""

    def run_pipelines(
        self,
        pipelines: Sequence[Pipeline],
        kinds: Sequence[PipelineKind],
        method: Method,
        timeline: bool,
        notes: Notes,
    ) -> PipelineRuns:
        # alike pipelines with the same microbatch count are run once
        out = PipelineRuns([], [], [])
        runs: dict[tuple[int, int], tuple[float, tuple[float, ...], int, tuple[TimelineOp, ...]]]
        runs = {}
        for pi, (p, kind) in enumerate(zip(pipelines, kinds, strict=True)):
            rkey = (id(kind), p.num_microbatches)
            done = runs.get(rkey)
            if done is None:
                if method == "replay":
                    run = replay_1f1b(
                        kind.fs,
                        kind.bs,
                        p.num_microbatches,
                        kind.delay,
                        pipeline=pi,
                        record=timeline,
                    )
                    done = (run.end_s, run.stage_end_s, pi, run.ops)
                else:
                    t = closed_form_1f1b(kind.fs, kind.bs, p.num_microbatches, kind.delay)
                    done = (t, tuple(t for _ in kind.row), pi, ())
                runs[rkey] = done
            out.end_s.append(done[0])
            out.stage_end_s.append(done[1])
            if timeline:
                if done[2] == pi:
                    out.ops.extend(done[3])
                else:
                    out.ops.extend(dataclasses.replace(op, pipeline=pi) for op in done[3])
        return out

    def end_slowdown(self, pipelines: Sequence[Pipeline]) -> float:
        return 1.0

    def grad_allreduce_s(
        self, ar: AllReduce, holders: Sequence[StageRef], node_bytes: float, *, chains: bool
    ) -> float:
        return ar.time_s

    def loss_allreduce_s(self, ar: AllReduce, ranks: int, node_bytes: float) -> float:
        return ar.time_s
