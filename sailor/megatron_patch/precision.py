"""The compute precision of a rank and the fp16 dynamic loss scaler.

``fp32``: no autocast (CPU, and the exactness tests). ``bf16``: autocast bf16 with fp32
master weights, gradients and optimizer state (as Megatron with ``--bf16``): no loss
scaling. ``fp16``: autocast fp16 with fp32 master weights and dynamic loss scaling (as
Megatron's ``DynamicGradScaler``): the loss is multiplied by the scale before backward; a
step whose gradients hold an inf or nan on ANY rank is skipped by EVERY rank (one all-reduce
MAX of the overflow flag over the world) and the scale is halved; after ``growth_interval``
good steps in a row it doubles.

bf16 is never forced on a GPU without it: :func:`pick_precision` falls back to fp16 (the
catalog's V100, T4, Titan-RTX and RTX-2080 have no bf16).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from sailor import catalog
from sailor.comm import api as comm
from sailor.megatron_patch.clock import synchronize
from sailor.megatron_patch.step_agreement import local_nonfinite
from sailor.schemas.device_kind import is_cpu_type
from sailor.schemas.model import ModelSpec
from sailor.schemas.plan import Plan
from sailor.schemas.precision import Precision, cannot_run

__all__ = [
    "LossScaler",
    "Precision",
    "autocast_of",
    "check_state_precision",
    "compute_dtype",
    "device_precision",
    "job_precision",
    "native_bf16",
    "pick_precision",
    "plan_precision",
    "scaled_step",
]

_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


def pick_precision(device_type: str, bf16_supported: bool) -> Precision:
    """fp32 off CUDA; bf16 on a GPU that has it, else fp16 (pure)."""
    if device_type != "cuda":
        return "fp32"
    return "bf16" if bf16_supported else "fp16"


def native_bf16() -> bool:
    """Whether the current CUDA device computes bf16 in hardware (Ampere and later). Not
    ``torch.cuda.is_bf16_supported()``'s default, which also says yes where bf16 is only
    emulated (a V100 or T4 can hold bf16 tensors, at a fraction of fp16's speed)."""
    return bool(torch.cuda.is_bf16_supported(including_emulation=False))


def device_precision(device: torch.device) -> Precision:
    """:func:`pick_precision` for this process's ``device``."""
    bf16 = device.type == "cuda" and native_bf16()
    return pick_precision(device.type, bf16)


def plan_precision(plan: Plan, spec: ModelSpec, requested: str = "auto") -> Precision:
    """The precision the GPU ranks of ``plan`` run, from the plan and the training config
    alone: every rank decides the same, before any collective (a refusal on some ranks only
    would leave the others waiting in their first collective until the agent aborts them).

    ``requested`` (the training config's ``precision``) unless ``'auto'``, else the plan's
    (recorded, else derived from its GPU types and the spec's request). Refused, naming the
    field and the value: a recorded ``plan.precision`` other than a forced ``requested`` (a
    job keeps one precision: the controller plans in the config's), and a GPU type of the
    plan that cannot run the precision (bf16 on a type without bf16 units, by the catalog).
    CPU kinds compute in fp32 whatever the plan says, as before.
    """
    if requested not in ("auto", *_DTYPES):
        raise ValueError(f"precision={requested!r}: one of auto, {', '.join(_DTYPES)}")
    if requested != "auto" and plan.precision is not None and plan.precision != requested:
        raise ValueError(
            f"plan.precision={plan.precision!r}: the training config's precision="
            f"{requested!r} is the job's (a job keeps one precision; the controller plans in "
            "it): plan in it, or set allow_precision_change: true to change the job's"
        )
    specs = catalog.gpus()
    chosen: Precision = (
        plan.resolved_precision(specs, spec.precision) if requested == "auto" else requested  # type: ignore[assignment]
    )
    for pi, p in enumerate(plan.pipelines):
        for si, s in enumerate(p.stages):
            g = s.replica.gpu_type
            why = "" if is_cpu_type(g) else cannot_run(g, specs, chosen)
            if why:
                raise ValueError(
                    f"plan.pipelines[{pi}].stages[{si}].replica.gpu_type={g!r}: cannot run "
                    f"the job's precision={chosen!r}: {why}; plan without it, or run the "
                    "job in fp16"
                )
    return chosen


def job_precision(
    plan: Plan, spec: ModelSpec, device: torch.device, requested: str = "auto"
) -> Precision:
    """The precision a rank of ``plan`` runs: :func:`plan_precision` (checked on every
    device, before any collective) on a GPU; fp32 on a CPU device (a GPU plan run on gloo
    for a test computes in fp32). bf16 on a GPU without it is refused."""
    chosen = plan_precision(plan, spec, requested)
    if device.type != "cuda":
        return "fp32"
    if chosen == "bf16" and not native_bf16():
        name = torch.cuda.get_device_name(device)
        raise ValueError(
            f"plan precision='bf16': {device} ({name}) has no bf16; plan it as fp16 "
            "(a GPU type without bf16 in the catalog) or set the plan's precision to fp16"
        )
    return chosen


def check_state_precision(saved: object, current: str, allow_change: bool) -> None:
    """Refuse a state (a checkpoint, live holders) trained in another precision than the run
    that loads it (pure): a bf16 model resumed in fp16 overflows where it did not; the reverse
    changes the numerics silently. ``saved`` None (a state saved before the precision was
    recorded) is taken as this run's; ``allow_change`` (the training config's
    ``allow_precision_change``) lets any through. Sailor's engine and the DeepSpeed adapter
    raise the same error."""
    if saved is not None and saved != current and not allow_change:
        raise ValueError(
            f"precision={saved!r} of the state being loaded (checkpoint or live holders) "
            f"differs from this run's precision={current!r}: a job keeps one "
            "precision; resume with the training config's precision set to "
            f"{saved!r}, or set allow_precision_change: true to change it"
        )


def compute_dtype(precision: Precision) -> torch.dtype:
    """The dtype of activations (and of the pipeline's wire) under ``precision``."""
    return _DTYPES[precision]


def autocast_of(
    precision: Precision, device: torch.device
) -> Callable[[], AbstractContextManager[Any]] | None:
    """A factory of the autocast context for ``precision`` (None for fp32)."""
    if precision == "fp32":
        return None
    dtype = _DTYPES[precision]

    def ctx() -> AbstractContextManager[Any]:
        return torch.autocast(device_type=device.type, dtype=dtype)

    return ctx


@dataclass
class LossScaler:
    """Dynamic loss scale of an fp16 run (every rank holds the same state)."""

    scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 1000
    min_scale: float = 1.0
    good_steps: int = 0
    skipped_steps: int = 0

    def __post_init__(self) -> None:
        if not (self.scale > 0 and self.growth_factor > 1 and 0 < self.backoff_factor < 1):
            raise ValueError(
                f"LossScaler(scale={self.scale}, growth_factor={self.growth_factor}, "
                f"backoff_factor={self.backoff_factor}) is invalid"
            )
        if self.growth_interval < 1:
            raise ValueError(f"growth_interval={self.growth_interval} must be >= 1")

    def state(self) -> dict[str, float | int]:
        """What a checkpoint keeps of the scale (the settings come from the config)."""
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Continue from a :meth:`state` (a checkpoint's, or a live holder's)."""
        scale, good = float(state["scale"]), int(state["good_steps"])
        if not (scale > 0 and math.isfinite(scale)) or good < 0:
            raise ValueError(f"loss scale state {dict(state)!r}: need scale > 0, good_steps >= 0")
        self.scale, self.good_steps = scale, good

    def update(self, overflow: bool) -> None:
        """Apply one step's agreed outcome to the scale (pure state change)."""
        if overflow:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.good_steps = 0
            self.skipped_steps += 1
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

    @staticmethod
    @torch.no_grad()
    def local_overflow(params: Iterable[torch.nn.Parameter], device: torch.device) -> torch.Tensor:
        """1.0 on ``device`` if any local gradient holds an inf or nan, else 0.0 (no sync)."""
        grads = [p.grad for p in params if p.grad is not None]
        return local_nonfinite(grads, device).to(torch.float32).reshape(1)

    @staticmethod
    def agree_overflow(flag: torch.Tensor, group: Any = None) -> bool:
        """True on every rank if any rank's flag is set (all-reduce MAX over ``group``)."""
        comm.all_reduce(flag, op="max", group=group)
        synchronize(flag.device)  # abortable where the host waits (in-place workers)
        return bool(flag.item() > 0)

    @staticmethod
    @torch.no_grad()
    def unscale_(params: Iterable[torch.nn.Parameter], scale: float) -> None:
        """Divide every gradient by ``scale`` in place."""
        inv = 1.0 / scale
        for p in params:
            if p.grad is not None:
                p.grad.mul_(inv)


def scaled_step(
    optimizer: torch.optim.Optimizer,
    params: list[torch.nn.Parameter],
    scaler: LossScaler,
    device: torch.device,
    *,
    group: Any = None,
    before_step: Callable[[], None] | None = None,
    overflow: bool | None = None,
) -> bool:
    """One fp16 optimizer step: skipped by every rank if any rank overflowed.

    Gradients hold ``loss * scaler.scale``; they are unscaled before a step that is taken,
    then ``before_step`` runs (gradient clipping sees true gradients).
    Returns whether the step was taken. ``overflow``: agreed already (the engine's
    iteration collective, ``step_agreement``); None: agreed here, collective over ``group``
    (the world by default).
    """
    if overflow is None:
        overflow = scaler.agree_overflow(scaler.local_overflow(params, device), group)
    scale = scaler.scale
    scaler.update(overflow)
    if overflow:
        optimizer.zero_grad(set_to_none=False)
        return False
    scaler.unscale_(params, scale)
    if before_step is not None:
        before_step()
    optimizer.step()
    return True
