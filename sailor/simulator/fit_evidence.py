"""What the online fit (:mod:`sailor.simulator.online_fit`) reads, and how sure it is of a
constant.

Each reporting rank's timings at its place in the running plan (:class:`RankEvidence`), the
simulated stage rows they are compared with, the spread over ranks (:func:`robust_spread`:
1.4826 x MAD) and the 95 % interval of a median over ranks (the spread between ranks and each
rank's step-to-step spread, Student's t for the fewer degrees of freedom), and the record of a
constant the measurements do not identify (kept at its value); and the floor of a fitted
efficiency. Shared by every constant's fit (:mod:`online_fit`, :mod:`fit_p2p`,
:mod:`fit_sync`).

Pure: values in, values out; no I/O, no clock.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from sailor.schemas import Estimate, Plan, StageTime
from sailor.schemas.online_calibration import ConstantName, FittedConstant, RankTimings

__all__ = [
    "ETA_MIN",
    "MEDIAN_SE",
    "RankEvidence",
    "evidence_ranks",
    "kept_constant",
    "median_interval",
    "robust_spread",
    "stage_rows",
    "t975",
]

_MAD_TO_SIGMA = 1.4826
"""MAD x this = the standard deviation of a normal sample."""


MEDIAN_SE = 1.2533
"""Standard error of a median over n normal samples: this x sigma / sqrt(n)."""


ETA_MIN = 0.01


@dataclass(frozen=True)
class RankEvidence:
    rank: int
    pipeline: int
    stage: int
    gpu_type: str
    m: int
    t: RankTimings


def robust_spread(xs: Sequence[float]) -> float:
    """1.4826 x the median absolute deviation of ``xs`` (0 for fewer than two)."""
    if len(xs) < 2:
        return 0.0
    mid = statistics.median(xs)
    return _MAD_TO_SIGMA * statistics.median(abs(x - mid) for x in xs)


def stage_rows(est: Estimate) -> dict[tuple[int, int], StageTime]:
    return {(s.pipeline, s.stage): s for s in est.stages}


def evidence_ranks(
    plan: Plan, timings: Sequence[RankTimings]
) -> tuple[list[RankEvidence], list[str]]:
    order = plan.ranks()
    out: list[RankEvidence] = []
    notes: list[str] = []
    seen: set[int] = set()
    for t in sorted(timings, key=lambda x: x.rank):
        if t.rank >= len(order) or t.rank in seen:
            notes.append(f"rank {t.rank}: not a rank of plan {plan.plan_id} (ignored)")
            continue
        seen.add(t.rank)
        pi, si, _ = order[t.rank]
        p = plan.pipelines[pi]
        out.append(
            RankEvidence(t.rank, pi, si, p.stages[si].replica.gpu_type, p.num_microbatches, t)
        )
    return out, notes


_T975 = (
    (1, 12.71),
    (2, 4.30),
    (3, 3.18),
    (4, 2.78),
    (5, 2.57),
    (6, 2.45),
    (8, 2.31),
    (10, 2.23),
    (15, 2.13),
    (20, 2.09),
    (30, 2.04),
)
"""Student's t 97.5 % quantiles by degrees of freedom (two-sided 95 %)."""


def t975(dof: int) -> float:
    """The t quantile of the largest tabled ``dof`` not above it (conservative); 1.96 above 30."""
    if dof > 30:
        return 1.96
    t = _T975[0][1]
    for d, q in _T975:
        if dof >= d:
            t = q
    return t


def median_interval(
    value: float, between: float, n: int, within_rel: Sequence[float], steps: int
) -> tuple[float, float, float]:
    """(standard error, low, high) of a median ``value`` of ``n`` ranks: the spread between
    ranks over √n and the ranks' own step-to-step spread over √(all steps); the range is a
    95 % interval with Student's t for the fewer degrees of freedom of the two (a spread
    taken from three steps is itself uncertain)."""
    se_between = between / math.sqrt(n) if n > 1 else 0.0
    rms = math.sqrt(statistics.fmean(w * w for w in within_rel)) if within_rel else 0.0
    se_within = MEDIAN_SE * abs(value) * rms / math.sqrt(max(steps, 1))
    se = math.hypot(se_between, se_within)
    dofs = [d for d, e in ((n - 1, se_between), (steps - n, se_within)) if e > 0]
    k = t975(max(1, min(dofs))) if dofs else 2.0
    return se, value - k * se, value + k * se


def kept_constant(
    g: str, name: ConstantName, value: float, why: str, samples: int = 0
) -> FittedConstant:
    return FittedConstant(
        gpu_type=g,
        name=name,
        value=value,
        low=value,
        high=value,
        previous=value,
        samples=samples,
        fitted=False,
        evidence=why[:1000],
    )
