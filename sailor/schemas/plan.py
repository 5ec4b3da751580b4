"""Plans: pipelines of stages on replica groups, and the gradient-sync segments they imply.

A plan is a set of **pipelines** (the data-parallel replicas). Each pipeline has its own
depth, layer partition, microbatch size and number of microbatches. Each stage of a pipeline
owns a contiguous range of global layers and runs on one **replica group**: ``tp`` GPUs of one
type inside one node. Gradients are synchronized per **layer segment**: the common refinement
of all pipelines' partitions; for each segment, the replica groups that hold it (one per
pipeline) all-reduce it, weighted by the samples each pipeline processed.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass

from pydantic import Field, field_validator, model_validator

from sailor.schemas._base import Frozen, field_error
from sailor.schemas.hardware import GPUSpec
from sailor.schemas.model import MAX_GLOBAL_BATCH
from sailor.schemas.precision import Precision, choose_precision

__all__ = [
    "Pipeline",
    "Plan",
    "PlanPrediction",
    "RankPlace",
    "ReplicaGroup",
    "Segment",
    "Stage",
    "layer_segments",
]


class ReplicaGroup(Frozen):
    """The GPUs that run one stage of one pipeline: ``tp`` GPUs of one node."""

    gpu_type: str = Field(description="GPU type.")
    zone: str = Field(description="Zone name.")
    tp: int = Field(default=1, gt=0, description="Tensor-parallel degree (GPUs used).")
    gpus_per_node: int = Field(
        default=1, gt=0, description="GPUs per node of the VM shape it runs on."
    )
    node_id: str = Field(default="", description="Node it is placed on (set at launch).")
    first_gpu: int = Field(default=0, ge=0, description="First local GPU index on the node.")
    spot: bool | None = Field(
        default=None,
        description="Priced at spot rates (True) or on-demand (False); None: the simulator's "
        "spot argument decides.",
    )

    @model_validator(mode="after")
    def _fits(self) -> ReplicaGroup:
        if self.tp > self.gpus_per_node:
            raise field_error("tp", self.tp, f"exceeds gpus_per_node={self.gpus_per_node}")
        if self.tp & (self.tp - 1):
            raise field_error("tp", self.tp, "must be a power of two")
        if self.first_gpu + self.tp > self.gpus_per_node:
            raise field_error(
                "first_gpu", self.first_gpu, f"+ tp={self.tp} exceeds {self.gpus_per_node} GPUs"
            )
        return self


class Stage(Frozen):
    """Layers ``[first_layer, last_layer]`` (inclusive) on one replica group."""

    first_layer: int = Field(ge=0, description="First global layer of the stage.")
    last_layer: int = Field(ge=0, description="Last global layer of the stage (inclusive).")
    replica: ReplicaGroup = Field(description="GPUs running this stage.")
    recompute: bool = Field(default=False, description="Recompute activations in backward.")

    @model_validator(mode="after")
    def _order(self) -> Stage:
        if self.last_layer < self.first_layer:
            raise field_error(
                "last_layer", self.last_layer, f"is before first_layer={self.first_layer}"
            )
        return self

    @property
    def layers(self) -> range:
        return range(self.first_layer, self.last_layer + 1)

    @property
    def num_layers(self) -> int:
        return self.last_layer - self.first_layer + 1


class Pipeline(Frozen):
    """One data-parallel replica of the model, split into stages."""

    stages: tuple[Stage, ...] = Field(min_length=1, description="Stages in order.")
    microbatch_size: int = Field(gt=0, le=MAX_GLOBAL_BATCH, description="Samples per microbatch.")
    num_microbatches: int = Field(
        gt=0, le=MAX_GLOBAL_BATCH, description="Microbatches per iteration."
    )

    @model_validator(mode="after")
    def _contiguous(self) -> Pipeline:
        if self.stages[0].first_layer != 0:
            raise field_error("stages[0].first_layer", self.stages[0].first_layer, "must be 0")
        for i in range(1, len(self.stages)):
            prev, cur = self.stages[i - 1], self.stages[i]
            if cur.first_layer != prev.last_layer + 1:
                raise field_error(
                    f"stages[{i}].first_layer",
                    cur.first_layer,
                    f"must follow stages[{i - 1}].last_layer={prev.last_layer}",
                )
        return self

    @property
    def depth(self) -> int:
        return len(self.stages)

    @property
    def samples(self) -> int:
        return self.microbatch_size * self.num_microbatches

    @property
    def num_layers(self) -> int:
        return self.stages[-1].last_layer + 1

    @property
    def gpus(self) -> int:
        return sum(s.replica.tp for s in self.stages)

    def partition(self) -> tuple[int, ...]:
        """Layers per stage."""
        return tuple(s.num_layers for s in self.stages)


class PlanPrediction(Frozen):
    """The simulator's figures for a plan, carried with it."""

    iteration_time_s: float = Field(gt=0, description="Predicted seconds per iteration.")
    throughput_iter_s: float = Field(gt=0, description="Iterations per second.")
    peak_memory_bytes: int = Field(ge=0, description="Largest predicted memory of any GPU.")
    cost_per_iter_usd: float = Field(ge=0, description="$ per iteration.")


class Segment(Frozen):
    """A maximal layer range that no pipeline splits; the unit of gradient sync."""

    first_layer: int = Field(ge=0, description="First global layer.")
    last_layer: int = Field(ge=0, description="Last global layer (inclusive).")
    holders: tuple[tuple[int, int], ...] = Field(
        description="(pipeline index, stage index) of every replica group holding it."
    )


@dataclass(frozen=True)
class RankPlace:
    """Where one global rank sits in a plan (:meth:`Plan.rank_table`)."""

    pipeline: int
    stage: int
    tp_rank: int
    tp: int
    """Its replica group's TP degree."""
    first_rank: int
    """Global rank of TP rank 0 of its replica group."""
    local_gpu: int
    """Node-local GPU index: the group's ``first_gpu`` plus the TP rank."""
    gpu_type: str
    first_layer: int
    last_layer: int

    @property
    def layers(self) -> range:
        return range(self.first_layer, self.last_layer + 1)


class Plan(Frozen):
    """A complete parallelization of one model on concrete GPU types and zones."""

    plan_id: str = Field(default="", description="Identifier (content hash or name).")
    model: str = Field(description="Model name.")
    global_batch_size: int = Field(gt=0, le=MAX_GLOBAL_BATCH, description="Samples per iteration.")
    pipelines: tuple[Pipeline, ...] = Field(min_length=1, description="Data-parallel pipelines.")
    predicted: PlanPrediction | None = Field(default=None, description="Simulator figures.")
    precision: Precision | None = Field(
        default=None,
        description="Compute precision of the job, one for every rank (schemas.precision): "
        "what the engine runs and the simulator prices. None (plans written before it was "
        "recorded): derived from the plan's GPU types by resolved_precision.",
    )

    @field_validator("pipelines")
    @classmethod
    def _same_layers(cls, v: tuple[Pipeline, ...]) -> tuple[Pipeline, ...]:
        # the layer count most pipelines agree on (the first pipeline's on a tie): the odd
        # one out is the one named, not whichever follows a broken first pipeline
        counts: dict[int, int] = {}
        for p in v:
            counts[p.num_layers] = counts.get(p.num_layers, 0) + 1
        n = max(counts, key=lambda k: (counts[k], k == v[0].num_layers))
        for i, p in enumerate(v):
            if p.num_layers != n:
                raise field_error(
                    f"pipelines[{i}].stages[-1].last_layer",
                    p.num_layers - 1,
                    f"every pipeline must cover the same layers: {counts[n]} of {len(v)} "
                    f"cover 0..{n - 1}",
                )
        return v

    @model_validator(mode="after")
    def _batch(self) -> Plan:
        total = sum(p.samples for p in self.pipelines)
        if total != self.global_batch_size:
            raise field_error(
                "pipelines[*].microbatch_size*num_microbatches",
                total,
                f"must add up to global_batch_size={self.global_batch_size}",
            )
        return self

    @property
    def num_layers(self) -> int:
        return self.pipelines[0].num_layers

    @property
    def num_gpus(self) -> int:
        return sum(p.gpus for p in self.pipelines)

    @property
    def gpu_types(self) -> tuple[str, ...]:
        """GPU types of the plan, in order of first use."""
        return tuple(dict.fromkeys(s.replica.gpu_type for p in self.pipelines for s in p.stages))

    def resolved_precision(
        self, specs: Mapping[str, GPUSpec], requested: Precision = "bf16"
    ) -> Precision:
        """The recorded precision, else the one :func:`choose_precision` gives the plan's GPU
        types (``requested``: the model spec's precision)."""
        if self.precision is not None:
            return self.precision
        return choose_precision(self.gpu_types, specs, requested)

    def with_precision(self, specs: Mapping[str, GPUSpec], requested: Precision = "bf16") -> Plan:
        """This plan with its precision recorded (derived as :meth:`resolved_precision`)."""
        return self.model_copy(update={"precision": self.resolved_precision(specs, requested)})

    def gpus_by_type_zone(self) -> dict[str, int]:
        """'<gpu>@<zone>' -> GPUs used."""
        out: dict[str, int] = {}
        for p in self.pipelines:
            for s in p.stages:
                k = f"{s.replica.gpu_type}@{s.replica.zone}"
                out[k] = out.get(k, 0) + s.replica.tp
        return dict(sorted(out.items()))

    def segments(self) -> list[Segment]:
        return layer_segments(self)

    def ranks(self) -> list[tuple[int, int, int]]:
        """Global rank order: (pipeline, stage, tp rank), pipeline-major."""
        return [
            (pi, si, t)
            for pi, p in enumerate(self.pipelines)
            for si, s in enumerate(p.stages)
            for t in range(s.replica.tp)
        ]

    def rank_table(self) -> tuple[RankPlace, ...]:
        """Every global rank's place, in :meth:`ranks` order: one pass over the plan, for
        callers that look up many ranks (:meth:`local_gpu` walks the plan per call)."""
        out: list[RankPlace] = []
        for pi, p in enumerate(self.pipelines):
            for si, s in enumerate(p.stages):
                g = s.replica
                first = len(out)
                out.extend(
                    RankPlace(
                        pipeline=pi,
                        stage=si,
                        tp_rank=t,
                        tp=g.tp,
                        first_rank=first,
                        local_gpu=g.first_gpu + t,
                        gpu_type=g.gpu_type,
                        first_layer=s.first_layer,
                        last_layer=s.last_layer,
                    )
                    for t in range(g.tp)
                )
        return tuple(out)

    def local_gpu(self, rank: int) -> int:
        """The node-local GPU index of global ``rank``: its replica group's ``first_gpu``
        plus its TP rank."""
        ranks = self.ranks()
        if not 0 <= rank < len(ranks):
            raise field_error("rank", rank, f"the plan has ranks 0..{len(ranks) - 1}")
        pi, si, t = ranks[rank]
        return self.pipelines[pi].stages[si].replica.first_gpu + t


def layer_segments(plan: Plan) -> list[Segment]:
    """Common refinement of every pipeline's partition, with the holders of each segment."""
    # a plan repeats pipeline objects (a large plan is hundreds of copies of a few): each
    # distinct one is read once, for its cuts and the stage holding each segment
    distinct = {id(p): p for p in plan.pipelines}
    cuts: set[int] = set()
    for p in distinct.values():
        for s in p.stages:
            cuts.add(s.first_layer)
    bounds = [*sorted(cuts), plan.num_layers]
    spans = list(itertools.pairwise(bounds))
    holding: dict[int, list[int | None]] = {}
    for k, p in distinct.items():
        holding[k] = [
            next(
                (
                    si
                    for si, s in enumerate(p.stages)
                    if s.first_layer <= a and b - 1 <= s.last_layer
                ),
                None,
            )
            for a, b in spans
        ]
    rows = [holding[id(p)] for p in plan.pipelines]
    out: list[Segment] = []
    for j, (a, b) in enumerate(spans):
        holders = tuple((pi, row[j]) for pi, row in enumerate(rows) if row[j] is not None)
        out.append(Segment(first_layer=a, last_layer=b - 1, holders=holders))
    return out
