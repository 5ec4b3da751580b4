"""The simulator's answer for one plan: time, memory and cost, each with its breakdown."""

from __future__ import annotations

from pydantic import Field

from sailor.schemas._base import Frozen

__all__ = [
    "CornerFigures",
    "Estimate",
    "EstimateInterval",
    "Interval",
    "MemoryBreakdown",
    "StageTime",
    "TimeBreakdown",
]


class TimeBreakdown(Frozen):
    """Where an iteration's time goes (seconds, on the critical path)."""

    compute_s: float = Field(ge=0, description="Forward+backward compute on the critical path.")
    p2p_s: float = Field(ge=0, description="Pipeline activation/gradient transfers not hidden.")
    bubble_s: float = Field(ge=0, description="Pipeline fill and drain idle time.")
    grad_sync_s: float = Field(ge=0, description="Gradient all-reduce time not overlapped.")
    update_s: float = Field(ge=0, description="Optimizer update time.")


class StageTime(Frozen):
    """Per-stage figures of one pipeline."""

    pipeline: int = Field(ge=0, description="Pipeline index.")
    stage: int = Field(ge=0, description="Stage index.")
    fwd_s: float = Field(ge=0, description="Forward time per microbatch.")
    bwd_s: float = Field(ge=0, description="Backward time per microbatch.")
    send_s: float = Field(ge=0, description="Activation send time to the next stage.")
    update_s: float = Field(ge=0, description="Optimizer update time.")
    grad_sync_s: float = Field(ge=0, description="Gradient sync time of this stage's layers.")


class MemoryBreakdown(Frozen):
    """Peak memory of one GPU of one stage, bytes."""

    pipeline: int = Field(ge=0, description="Pipeline index.")
    stage: int = Field(ge=0, description="Stage index.")
    gpu_type: str = Field(description="GPU type.")
    weights: int = Field(
        ge=0,
        description="Weights kept between iterations (fp32, plus a 16-bit copy without autocast).",
    )
    gradients: int = Field(ge=0, description="Gradient buffers.")
    optimizer: int = Field(ge=0, description="Optimizer state.")
    activations: int = Field(ge=0, description="Activations of microbatches in flight (1F1B).")
    weight_copies: int = Field(
        default=0,
        ge=0,
        description="Per microbatch in flight, the compute-dtype copy of the stage's weights "
        "that autocast keeps for backward (0 in fp32 and without autocast), or the profile's "
        "measured per-microbatch bytes if larger.",
    )
    communicators: int = Field(
        default=0,
        ge=0,
        description="GPU memory of the NCCL communicators the GPU's rank holds: their count "
        "(num_communicators) times the calibration's bytes per communicator.",
    )
    num_communicators: int = Field(
        default=0, ge=0, description="NCCL communicators the GPU's rank holds (0: not counted)."
    )
    overhead: int = Field(ge=0, description="Framework/runtime overhead and transient buffers.")
    total: int = Field(ge=0, description="Sum: the predicted peak.")
    capacity: int = Field(ge=0, description="Device memory of the GPU type.")

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity


class Estimate(Frozen):
    """Simulated figures of one plan."""

    iteration_time_s: float = Field(gt=0, description="Seconds per iteration.")
    throughput_iter_s: float = Field(gt=0, description="Iterations per second.")
    throughput_samples_s: float = Field(gt=0, description="Samples per second.")
    time: TimeBreakdown = Field(description="Breakdown of the critical path.")
    stages: tuple[StageTime, ...] = Field(description="Per-stage figures.")
    memory: tuple[MemoryBreakdown, ...] = Field(description="Peak memory per stage GPU.")
    peak_memory_bytes: int = Field(ge=0, description="Largest memory of any GPU.")
    fits_in_memory: bool = Field(description="Every GPU within its capacity.")
    compute_cost_usd: float = Field(ge=0, description="GPU-time cost per iteration.")
    egress_cost_usd: float = Field(ge=0, description="Cross-zone traffic cost per iteration.")
    cost_per_iter_usd: float = Field(ge=0, description="Total $ per iteration.")
    gpus_by_type_zone: dict[str, int] = Field(description="'<gpu>@<zone>' -> GPUs used.")
    uses_estimates: bool = Field(
        description="Some figure rests on estimated profiles, or on a link the network "
        "profile does not hold (a flat guess by distance)."
    )
    model: str = Field(default="closed_form", description="'closed_form' or 'replay'.")
    notes: tuple[str, ...] = Field(default=(), description="Assumptions and fallbacks used.")


class Interval(Frozen):
    """A figure over the uncertainty set: its least, median-corner and largest value."""

    low: float = Field(description="Least value over the corners.")
    median: float = Field(description="Value in the median corner.")
    high: float = Field(description="Largest value over the corners.")


class CornerFigures(Frozen):
    """The headline figures of one plan in one corner of the uncertainty set."""

    corner: str = Field(description="Corner name (optimistic, median, pessimistic, original).")
    iteration_time_s: float = Field(gt=0, description="Seconds per iteration.")
    throughput_iter_s: float = Field(gt=0, description="Iterations per second.")
    cost_per_iter_usd: float = Field(ge=0, description="$ per iteration.")
    peak_memory_bytes: int = Field(ge=0, description="Largest memory of any GPU.")
    fits_in_memory: bool = Field(description="Every GPU within its capacity in this corner.")


class EstimateInterval(Frozen):
    """A plan's figures over a small deterministic set of corners of the cost model's
    uncertainty (sailor.simulator.uncertainty): each corner's figures, and per figure the
    low / median / high. Fits in memory only if it fits in every corner."""

    corners: tuple[CornerFigures, ...] = Field(description="Figures per corner, in set order.")
    iteration_time_s: Interval = Field(description="Seconds per iteration.")
    throughput_iter_s: Interval = Field(description="Iterations per second.")
    cost_per_iter_usd: Interval = Field(description="$ per iteration.")
    peak_memory_bytes: Interval = Field(description="Largest memory of any GPU, bytes.")
    fits_in_memory: bool = Field(description="Fits at the high end (in every corner).")

    def corner(self, name: str) -> CornerFigures:
        """The figures of corner ``name``."""
        for c in self.corners:
            if c.corner == name:
                return c
        raise KeyError(f"corner={name!r} not in {[c.corner for c in self.corners]}")
