"""Per-rank step timings for online calibration: the last steps a worker reported, summarized.

A worker's progress line of each step (``{"event": "step", ...}``) carries what the
controller's fit needs (``fwd_s``/``bwd_s`` per microbatch, ``p2p_s``, ``sync_s``,
``optim_s``, ``step_s``; see ``sailor.megatron_patch.rank_main``). :class:`StepWindow` keeps
the last :data:`WINDOW` of them per rank, skipping the first step after a launch (allocator
warm-up, lazy initialisation), and :meth:`StepWindow.summary` reduces them to one compact
:class:`~sailor.schemas.online_calibration.RankTimings`: medians, and the relative
step-to-step spread (standard deviation over median) of compute, sync and pipeline waits.
The agent puts one per rank in its status record (``AgentStatus.timings``). A line without
those fields (an older worker, the toy trainer without ``--slowness``) adds nothing.

A window holds steps of one speed only: the controller's fit reads its medians as the
cluster's constants, and a window straddling a change of speed would average the old speed
and the new. So the steps before a change are dropped: on the agent's word
(:meth:`StepWindow.restart`, when the node's CPU quota changed), and when the window sees one
itself (:data:`SHIFT_RUN` steps in a row whose step time or compute lies beyond
:data:`SHIFT_RATIO` of the earlier steps' median, all on one side: a neighbour that slowed
down, which this node learns of only through its waits).

Pure: no I/O, no clock.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeGuard

from sailor.schemas.online_calibration import RankTimings

__all__ = [
    "MAX_MICROBATCHES",
    "MAX_TIME_S",
    "SHIFT_RATIO",
    "SHIFT_RUN",
    "SKIP_FIRST",
    "WINDOW",
    "StepSample",
    "StepWindow",
    "bad_timing",
    "sample_of",
]

WINDOW = 16
"""Steps a summary spans: enough for a median that one slow step does not move, short enough
that a change of speed shows within a few status writes."""

SKIP_FIRST = 1
"""Steps after a launch not summarized (the first iteration pays one-off start-up costs)."""

SHIFT_RUN = 3
"""Consecutive steps beyond :data:`SHIFT_RATIO` that mark a change of speed."""

SHIFT_RATIO = 1.3
"""How far (as a ratio, either way) from the earlier steps' median a step must lie to count
toward a change of speed. Steps on the 2 shared cores here jitter by 10-20 % (step-to-step
spread of the demo's workers); a quota lowered from 0.5 to 0.2 cores moves them ~2x."""

_FIELDS = ("fwd_s", "bwd_s", "p2p_s", "sync_s", "optim_s", "step_s")


@dataclass(frozen=True)
class StepSample:
    step: int
    microbatches: int
    fwd_s: float
    bwd_s: float
    p2p_s: float
    sync_s: float
    optim_s: float
    step_s: float
    rest_s: float = 0.0
    """step_s - compute_s - sync_s - optim_s (0 without compute_s); the summary's is the
    median step less the medians of its parts."""
    between_s: float = 0.0
    """compute_s - p2p_s - microbatches x (fwd_s + bwd_s) (0 without compute_s)."""


MAX_TIME_S = 1e6
"""A timing above this (11.6 days for one part of one step) is no measurement: refused, as
a negative or non-finite one is. Unbounded, a worker's 1e308 overflowed the summary's sums
to infinity, which the status record refuses: the agent's status loop crashed until the
agent exited."""

MAX_MICROBATCHES = 1_000_000
"""Microbatches per step above this are refused (no plan gives a rank 10^6 microbatches a
step); unbounded, a huge count overflowed the summary's float work."""


def _is_time(v: object) -> TypeGuard[int | float]:
    """A number of seconds from 0 to :data:`MAX_TIME_S` (NaN, infinity, a negative time and
    a bool are not)."""
    return not isinstance(v, bool) and isinstance(v, int | float) and 0 <= v <= MAX_TIME_S


def _is_count(v: object) -> TypeGuard[int]:
    """A microbatch count from 0 to :data:`MAX_MICROBATCHES` (a bool is not)."""
    return not isinstance(v, bool) and isinstance(v, int) and 0 <= v <= MAX_MICROBATCHES


def _number(msg: Mapping[str, object], key: str) -> float | None:
    v = msg.get(key)
    return float(v) if _is_time(v) else None


def bad_timing(msg: Mapping[str, object]) -> str:
    """Why a step line's timing fields cannot be taken, naming the first bad field and its
    value; '' when each one present is fine (an absent or null field is an older worker's,
    or a worker's that times nothing: no error)."""
    for key in (*_FIELDS, "compute_s"):
        v = msg.get(key)
        if v is not None and not _is_time(v):
            return f"{key}={v!r}: a time is a number of seconds from 0 to {MAX_TIME_S:g}"
    mbs = msg.get("microbatches")
    if mbs is not None and not _is_count(mbs):
        return f"microbatches={mbs!r}: a count from 0 to {MAX_MICROBATCHES}"
    return ""


def sample_of(msg: Mapping[str, object]) -> StepSample | None:
    """The timing sample of one step line, or None if it carries no complete timing."""
    vals = {k: _number(msg, k) for k in _FIELDS}
    step, mbs = msg.get("step"), msg.get("microbatches", 0)
    if any(v is None for v in vals.values()) or not isinstance(step, int):
        return None
    if not vals["step_s"] or not _is_count(mbs):
        return None
    compute = _number(msg, "compute_s")
    step_s, sync_s, optim_s = vals["step_s"] or 0.0, vals["sync_s"] or 0.0, vals["optim_s"] or 0.0
    rest = max(0.0, step_s - compute - sync_s - optim_s) if compute is not None else 0.0
    spans = mbs * ((vals["fwd_s"] or 0.0) + (vals["bwd_s"] or 0.0))
    between = max(0.0, compute - (vals["p2p_s"] or 0.0) - spans) if compute is not None else 0.0
    return StepSample(
        step=step,
        microbatches=mbs,
        fwd_s=vals["fwd_s"] or 0.0,
        bwd_s=vals["bwd_s"] or 0.0,
        p2p_s=vals["p2p_s"] or 0.0,
        sync_s=vals["sync_s"] or 0.0,
        optim_s=vals["optim_s"] or 0.0,
        step_s=step_s,
        rest_s=rest,
        between_s=between,
    )


def _step_time(s: StepSample) -> float:
    return s.step_s


def _compute(s: StepSample) -> float:
    return s.fwd_s + s.bwd_s


def _shifted(xs: list[StepSample]) -> bool:
    """The last :data:`SHIFT_RUN` samples all lie beyond :data:`SHIFT_RATIO` of the earlier
    ones' median, on one side, in step time or in compute (at least as many earlier ones)."""
    if len(xs) < 2 * SHIFT_RUN:
        return False
    old, new = xs[:-SHIFT_RUN], xs[-SHIFT_RUN:]
    for pick in (_step_time, _compute):
        mid = statistics.median(pick(s) for s in old)
        if mid <= 0:
            continue
        ratios = [pick(s) / mid for s in new]
        if all(r > SHIFT_RATIO for r in ratios) or all(r * SHIFT_RATIO < 1 for r in ratios):
            return True
    return False


def _spread(xs: list[float]) -> float:
    """Relative spread: sample standard deviation / median (0 if fewer than two or median 0).

    Not the MAD: over the few steps of a short window (3-16) the MAD is mostly much smaller
    than the spread (of 3 values it is the smaller of two deviations), and a fit that reads
    it would claim more certainty than it has; an outlier step widens this one instead."""
    if len(xs) < 2:
        return 0.0
    mid = statistics.median(xs)
    if mid <= 0:
        return 0.0
    return statistics.stdev(xs) / mid


class StepWindow:
    """The last :data:`WINDOW` timing samples of one rank (of one launch)."""

    def __init__(self, rank: int, window: int = WINDOW, skip_first: int = SKIP_FIRST) -> None:
        self.rank = rank
        self.skip_first = skip_first
        self.seen = 0
        self.samples: deque[StepSample] = deque(maxlen=window)
        self.restarts = 0
        """Times steps before a change of speed were dropped."""
        self._summary: RankTimings | None = None  # of the samples as they are now

    def add(self, msg: Mapping[str, object]) -> None:
        """Take one step line (ignored if it carries no timing)."""
        s = sample_of(msg)
        if s is None:
            return
        self.seen += 1
        if self.seen > self.skip_first:
            self.samples.append(s)
            self._summary = None
            if _shifted(list(self.samples)):
                self.restarts += 1
                for _ in range(len(self.samples) - SHIFT_RUN):
                    self.samples.popleft()

    def restart(self) -> None:
        """Drop the steps so far: the speed changed (the next step is kept: the first step
        after a launch is skipped for its one-off costs, not for the speed)."""
        if self.samples:
            self.restarts += 1
        self.samples.clear()
        self._summary = None

    def summary(self) -> RankTimings | None:
        """Medians of the window, or None before the first kept sample (worked out once per
        new sample: the agent's status loop asks every 50 ms)."""
        if self._summary is not None:
            return self._summary
        xs = list(self.samples)
        if not xs:
            return None

        def med(attr: str) -> float:
            return float(statistics.median(getattr(s, attr) for s in xs))

        # the rest: the median step less the medians of its parts, so that the parts the fit
        # reads add up to the step it is compared with (steps of milliseconds on shared cores
        # are skewed: the median of a sum exceeds the sum of the medians by ~5-10 % here)
        m = xs[-1].microbatches
        parts = (
            m * (med("fwd_s") + med("bwd_s"))
            + med("between_s")
            + med("p2p_s")
            + med("sync_s")
            + med("optim_s")
        )
        timed = any(s.rest_s or s.between_s for s in xs)  # compute_s reported
        rest = max(0.0, med("step_s") - parts) if timed else 0.0
        self._summary = RankTimings(
            rank=self.rank,
            steps=len(xs),
            last_step=max(0, xs[-1].step),
            microbatches=xs[-1].microbatches,
            fwd_s=med("fwd_s"),
            bwd_s=med("bwd_s"),
            p2p_s=med("p2p_s"),
            sync_s=med("sync_s"),
            optim_s=med("optim_s"),
            step_s=med("step_s"),
            rest_s=rest,
            between_s=med("between_s"),
            compute_spread=_spread([s.fwd_s + s.bwd_s for s in xs]),
            sync_spread=_spread([s.sync_s for s in xs]),
            p2p_spread=_spread([s.p2p_s for s in xs]),
        )
        return self._summary
