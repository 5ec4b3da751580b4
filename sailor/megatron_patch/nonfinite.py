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

:class:`SkipStreak` is pure. The streak is part of the trainer state a checkpoint (and an
in-place relayout) carries (:meth:`SkipStreak.state`, in ``Trainer.scaling_state``): a save
at a step inside a streak, then a resume from it (after an abort for any reason, a
preemption), continues the streak, so the error still comes after ``max_skips`` skips in
all and names the step (and ranks, with their hosts) where the streak began. Before, the
resumed run counted from 0, past the streak's first step, and the controller's "trained
past the failure" reset the job's count too: the skips were unlimited. A save inside a
streak is not refused: a skipped update never touched the weights or the moments, so the
checkpoint holds the last good ones, with the streak that says how the run got there. A
checkpoint written without it resumes at 0, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

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
    first_where: str = ""
    """Those ranks with their hosts, named when the streak began (''): a resumed run's ranks
    may be other hosts, so the text is kept, not worked out again at the raise."""

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
        turns its ranks into text (their hosts), once, where a streak begins (called on every
        rank alike, as the outcome is agreed: it may be a collective)."""
        if not skipped:
            self.streak, self.first_step, self.first_ranks, self.first_where = 0, -1, (), ""
            return
        if not at_floor:
            return
        self.streak += 1
        if self.streak == 1:
            self.first_step, self.first_ranks = step, ranks
            self.first_where = where(ranks) if where is not None and ranks else ""
        if self.streak > self.max_skips:
            named = self.first_where
            seen = f"step {self.first_step}" + (f" on {named}" if named else "")
            raise NonFiniteGradientsError(
                nonfinite_message(step, self.streak, self.max_skips, seen)
            )

    def state(self) -> dict[str, Any]:
        """What a checkpoint carries (JSON): the streak, where it began; ``{}`` without one."""
        if self.streak == 0:
            return {}
        return {
            "streak": self.streak,
            "first_step": self.first_step,
            "first_ranks": list(self.first_ranks),
            "first_where": self.first_where,
        }

    def load_state(self, state: Mapping[str, Any] | None) -> None:
        """Continue a :meth:`state` (None or ``{}``: no streak, as a checkpoint written
        before the streak was kept)."""
        state = state or {}
        streak, first = int(state.get("streak", 0)), int(state.get("first_step", -1))
        if streak < 0 or (streak > 0) != (first >= 0):
            raise ValueError(f"non-finite streak {dict(state)}: a streak names its first step")
        self.streak, self.first_step = streak, first
        self.first_ranks = tuple(int(r) for r in state.get("first_ranks", ()))
        self.first_where = str(state.get("first_where", ""))
