"""Non-finite gradients: detected before every optimizer step, agreed by every rank, skipped
a few times in a row at most, then the run stops with one error that every rank raises alike.

Without it, a bf16 or fp32 run (no loss scaler) put an inf or NaN gradient (a loss spike, a
bad batch, a flaky GPU) straight into AdamW: every weight and moment became NaN and the next
checkpoint saved them. Megatron raises at once (``check_for_nan_in_loss_and_grad``); here, as
the fp16 loss scaler does for an overflow, the update of such an iteration is skipped by every
rank (weights and Adam moments untouched; the step and the data advance; ``skipped_steps``
counts it), and only ``max_skips`` such iterations in a row are tolerated.

Detection is the iteration's one collective, over the world, in the same order on every rank
(``step_agreement``): each rank's flag (its own gradients, one fused max-abs pass) in its own
slot of the vector that also carries the loss and, with clipping, the squared norm, so every
rank learns which ranks saw an inf or NaN, and the host reads it with the loss. The decision
is the gradients', never the loss's: a microbatch whose labels are all ignored has a NaN loss
and zero gradients (``vocab_parallel``), and the loss is known on the last stage only.

Under fp16 (a loss scaler) an overflow is normal: the scaler halves the scale and skips, as
Megatron's does, and such skips do not count here. One at the scale's floor
(``min_loss_scale``) does: the scale cannot go lower, so the gradients are non-finite whatever
the scale, which is divergence (:meth:`SkipStreak.observe` with ``at_floor``).

:class:`SkipStreak` is pure; the streak is not checkpointed (a run resumed from a checkpoint
starts a new streak).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["NonFiniteGradientsError", "SkipStreak", "nonfinite_message"]


class NonFiniteGradientsError(RuntimeError):
    """More iterations in a row had inf or NaN gradients than the run may skip.

    Raised by every rank with the same message (the step, the count and where the streak
    began are agreed), so the controller reads it as the job's failure, not a node's: a
    relaunch on other nodes from the same checkpoint meets the same gradients. The message
    names the ranks (and hosts) whose own gradient was non-finite first: a flaky GPU shows
    as the same rank's host in error after error."""


def nonfinite_message(step: int, streak: int, max_skips: int, first_seen: str = "") -> str:
    """The error's text: the same on every rank (no local value; ``first_seen``, the agreed
    step and ranks (with their hosts) where the streak began)."""
    seen = f"; first seen at {first_seen}" if first_seen else ""
    return (
        f"non-finite (inf or NaN) gradients at step {step}, {streak} step(s) in a row "
        f"(max_nonfinite_skips={max_skips}){seen}: the update was not applied and no weight is "
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
    first_step: int = -1
    """The step the streak began at (-1: no streak)."""
    first_ranks: tuple[int, ...] = ()
    """The ranks whose own gradient was non-finite at ``first_step`` (empty: unknown)."""

    def __post_init__(self) -> None:
        if self.max_skips < 0:
            raise ValueError(f"max_skips={self.max_skips} must be >= 0")

    def observe(
        self,
        step: int,
        skipped: bool,
        at_floor: bool = True,
        ranks: tuple[int, ...] = (),
        where: Callable[[tuple[int, ...]], str] | None = None,
    ) -> None:
        """Count one iteration's agreed outcome: ``skipped``, its update skipped for an inf
        or NaN gradient (``ranks``: those whose own gradient was, agreed); ``at_floor``, under
        a loss scaler, the scale was at its minimum (an overflow above it is the scaler's
        business and leaves the streak as it is). Raises :class:`NonFiniteGradientsError`
        on the ``max_skips + 1``-th skip in a row, naming where the streak began: ``where``
        turns its ranks into text (their hosts; called on every rank alike, as the raise is
        agreed: it may be a collective)."""
        if not skipped:
            self.streak, self.first_step, self.first_ranks = 0, -1, ()
            return
        if not at_floor:
            return
        self.streak += 1
        if self.streak == 1:
            self.first_step, self.first_ranks = step, ranks
        if self.streak > self.max_skips:
            first = self.first_ranks
            named = where(first) if where is not None and first else ""
            seen = f"step {self.first_step}" + (f" on {named}" if named else "")
            raise NonFiniteGradientsError(
                nonfinite_message(step, self.streak, self.max_skips, seen)
            )
