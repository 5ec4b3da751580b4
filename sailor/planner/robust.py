"""Plans that hold across the cost model's uncertainty: search per corner, judge in every corner.

The cost model does not know its constants on unmeasured hardware, nor every choice a
deployment makes (:mod:`sailor.simulator.uncertainty`: four corners). A plan that is best in
one corner can be poor, out of memory or over budget in another: the point-estimate planner
goes to whatever its constants make cheapest. ``risk`` says what the planner bets on:

* ``optimistic``: search and rank in the optimistic corner only (the old behaviour with the
  most favourable constants);
* ``median``: search and rank in the median corner;
* ``robust`` (default): search in every corner, simulate every finalist in every corner,
  keep the plans that fit in memory and meet every constraint in *every* corner, and rank
  them by their worst case over the set of their score relative to the best kept plan of
  each corner (minimax relative regret): a plan at 0.9 is within 10% of the best plan known
  for whichever corner turns out true. Ties go to the better median-corner score.

Every plan carries its interval (each corner's figures) and its regret against the best kept
plan of each corner. The regret is relative to the candidates the corner searches found, not
to an exhaustive optimum.

Pure: values in, values out (docs/planner.md, "Robust planning").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from sailor.planner.api import Constraints, Objective, RankedPlan
from sailor.planner.search import Progress, SearchResult, explain_candidate, search
from sailor.schemas import (
    Calibration,
    Estimate,
    EstimateInterval,
    GPUSpec,
    ModelSpec,
    NetworkProfile,
    Plan,
    Pool,
    PriceTable,
    ProfileDB,
)
from sailor.simulator import ProfileLookupError, simulate
from sailor.simulator.uncertainty import CORNERS, MEDIAN, corners, interval_of

__all__ = [
    "RISKS",
    "Risk",
    "RobustPlan",
    "RobustResult",
    "as_ranked",
    "judge_in_corners",
    "robust_search",
]

Risk = Literal["optimistic", "median", "robust"]
RISKS: tuple[Risk, ...] = ("optimistic", "median", "robust")

_SEARCHED: dict[str, tuple[str, ...]] = {
    "optimistic": ("optimistic",),
    "median": (MEDIAN,),
    "robust": ("median", "pessimistic", "original"),
}
"""Corners whose search supplies candidates, per risk level."""

_JUDGED: dict[str, tuple[str, ...]] = {
    "optimistic": ("optimistic",),
    "median": (MEDIAN,),
    "robust": CORNERS,
}
"""Corners in which a plan must fit and meet the constraints, per risk level."""


@dataclass(frozen=True)
class RobustPlan:
    """A plan, its figures in every corner, and how far it is from each corner's best."""

    rank: int
    plan: Plan
    estimate: Estimate
    """The median corner's estimate (breakdowns)."""
    interval: EstimateInterval
    regret: dict[str, float]
    """Per corner: 1 - this plan's score / the best kept plan's score in that corner."""
    worst_ratio: float
    """min over the judged corners of score / best score (1.0: best in every corner)."""
    cost_per_hour_usd: float
    violations: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Per corner, the limits it breaks there (empty for returned plans in judged corners)."""
    explain: tuple[str, ...] = ()
    """Which corner's search found it, and that search's account of it."""

    def to_json(self) -> dict[str, object]:
        iv = self.interval
        return {
            "rank": self.rank,
            "worst_ratio": self.worst_ratio,
            "regret": self.regret,
            "interval": iv.model_dump(mode="json"),
            "cost_per_hour_usd": self.cost_per_hour_usd,
            "num_gpus": self.plan.num_gpus,
        }


@dataclass(frozen=True)
class RobustResult:
    """Plans best first (by the risk level's rule), or none with the reason."""

    plans: tuple[RobustPlan, ...]
    reason: str
    risk: Risk
    objective: Objective
    searched: tuple[str, ...]
    candidates: int
    """Distinct plans judged in every corner."""
    results: dict[str, SearchResult]
    """Each searched corner's own search result."""


def _score(objective: Objective, e: Estimate, cost_per_hour: float) -> float:
    """Larger is better, positive: it/s, iterations per $, or it/s per $/h."""
    if objective == "throughput":
        return e.throughput_iter_s
    if objective == "cost":
        return 1.0 / e.cost_per_iter_usd if e.cost_per_iter_usd > 0 else float("inf")
    return e.throughput_iter_s / cost_per_hour if cost_per_hour > 0 else 0.0


def _key(p: Plan) -> tuple[object, ...]:
    """A plan's identity up to pipeline order and id."""
    rows = sorted(
        (
            pl.microbatch_size,
            pl.num_microbatches,
            tuple(
                (s.first_layer, s.last_layer, s.replica.gpu_type, s.replica.tp, s.replica.zone)
                for s in pl.stages
            ),
        )
        for pl in p.pipelines
    )
    return tuple(rows)


def judge_in_corners(
    plan: Plan,
    model: ModelSpec,
    profiles: ProfileDB,
    network: NetworkProfile,
    prices: PriceTable,
    *,
    calibration: Calibration,
    gpu_specs: Mapping[str, GPUSpec],
    spot: bool | None = None,
    known: Mapping[str, Estimate] | None = None,
) -> dict[str, Estimate]:
    """``plan``'s estimate in every corner (closed form); ``known`` ones are reused."""
    out: dict[str, Estimate] = {}
    for name, cal in corners(calibration):
        hit = (known or {}).get(name)
        out[name] = hit or simulate(
            plan,
            model,
            profiles,
            network,
            prices,
            calibration=cal,
            gpu_specs=gpu_specs,
            spot=bool(spot),
        )
    return out


def robust_search(
    model: ModelSpec,
    profiles: ProfileDB,
    pool: Pool,
    network: NetworkProfile,
    prices: PriceTable,
    objective: Objective = "throughput",
    constraints: Constraints | None = None,
    *,
    gpu_specs: Mapping[str, GPUSpec],
    calibration: Calibration | None = None,
    risk: Risk = "robust",
    spot: bool | None = None,
    top_k: int = 5,
    per_corner: int = 4,
    progress: Progress | None = None,
) -> RobustResult:
    """Plans ranked by ``risk`` (see the module docstring); at most ``top_k``.

    ``per_corner``: finalists taken from each corner's search (its ranked plans first, then
    the other simulated candidates, feasible in that corner or not).
    """
    if risk not in RISKS:
        raise ValueError(f"risk={risk!r}: use one of {', '.join(RISKS)}")
    cal = calibration or Calibration()
    cons = constraints or Constraints()
    by_name = dict(corners(cal))
    searched = _SEARCHED[risk]
    judged = _JUDGED[risk]
    results: dict[str, SearchResult] = {}
    cands: dict[tuple[object, ...], tuple[Plan, dict[str, Estimate], float]] = {}
    explain: dict[tuple[object, ...], tuple[str, ...]] = {}
    for name in searched:
        res = search(
            model,
            profiles,
            pool,
            network,
            prices,
            objective,
            cons,
            gpu_specs=gpu_specs,
            calibration=by_name[name],
            spot=spot,
            top_k=per_corner,
            progress=progress,
        )
        results[name] = res
        found = f"found by the {name} corner's search"
        rows = [(r.plan, r.estimate, r.cost_per_hour_usd, (found, *r.explain)) for r in res.plans]
        rows += [
            (
                c.plan,
                c.estimate,
                c.fast.cost_per_hour,
                (found, *explain_candidate(c, res.upper_bound_iter_s)),
            )
            for c in res.candidates
            if c.plan is not None and c.estimate is not None
        ]
        for p, e, cph, why in rows[: 2 * per_corner]:
            k = _key(p)
            if k not in cands:
                cands[k] = (p, {name: e}, cph)
                explain[k] = why
        # a plan another corner's search already chose may be among this search's simulated
        # candidates too: keep its estimate here, so that judging it does not simulate it again
        for p, e, _cph, _why in rows:
            hit = cands.get(_key(p))
            if hit is not None and name not in hit[1]:
                hit[1][name] = e
    plans: list[tuple[Plan, dict[str, Estimate], float]] = []
    for p, known, cph in cands.values():
        try:
            ests = judge_in_corners(
                p,
                model,
                profiles,
                network,
                prices,
                calibration=cal,
                gpu_specs=gpu_specs,
                spot=spot,
                known=known,
            )
        except (ProfileLookupError, KeyError, ValueError):
            continue
        plans.append((p, ests, cph))
    if not plans:
        reasons = "; ".join(f"{n}: {r.reason}" for n, r in results.items() if r.reason)
        return RobustResult((), reasons or "no plan", risk, objective, searched, 0, results)

    def broken(e: Estimate, cph: float) -> tuple[str, ...]:
        v = list(cons.violations(e, cph))
        if not e.fits_in_memory:
            v.append(f"peak memory {e.peak_memory_bytes / 2**30:.2f} GiB exceeds a GPU")
        return tuple(v)

    rows2 = []
    for p, ests, cph in plans:
        viol = {n: broken(e, cph) for n, e in ests.items()}
        rows2.append((p, ests, cph, viol))
    kept = [r for r in rows2 if not any(r[3][n] for n in judged)]
    if not kept:
        closest = min(rows2, key=lambda r: sum(len(r[3][n]) for n in judged))
        broke = "; ".join(f"{n}: {', '.join(closest[3][n])}" for n in judged if closest[3][n])
        return RobustResult(
            (),
            f"no candidate fits and meets the constraints in every judged corner "
            f"({', '.join(judged)}); closest: {broke}",
            risk,
            objective,
            searched,
            len(plans),
            results,
        )
    best = {
        n: max(_score(objective, r[1][n], r[2]) for r in kept) for n in by_name
    }  # best kept plan per corner

    def ratios(r: tuple[Plan, dict[str, Estimate], float, object]) -> dict[str, float]:
        return {n: _score(objective, r[1][n], r[2]) / best[n] for n in by_name}

    scored = []
    for r in kept:
        rt = ratios(r)
        worst_ratio = min(rt[n] for n in judged)
        # robust: the worst judged corner; optimistic/median: their one corner
        scored.append(((worst_ratio, rt[MEDIAN]), worst_ratio, rt, r))
    scored.sort(key=lambda x: x[0], reverse=True)
    out = []
    for i, (_, worst_ratio, rt, (p, ests, cph, viol)) in enumerate(scored[:top_k]):
        out.append(
            RobustPlan(
                rank=i + 1,
                plan=p,
                estimate=ests[MEDIAN],
                interval=interval_of({n: ests[n] for n in CORNERS}),
                regret={n: 1.0 - rt[n] for n in CORNERS},
                worst_ratio=worst_ratio,
                cost_per_hour_usd=cph,
                violations={n: v for n, v in viol.items() if v},
                explain=explain.get(_key(p), ()),
            )
        )
    return RobustResult(tuple(out), "", risk, objective, searched, len(plans), results)


def as_ranked(p: RobustPlan, upper_bound_iter_s: float = 0.0) -> RankedPlan:
    """The plan as the point planner's :class:`RankedPlan` (median-corner figures)."""
    thr = p.estimate.throughput_iter_s
    return RankedPlan(
        rank=p.rank,
        plan=p.plan,
        estimate=p.estimate,
        cost_per_hour_usd=p.cost_per_hour_usd,
        upper_bound_fraction=thr / upper_bound_iter_s if upper_bound_iter_s > 0 else 0.0,
        explain=p.explain,
    )
