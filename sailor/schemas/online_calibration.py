"""Online calibration records: what workers measure per step, what the controller fits from it.

Three records travel here (docs/runtime.md, "Online calibration"):

* :class:`RankTimings`: one rank's step figures, the medians over its last steps, carried from
  the worker's progress lines through the agent's status record (``AgentStatus.timings``) to
  the controller;
* :class:`OnlineFit`: what the fit (:mod:`sailor.simulator.online_fit`) made of them: a
  :class:`~sailor.schemas.calibration.Calibration`, each fitted constant with its range, and
  how well the running plan's iteration time was predicted before and after;
* :class:`CalibrationRecord` / :class:`CalibrationPointer`: a fit kept in etcd under a version
  (``/sailor/<job>/calibration/versions/<n>``, the pointer at ``calibration/current``), written
  by the leader, read back by the next one.

Pure data: no I/O.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from sailor.schemas._base import Frozen, WireMessage, field_error
from sailor.schemas.calibration import Calibration

__all__ = [
    "FITTED_CONSTANTS",
    "CalibrationPointer",
    "CalibrationRecord",
    "ConstantName",
    "FittedConstant",
    "OnlineFit",
    "RankTimings",
]

ConstantName = Literal[
    "compute_scale", "network_efficiency", "p2p_efficiency", "p2p_fixed_s", "sync_fixed_s"
]
"""A constant the online fit may set."""
FITTED_CONSTANTS: tuple[ConstantName, ...] = (
    "compute_scale",
    "network_efficiency",
    "p2p_efficiency",
    "p2p_fixed_s",
    "sync_fixed_s",
)
"""The constants the online fit may set (the others need measurements a running job lacks)."""


class RankTimings(Frozen):
    """One rank's step figures: medians over its last ``steps`` steps of one generation.

    Measured by the worker (``sailor.megatron_patch``: device-synchronized clock, CUDA events on
    a GPU) and summarized by the agent; a torch-free toy worker may report simulated ones.
    """

    rank: int = Field(ge=0, description="Global rank.")
    steps: int = Field(ge=1, description="Steps the medians are taken over.")
    last_step: int = Field(ge=0, description="Last step included.")
    microbatches: int = Field(default=0, ge=0, description="Microbatches per step on this rank.")
    fwd_s: float = Field(
        ge=0,
        description="Forward compute of one microbatch on this rank's stage, s (its layers and "
        "data reads; pipeline waits excluded).",
    )
    bwd_s: float = Field(ge=0, description="Backward compute of one microbatch, s.")
    p2p_s: float = Field(
        ge=0,
        description="Time per step in pipeline exchanges: transfers and waiting for the "
        "neighbour stages, s.",
    )
    sync_s: float = Field(
        ge=0,
        description="Gradient sync per step (waiting for the other replicas included) and "
        "the iteration's agreement (the loss and the ranks' flags, one world all-reduce), s.",
    )
    optim_s: float = Field(ge=0, description="Optimizer step per step, s.")
    step_s: float = Field(gt=0, description="Whole iteration, s.")
    between_s: float = Field(
        default=0.0,
        ge=0,
        description="The pipeline phase outside the timed forward and backward passes and "
        "the exchanges (compute_s - p2p_s - microbatches x (fwd_s + bwd_s) of each step: "
        "reading the data, the loss, the schedule's own code), s. 0 without compute_s.",
    )
    rest_s: float = Field(
        default=0.0,
        ge=0,
        description="The iteration outside the pipeline, the sync and the optimizer step "
        "(zeroing the gradients): step_s less the "
        "medians of the parts above (microbatches x (fwd_s + bwd_s), between_s, p2p_s, "
        "sync_s, optim_s), so that the parts add up to the median step, s. 0 where a worker "
        "does not report compute_s.",
    )
    compute_spread: float = Field(
        default=0.0,
        ge=0,
        description="Relative step-to-step spread of fwd_s + bwd_s (standard deviation over "
        "the steps / median).",
    )
    sync_spread: float = Field(
        default=0.0, ge=0, description="Relative step-to-step spread of sync_s."
    )
    p2p_spread: float = Field(default=0.0, ge=0, description="Relative spread of p2p_s.")


class FittedConstant(Frozen):
    """One constant of one GPU type as the online fit left it, with the range it rests on."""

    gpu_type: str = Field(min_length=1, description="GPU type (kind) of the constant.")
    name: ConstantName = Field(description="Which GPUCalibration field.")
    value: float = Field(description="Value written into the calibration.")
    low: float = Field(description="Low end of its range (a 95 % interval of the estimate).")
    high: float = Field(description="High end of its range.")
    previous: float = Field(description="Its value in the calibration the fit started from.")
    samples: int = Field(ge=0, description="Ranks or replica groups it rests on.")
    fitted: bool = Field(
        description="False: the measurements did not identify it; value = previous."
    )
    evidence: str = Field(default="", max_length=1000, description="How it was obtained.")

    @model_validator(mode="after")
    def _ordered(self) -> FittedConstant:
        if not self.low <= self.value <= self.high:
            raise field_error("low/value/high", (self.low, self.value, self.high), "unordered")
        return self

    @property
    def relative_uncertainty(self) -> float:
        """Half the range over the value (0 for a point)."""
        return (self.high - self.low) / (2 * abs(self.value)) if self.value else 0.0


class OnlineFit(Frozen):
    """The fitted constants of the running cluster and what they change in the prediction."""

    calibration: Calibration = Field(description="The calibration with the fitted constants.")
    constants: tuple[FittedConstant, ...] = Field(description="Every constant looked at.")
    plan_id: str = Field(default="", description="Running plan the measurements came from.")
    ranks: int = Field(ge=0, description="Ranks whose timings were used.")
    steps: int = Field(ge=0, description="Fewest steps behind any rank's medians.")
    measured_step_s: float = Field(gt=0, description="Measured iteration (median over ranks).")
    predicted_before_s: float = Field(gt=0, description="Running plan under the old calibration.")
    predicted_after_s: float = Field(gt=0, description="Running plan under the fitted one.")
    notes: tuple[str, ...] = Field(default=(), description="What was not fitted, and why.")

    @property
    def error_before(self) -> float:
        """(predicted - measured) / measured under the calibration the fit started from."""
        return self.predicted_before_s / self.measured_step_s - 1.0

    @property
    def error_after(self) -> float:
        return self.predicted_after_s / self.measured_step_s - 1.0

    def constant(self, gpu_type: str, name: str) -> FittedConstant | None:
        for c in self.constants:
            if c.gpu_type == gpu_type and c.name == name:
                return c
        return None


class CalibrationRecord(WireMessage):
    """A fitted calibration kept in etcd (``calibration/versions/<version>``)."""

    version: int = Field(ge=1, description="Version, one more than the last kept.")
    epoch: int = Field(ge=0, description="Leader epoch that wrote it.")
    generation: int = Field(ge=0, description="Generation whose reports it was fitted on.")
    time: float = Field(ge=0, description="Unix time of the fit.")
    fit: OnlineFit = Field(description="The fit.")


class CalibrationPointer(WireMessage):
    """Which calibration version is current (``calibration/current``)."""

    version: int = Field(ge=1, description="Current version.")
    epoch: int = Field(ge=0, description="Leader epoch that wrote it.")
