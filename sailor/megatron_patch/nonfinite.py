"""Non-finite gradients: detected before every optimizer step, agreed by every rank, skipped
a few times in a row at most, then the run stops with one error that every rank raises alike.

Without it, a bf16 or fp32 run (no loss scaler) put an inf or NaN gradient (a loss spike, a
bad batch, a flaky GPU) straight into AdamW: every weight and moment became NaN and the next
checkpoint saved them. Megatron raises at once (``check_for_nan_in_loss_and_grad``); here, as
the fp16 loss scaler does for an overflow, the update of such an iteration is skipped by every
rank (weights and Adam moments untouched; the step and the data advance; ``skipped_steps``
counts it), and only ``max_skips`` such iterations in a row are tolerated.

Detection (:func:`agree_nonfinite`) is one collective, over the world, in the same order on
every rank: with gradient clipping, the global norm's all-reduce (``clipping``; a non-finite
norm is the signal); without, an all-reduce MAX of a one-element float32 flag on the rank's
device (``precision.LossScaler.agree_overflow``, as the fp16 path does). The decision is the
gradients', never the loss's: a microbatch whose labels are all ignored has a NaN loss and zero
gradients (``vocab_parallel``), and the loss is known on the last stage only.

Under fp16 (a loss scaler) an overflow is normal: the scaler halves the scale and skips, as
Megatron's does, and such skips do not count here. One at the scale's floor
(``min_loss_scale``) does: the scale cannot go lower, so the gradients are non-finite whatever
the scale, which is divergence (:meth:`SkipStreak.observe` with ``at_floor``).

:class:`SkipStreak` is pure; the streak is not checkpointed (a run resumed from a checkpoint
starts a new streak).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from sailor.megatron_patch.precision import LossScaler

__all__ = ["NonFiniteGradientsError", "SkipStreak", "agree_nonfinite", "nonfinite_message"]


class NonFiniteGradientsError(RuntimeError):
    """More iterations in a row had inf or NaN gradients than the run may skip.

    Raised by every rank with the same message (the step and the count are agreed), so the
    controller reads it as the job's failure (the same error on most placed nodes), not a
    node's: a relaunch on other nodes from the same checkpoint meets the same gradients."""


def nonfinite_message(step: int, streak: int, max_skips: int) -> str:
    """The error's text: the same on every rank (no rank, no host, no local value)."""
    return (
        f"non-finite (inf or NaN) gradients at step {step}, {streak} step(s) in a row "
        f"(max_nonfinite_skips={max_skips}): the update was not applied and no weight is "
        "non-finite; training is diverging or the data is bad. Lower the learning rate (or "
        "warm up longer, or clip gradients), or resume from an earlier checkpoint (with "
        "other data past it)"
    )


@dataclass
class SkipStreak:
    """Consecutive iterations whose update every rank skipped for non-finite gradients
    (the same on every rank: it only ever sees agreed outcomes)."""

    max_skips: int
    streak: int = 0

    def __post_init__(self) -> None:
        if self.max_skips < 0:
            raise ValueError(f"max_skips={self.max_skips} must be >= 0")

    def observe(self, step: int, skipped: bool, at_floor: bool = True) -> None:
        """Count one iteration's agreed outcome: ``skipped``, its update skipped for an inf
        or NaN gradient; ``at_floor``, under a loss scaler, the scale was at its minimum (an
        overflow above it is the scaler's business and leaves the streak as it is). Raises
        :class:`NonFiniteGradientsError` on the ``max_skips + 1``-th skip in a row."""
        if not skipped:
            self.streak = 0
            return
        if not at_floor:
            return
        self.streak += 1
        if self.streak > self.max_skips:
            raise NonFiniteGradientsError(nonfinite_message(step, self.streak, self.max_skips))


def agree_nonfinite(
    params: Iterable[torch.nn.Parameter], device: torch.device, norm: float | None = None
) -> bool:
    """Whether any rank's gradient holds an inf or NaN (the same answer on every rank).

    ``norm``: the global gradient norm clipping computed (collective already, and non-finite
    iff some rank's gradient is: ``clipping.clip_by_global_norm``); no further collective then.
    Without it, one all-reduce MAX of a float32 flag on ``device`` over the world: every rank
    must call this at the same point of its iteration."""
    if norm is not None:
        return not math.isfinite(norm)
    return LossScaler.agree_overflow(LossScaler.local_overflow(params, device))
