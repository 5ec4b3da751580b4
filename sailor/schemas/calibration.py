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

from pydantic import Field, field_validator

from sailor.schemas._base import Frozen, field_error

__all__ = [
    "DEFAULT_MEMORY_OVERHEAD_BYTES",
    "Calibration",
    "GPUCalibration",
]

DEFAULT_MEMORY_OVERHEAD_BYTES = 1 << 30
"""1 GiB of non-tensor memory per training process when nothing was measured: the CUDA
context with its loaded kernel modules (~0.3-0.5 GiB on Ampere/Hopper with lazy loading),
cuBLAS/cuDNN workspaces and NCCL communicator buffers (a few MiB per channel and peer)."""


class GPUCalibration(Frozen):
    """Constants for one GPU type (``gpu_type='*'`` for the default)."""

    gpu_type: str = Field(description="GPU type these constants belong to; '*' = default.")
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
    source: str = Field(
        default="default: physically motivated, not fitted (docs/simulator-model.md)",
        description="Measurements these constants were derived from.",
    )


class Calibration(Frozen):
    """All calibration constants the simulator uses, per GPU type, with a default."""

    gpus: tuple[GPUCalibration, ...] = Field(
        default=(), description="Calibrated GPU types (at most one entry per type)."
    )
    default: GPUCalibration = Field(
        default_factory=lambda: GPUCalibration(gpu_type="*"),
        description="Constants for GPU types without an entry.",
    )
    sends_attention_mask: bool = Field(
        default=True,
        description=(
            "The pipeline engine sends the causal attention mask (seq x seq, 2 bytes per "
            "element, not split over TP) with every forward activation. True for "
            "Megatron-DeepSpeed's GPT pipeline model, the framework the reference plans ran on."
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
        """Constants of ``gpu_type``, or the default when it has none."""
        for c in self.gpus:
            if c.gpu_type == gpu_type:
                return c
        return self.default

    def is_calibrated(self, gpu_type: str) -> bool:
        return any(c.gpu_type == gpu_type for c in self.gpus)

    def with_gpu(self, cal: GPUCalibration) -> Calibration:
        """A copy with ``cal`` replacing any entry of its GPU type."""
        rest = tuple(c for c in self.gpus if c.gpu_type != cal.gpu_type)
        return self.model_copy(update={"gpus": (*rest, cal)})
