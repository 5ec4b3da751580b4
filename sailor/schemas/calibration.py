"""Calibration constants of the simulator: one value per GPU type, each with its measurement.

The simulator models the training framework from first principles (profiles, link curves,
parameter counts). A few effects cannot be derived from a per-layer profile or a link probe;
each is one constant per GPU type (a GPU type's nodes form one cluster, so network constants
are per GPU type too). Every constant records the measurement it came from. GPU types
without a calibration use :attr:`Calibration.default`, whose values are physically motivated
and documented below; they are not fitted to any measured plan.

See ``docs/simulator-model.md`` for how each constant enters the model.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from sailor.schemas._base import Frozen, field_error
from sailor.schemas.device_kind import catalog_type

__all__ = [
    "DEFAULT_MEMORY_OVERHEAD_BYTES",
    "Calibration",
    "ConstantRange",
    "GPUCalibration",
    "GPUPrior",
]

DEFAULT_MEMORY_OVERHEAD_BYTES = 1 << 30
"""1 GiB of non-tensor memory per training process when nothing was measured: the CUDA
context with its loaded kernel modules (~0.3-0.5 GiB on Ampere/Hopper with lazy loading),
cuBLAS/cuDNN workspaces and NCCL communicator buffers (a few MiB per channel and peer)."""


class ConstantRange(Frozen):
    """What is known about one constant: a low, a median and a high value, and why.

    ``low <= median <= high`` in the constant's own units. Which end is pessimistic depends on
    the constant (a low network efficiency and a high allocator factor both cost more); the
    corners of :mod:`sailor.simulator.uncertainty` pick the end that costs more.
    """

    low: float = Field(description="Lowest value the evidence supports.")
    median: float = Field(description="Central value used by the median corner.")
    high: float = Field(description="Highest value the evidence supports.")
    evidence: str = Field(default="", description="The measurements, figures or physics behind it.")

    @model_validator(mode="after")
    def _ordered(self) -> ConstantRange:
        if not self.low <= self.median <= self.high:
            raise field_error(
                "low/median/high", (self.low, self.median, self.high), "must be ordered"
            )
        return self


class GPUPrior(Frozen):
    """Ranges of every constant calibration fits, for a GPU type without measurements (the
    catalog's prior) or around a calibrated type's fit (its leave-one-out spread)."""

    profiler_overhead_s: ConstantRange = Field(description="Profiler hook cost per layer, s.")
    network_efficiency: ConstantRange = Field(
        description="Fraction of the probed link bandwidth the gradient all-reduces reach."
    )
    p2p_efficiency: ConstantRange = Field(
        description="Fraction of the probed link bandwidth pipeline transfers reach."
    )
    sync_fixed_s: ConstantRange = Field(description="Fixed sync cost per iteration, s.")
    alloc_factor: ConstantRange = Field(
        description="Caching-allocator factor (reserved/allocated)."
    )
    memory_overhead_bytes: ConstantRange = Field(description="Non-tensor memory per GPU, bytes.")
    compute_scale: ConstantRange | None = Field(
        default=None,
        description="Measured layer compute over profiled (online calibration); None: the "
        "type's point value in every corner.",
    )
    source: str = Field(default="", description="Where the ranges come from.")

    @model_validator(mode="after")
    def _bounds(self) -> GPUPrior:
        for name in ("network_efficiency", "p2p_efficiency"):
            r: ConstantRange = getattr(self, name)
            if r.low <= 0 or r.high > 1:
                raise field_error(name, (r.low, r.high), "an efficiency lies in (0, 1]")
        if self.alloc_factor.low < 1:
            raise field_error("alloc_factor.low", self.alloc_factor.low, "must be >= 1")
        for name in ("profiler_overhead_s", "sync_fixed_s", "memory_overhead_bytes"):
            if getattr(self, name).low < 0:
                raise field_error(f"{name}.low", getattr(self, name).low, "must be >= 0")
        if self.compute_scale is not None and self.compute_scale.low <= 0:
            raise field_error("compute_scale.low", self.compute_scale.low, "must be > 0")
        return self


class GPUCalibration(Frozen):
    """Constants for one GPU type (``gpu_type='*'`` for the default)."""

    gpu_type: str = Field(description="GPU type these constants belong to; '*' = default.")
    compute_scale: float = Field(
        default=1.0,
        gt=0,
        description=(
            "Measured over profiled forward and backward time of a layer on this GPU type: "
            "every profiled (or estimated) layer's fwd_s and bwd_s is multiplied by it, after "
            "the profiler-hook correction; nothing else (optimizer update, framework time, "
            "transfers) is. Fitted online from the running job's step reports "
            "(sailor.simulator.online_fit). Default 1.0: the profile is the truth."
        ),
    )
    profiler_overhead_s: float = Field(
        default=0.0,
        ge=0,
        description=(
            "CPU-side cost per layer (forward + backward) of the profiler's timing hooks, s. "
            "Removed from a layer's profiled time only while the layer is latency-bound. "
            "Default 0: the profile is taken at face value (an upper bound of training time)."
        ),
    )
    network_efficiency: float = Field(
        default=1.0,
        gt=0,
        le=1.0,
        description=(
            "Fraction of the probed link bandwidth the training framework's collectives and "
            "pipeline transfers reach. Default 1.0: the probe is taken as the truth."
        ),
    )
    p2p_efficiency: float | None = Field(
        default=None,
        gt=0,
        le=1.0,
        description=(
            "Fraction of the probed link bandwidth pipeline transfers reach. None: the same "
            "as network_efficiency (what a calibration from gradient reduce times gives)."
        ),
    )
    sync_fixed_s: float = Field(
        default=0.0,
        ge=0,
        description=(
            "Fixed cost per iteration between the last backward and the optimizer step "
            "(gradient flatten/unflatten, barrier, loss-scale overflow check), s. Default 0."
        ),
    )
    alloc_factor: float = Field(
        default=1.0,
        ge=1.0,
        description=(
            "Caching-allocator factor: reserved / allocated activation memory (what "
            "nvidia-smi reports over what tensors hold). Default 1.0: no fragmentation."
        ),
    )
    memory_overhead_bytes: int | None = Field(
        default=None,
        ge=0,
        description=(
            "Non-tensor memory per GPU (context, NCCL buffers, allocator slack), bytes. "
            "None: take ProfileDB.overheads for the GPU type, else 1 GiB "
            "(DEFAULT_MEMORY_OVERHEAD_BYTES)."
        ),
    )
    memory_overhead_tp_bytes: int = Field(
        default=0,
        ge=0,
        description=(
            "Extra non-tensor memory of a GPU in a TP group (TP > 1), bytes. 0 in the engine's "
            "model; the original artifact's memory model adds 1 GB (2 GB at TP 1, 3 GB above)."
        ),
    )
    source: str = Field(
        default="default: physically motivated, not fitted (docs/simulator-model.md)",
        description="Measurements these constants were derived from.",
    )
    spread: GPUPrior | None = Field(
        default=None,
        description=(
            "The constants' leave-one-out spread (each constant refitted without each measured "
            "run): the range the uncertainty corners use for this calibrated GPU type. None: "
            "the point values only."
        ),
    )

    @property
    def p2p_eta(self) -> float:
        """Efficiency of pipeline transfers (network_efficiency unless set apart)."""
        return self.network_efficiency if self.p2p_efficiency is None else self.p2p_efficiency


class Calibration(Frozen):
    """All calibration constants the simulator uses, per GPU type, with a default."""

    gpus: tuple[GPUCalibration, ...] = Field(
        default=(), description="Calibrated GPU types (at most one entry per type)."
    )
    default: GPUCalibration = Field(
        default_factory=lambda: GPUCalibration(gpu_type="*"),
        description="Constants for GPU types without an entry.",
    )
    prior: GPUPrior | None = Field(
        default=None,
        description=(
            "Ranges of every fitted constant for GPU types without a calibration, with their "
            "evidence (the catalog's). The uncertainty corners take their constants from it; "
            "None: only the point default is known."
        ),
    )
    sends_attention_mask: bool = Field(
        default=False,
        description=(
            "The pipeline engine sends the causal attention mask (seq x seq, 2 bytes per "
            "element, not split over TP) from every TP rank with every forward activation. "
            "False: Sailor's engine sends activations only, and the measured "
            "Megatron-DeepSpeed runs show no such cost; kept for a deployment that does."
        ),
    )
    p2p_across_tp: Literal["scatter_gather", "full_copies"] = Field(
        default="scatter_gather",
        description=(
            "How an activation crosses a stage boundary with TP > 1. 'scatter_gather' "
            "(Megatron-DeepSpeed): each sender rank sends 1/t of it and the receiving TP "
            "group all-gathers it inside its node (one copy crosses the link). "
            "'full_copies': each of the receiver's TP ranks gets the whole activation from "
            "one sender (t copies cross the link, no all-gather)."
        ),
    )
    grad_allreduce_bytes: int | None = Field(
        default=None,
        ge=1,
        le=4,
        description=(
            "Bytes per gradient element in the gradient all-reduces. None: what "
            "mixed_precision implies (4 under autocast, the compute dtype's under "
            "fp16_optimizer); set to price another deployment (e.g. the original artifact's "
            "fp32 gradients)."
        ),
    )
    ring_links: Literal["node", "per_gpu"] = Field(
        default="node",
        description=(
            "What a gradient ring's bytes cross. 'node': the TP ranks of a node run their "
            "rings at once over the node's NICs (node-level bytes on the node's curve). "
            "'per_gpu' (the original artifact's model): each rank's ring moves its own "
            "bytes over the link curve of a 1-GPU VM of its type."
        ),
    )
    extra_state_bytes_per_param: float = Field(
        default=0.0,
        ge=0,
        description=(
            "Model-state bytes per parameter beyond the engine's (communication buffers, "
            "extra copies). 0 for the engine; 8 reproduces the original artifact's 24 B per "
            "parameter over DeepSpeed's 16."
        ),
    )
    blocking_p2p: bool = Field(
        default=True,
        description=(
            "Pipeline sends block the sender until the receiver has the message, so a "
            "transfer occupies both stages (DeepSpeed's pipe engine). False: sends are "
            "asynchronous and only the receiver waits; the transfer is a delay on the link "
            "(megatron_patch: isend, blocking recv)."
        ),
    )
    tied_allreduce: bool = Field(
        default=False,
        description=(
            "With tied embeddings, the ranks holding the embedding or the LM head all-reduce "
            "the tied gradient in a collective of its own after the segment all-reduces "
            "(megatron_patch). False: not modelled separately (DeepSpeed's ReduceTiedGrads "
            "is inside the measured sync_fixed_s)."
        ),
    )
    loss_allreduce: bool = Field(
        default=False,
        description=(
            "Every iteration ends with an all-reduce of the loss over all ranks, after the "
            "optimizer step (megatron_patch; it is also the iteration's barrier). False: "
            "not modelled (DeepSpeed reports the loss without a collective in the step)."
        ),
    )
    mixed_precision: Literal["autocast", "fp16_optimizer"] = Field(
        default="autocast",
        description=(
            "How the framework runs a 16-bit plan (Plan.precision bf16 or fp16). 'autocast' "
            "(megatron_patch, the engine that runs Sailor's jobs): fp32 weights, gradients "
            "and optimizer state, gradients all-reduced in fp32, and each in-flight "
            "microbatch keeps a compute-dtype copy of the stage's weights "
            "(schemas.precision). 'fp16_optimizer' (DeepSpeed's FP16_Optimizer, the "
            "framework of the reference plans): 16-bit weights and gradients, gradients "
            "all-reduced in 16 bits, an fp32 master copy, no per-microbatch copies."
        ),
    )

    @field_validator("gpus")
    @classmethod
    def _unique(cls, v: tuple[GPUCalibration, ...]) -> tuple[GPUCalibration, ...]:
        seen: set[str] = set()
        for c in v:
            if c.gpu_type in seen or c.gpu_type == "*":
                raise field_error("gpus", c.gpu_type, "duplicate or wildcard GPU type")
            seen.add(c.gpu_type)
        return v

    def for_gpu(self, gpu_type: str) -> GPUCalibration:
        """Constants of ``gpu_type``; a CPU kind without its own takes the ``cpu`` entry's
        (``schemas.device_kind``); else the default."""
        for name in dict.fromkeys((gpu_type, catalog_type(gpu_type))):
            for c in self.gpus:
                if c.gpu_type == name:
                    return c
        return self.default

    def is_calibrated(self, gpu_type: str) -> bool:
        """Whether ``gpu_type`` has constants of its own (or, a CPU kind, the ``cpu`` entry)."""
        names = {gpu_type, catalog_type(gpu_type)}
        return any(c.gpu_type in names for c in self.gpus)

    def with_gpu(self, cal: GPUCalibration) -> Calibration:
        """A copy with ``cal`` replacing any entry of its GPU type."""
        rest = tuple(c for c in self.gpus if c.gpu_type != cal.gpu_type)
        return self.model_copy(update={"gpus": (*rest, cal)})
