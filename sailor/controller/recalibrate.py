"""The replan rule of online calibration: reconfigure only when it pays for its downtime.

Once the fitted model (:mod:`sailor.simulator.online_fit`) predicts the running plan at
``running_s`` per iteration and the best plan the planner finds for the same nodes at
``best_s``, switching costs the reconfiguration's downtime ``D`` (measured on this job's past
reconfigurations, else configured) and gains, over the time ``H`` the new layout is expected
to run (the expected time to the next membership change, or the remaining steps if fewer):

    staying does ``H / running_s`` iterations in ``H``; switching ``(H - D) / best_s``.
    Switching wins iff ``H · (1 - best_s / running_s) > D``.

:func:`decide_recalibration` reconfigures iff, with hysteresis:

* ``gain_s = H · improvement > D · (1 + margin)`` (``improvement = 1 - best_s / running_s``);
* ``improvement >= min_improvement`` (a few percent is within what the fit cannot tell);
* ``worst_improvement > 0``: the best plan also beats the running one at every corner of
  the fitted ranges (each kind's compute scale and the pipeline efficiency at either end,
  in every combination: the bet holds across the fit's uncertainty);
* the fit was stable over ``stable_reports`` consecutive reports of this generation;
* the best plan is another layout (not the running plan's pipelines and placement);
* no calibration-driven replan was decided for this generation already: after one, the new
  layout (a new generation) must report before the next.

Each evaluation is a :class:`ReplanDecision` with every number; the controller audits it as
a ``replan_decision`` record and ``sailor audit`` re-checks the ones that reconfigured
(:func:`rule_violations`). Also pure helpers for the inputs: the median downtime of past
reconfigurations from phase records, and the mean time between membership changes of an
availability trace.

Pure: values in, values out; no I/O, no clock.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import Field

from sailor.schemas._base import Frozen

__all__ = [
    "RecalibrationPolicy",
    "ReplanDecision",
    "ReplanInputs",
    "decide_recalibration",
    "expected_downtime",
    "mean_time_between_changes",
    "past_downtimes",
    "rule_violations",
]


class RecalibrationPolicy(Frozen):
    """The thresholds of the rule (``ControllerConfig.online_calibration``)."""

    margin: float = Field(
        default=0.5, ge=0, description="Hysteresis: the gain must exceed downtime x (1 + this)."
    )
    min_improvement: float = Field(
        default=0.05, ge=0, lt=1, description="Least relative iteration-time improvement."
    )
    stable_reports: int = Field(
        default=3, ge=1, description="Consecutive stable fits of a generation needed first."
    )


class ReplanInputs(Frozen):
    """What one evaluation of the rule looks at (every figure is audited)."""

    generation: int = Field(ge=0, description="Generation running.")
    calibration_version: int = Field(ge=1, description="Calibration both plans are priced with.")
    running_plan: str = Field(description="Plan id running.")
    best_plan: str = Field(description="Plan id the planner found best under the calibration.")
    same_layout: bool = Field(
        default=False,
        description="The best plan is the running layout (its id may differ: a plan's id "
        "covers its predicted figures, which the new calibration changes).",
    )
    running_s: float = Field(gt=0, description="Running plan's iteration, fitted model, s.")
    best_s: float = Field(gt=0, description="Best plan's iteration, fitted model, s.")
    measured_s: float | None = Field(
        default=None,
        gt=0,
        description="The running plan's measured iteration (median over ranks), s: beside "
        "running_s, the fitted model's error on the plan it judges. None in older records.",
    )
    worst_improvement: float = Field(
        description="Least 1 - best/running over the corners of the fitted ranges."
    )
    corners: int = Field(
        default=0, ge=0, description="Corners of the fitted ranges priced (besides the point)."
    )
    downtime_s: float = Field(ge=0, description="Expected reconfiguration downtime, s.")
    downtime_source: str = Field(default="", description="Measured (how many) or configured.")
    time_to_change_s: float = Field(gt=0, description="Expected time to the next change, s.")
    remaining_steps: int | None = Field(default=None, ge=0, description="Steps left, if known.")
    stable_reports: int = Field(ge=0, description="Consecutive stable fits of this generation.")
    decided_generation: int = Field(
        default=-1, ge=-1, description="Last generation a recalibration replan was decided in."
    )


class ReplanDecision(ReplanInputs):
    """One evaluation of the rule: its inputs, the derived figures and the verdict."""

    margin: float = Field(ge=0, description="Policy margin used.")
    min_improvement: float = Field(ge=0, description="Policy minimum improvement used.")
    required_stable: int = Field(ge=1, description="Policy stable reports required.")
    horizon_s: float = Field(ge=0, description="Time the new layout is expected to run, s.")
    improvement: float = Field(description="1 - best_s / running_s.")
    gain_s: float = Field(description="horizon_s x improvement: time saved, s.")
    threshold_s: float = Field(ge=0, description="downtime_s x (1 + margin).")
    reconfigure: bool = Field(description="The verdict.")
    reason: str = Field(description="Why, in one line.")


def decide_recalibration(inp: ReplanInputs, policy: RecalibrationPolicy) -> ReplanDecision:
    """Evaluate the rule (module docstring) on ``inp``."""
    horizon = inp.time_to_change_s
    if inp.remaining_steps is not None:
        horizon = min(horizon, inp.remaining_steps * inp.running_s)
    improvement = 1.0 - inp.best_s / inp.running_s
    gain = horizon * improvement
    threshold = inp.downtime_s * (1.0 + policy.margin)
    why = ""
    if inp.same_layout or inp.best_plan == inp.running_plan:
        why = "the best plan is the running layout"
    elif inp.decided_generation >= inp.generation:
        why = f"a recalibration replan was decided in generation {inp.decided_generation}"
    elif inp.stable_reports < policy.stable_reports:
        why = f"fit stable over {inp.stable_reports} report(s), {policy.stable_reports} needed"
    elif improvement < policy.min_improvement:
        why = f"improvement {improvement:.1%} below {policy.min_improvement:.1%}"
    elif inp.worst_improvement <= 0:
        why = f"no gain at a corner of the fitted ranges ({inp.worst_improvement:.1%})"
    elif gain <= threshold:
        why = f"gain {gain:.1f} s over {horizon:.0f} s does not pay {threshold:.1f} s"
    reconfigure = not why
    if reconfigure:
        why = (
            f"gain {gain:.1f} s ({improvement:.1%} over {horizon:.0f} s) > downtime "
            f"{inp.downtime_s:.1f} s x {1 + policy.margin:.2f}"
        )
    return ReplanDecision(
        **inp.model_dump(),
        margin=policy.margin,
        min_improvement=policy.min_improvement,
        required_stable=policy.stable_reports,
        horizon_s=horizon,
        improvement=improvement,
        gain_s=gain,
        threshold_s=threshold,
        reconfigure=reconfigure,
        reason=why,
    )


def rule_violations(record: Mapping[str, Any]) -> list[str]:
    """Why a ``replan_decision`` record that reconfigured does not satisfy the rule by its own
    numbers ([] if it does). The record's figures are re-derived from its inputs, so a record
    edited in one place and not the others fails too."""
    try:
        d = ReplanDecision.model_validate({k: v for k, v in record.items() if k in _FIELDS})
    except ValueError as exc:
        return [f"unreadable: {str(exc).splitlines()[0][:200]}"]
    policy = RecalibrationPolicy(
        margin=d.margin, min_improvement=d.min_improvement, stable_reports=d.required_stable
    )
    again = decide_recalibration(ReplanInputs.model_validate(d.model_dump(include=_INPUTS)), policy)
    out: list[str] = []
    if not again.reconfigure:
        out.append(f"the rule says no: {again.reason}")
    for name in ("horizon_s", "improvement", "gain_s", "threshold_s"):
        mine, derived = float(getattr(d, name)), float(getattr(again, name))
        if abs(mine - derived) > 1e-6 * max(1.0, abs(derived)):
            out.append(f"{name}={mine:.6g} but its inputs give {derived:.6g}")
    return out


_FIELDS = set(ReplanDecision.model_fields)
_INPUTS = set(ReplanInputs.model_fields)


def past_downtimes(phases: Sequence[tuple[str, float]]) -> list[float]:
    """Downtimes of past reconfigurations from (phase, time) records in time order: from the
    moment training stopped (``checkpoint``: every node at the stop step; or ``teardown``
    after an abort) to the next ``running``. First launches are not reconfigurations."""
    out: list[float] = []
    stopped: float | None = None
    for phase, t in phases:
        if phase in ("checkpoint", "teardown") and stopped is None:
            stopped = t
        elif phase == "running":
            if stopped is not None:
                out.append(max(0.0, t - stopped))
            stopped = None
        elif phase == "idle":
            stopped = None
    return out


def expected_downtime(
    phases: Sequence[tuple[str, float]], default_s: float, last: int = 5
) -> tuple[float, str]:
    """The median of the last ``last`` measured downtimes, else ``default_s``; and its source."""
    seen = past_downtimes(phases)[-last:]
    if not seen:
        return default_s, "configured default"
    return statistics.median(seen), f"median of {len(seen)} measured reconfiguration(s)"


def mean_time_between_changes(trace: Sequence[tuple[float, int]]) -> float:
    """Mean seconds between changes of the available count in an availability trace of
    (time s, count) samples (the reference's ``traces/*.json``: ``{"Time", "GPUs"}``); the
    trace's whole span when nothing changes. Raises on fewer than two samples."""
    if len(trace) < 2:
        raise ValueError(f"trace has {len(trace)} sample(s): need at least two")
    pts = sorted(trace)
    span = pts[-1][0] - pts[0][0]
    if span <= 0:
        raise ValueError("trace spans no time")
    changes = sum(1 for (_, a), (_, b) in itertools.pairwise(pts) if a != b)
    return span / changes if changes else span
