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

Pure: values in, values out (docs/planner.md, "Robust planning"). The measure it ranks
by (a plan's figures per corner, the minimax-regret order) is ``planner/regret.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

from sailor.planner.allocate import Allocation
from sailor.planner.api import Constraints, Objective, RankedPlan
from sailor.planner.collector import collector_paused
from sailor.planner.judge import SearchResult, explain_candidate
from sailor.planner.moves import moved_layers
from sailor.planner.placement import unplaceable
from sailor.planner.pricing import GpuPricing
from sailor.planner.regret import (
    Row,
    closed_form_figures,
    order_by_regret,
    score_of,
    simulated_figures,
)
from sailor.planner.replan import replan
from sailor.planner.search import Progress, search
from sailor.planner.tables import CostTables
from sailor.planner.template_pool import SearchState
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
from sailor.schemas.precision import Precision
from sailor.simulator import ProfileLookupError, simulate
from sailor.simulator.uncertainty import CORNERS, MEDIAN, corners, interval_of, simulate_corners

__all__ = [
    "RISKS",
    "Risk",
    "RobustPlan",
    "RobustResult",
    "as_ranked",
    "judge_in_corners",
    "robust_replan",
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
    allocation: Allocation | None = None
    """The allocation behind the plan in the search that found it (a replan's warm start)."""
    moved_layer_replicas: int = 0
    """After a replan: layer replicas that move from the plan that ran before."""

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
    """Each searched corner's own search result (a replan's starting point)."""
    calibration: Calibration | None = None
    """The calibration whose corners judged the plans."""
    judges: Mapping[str, SearchState] = field(default_factory=dict)
    """Cost tables of the judged corners no search covers (``optimistic`` under ``robust``),
    for their closed form: built by the search, reused by every replan after it."""

    @property
    def left_out(self) -> tuple[str, ...]:
        """The pool's GPU types left out for the job's precision, with the reason (every
        corner's search leaves out the same)."""
        return next((r.left_out for r in self.results.values()), ())


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
    return simulate_corners(
        plan,
        model,
        profiles,
        network,
        prices,
        calibration=calibration,
        gpu_specs=gpu_specs,
        spot=bool(spot),
        known=known,
    )


@collector_paused
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
    precision: Precision | None = None,
) -> RobustResult:
    """Plans ranked by ``risk`` (see the module docstring); at most ``top_k``.

    ``precision``: the job's, once fixed (:func:`sailor.planner.search.search`): every
    corner prices in it and leaves out the GPU types that cannot run it.

    ``per_corner``: finalists taken from each corner's search (its ranked plans first, then
    the other simulated candidates, feasible in that corner or not).
    """
    if risk not in RISKS:
        raise ValueError(f"risk={risk!r}: use one of {', '.join(RISKS)}")
    cal = calibration or Calibration()
    cons = constraints or Constraints()
    by_name = dict(corners(cal))
    results: dict[str, SearchResult] = {}
    for name in _SEARCHED[risk]:
        results[name] = search(
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
            precision=precision,
        )
    judges = _judges(results, {}, risk, cal, pool)
    out = _rank(
        results,
        risk,
        objective,
        cons,
        cal,
        spot,
        top_k,
        per_corner,
        closed={**{n: r.state for n, r in results.items()}, **judges},
    )
    return replace(out, judges=judges)


def _judges(
    results: Mapping[str, SearchResult],
    have: Mapping[str, SearchState],
    risk: Risk,
    cal: Calibration,
    pool: Pool,
) -> dict[str, SearchState]:
    """Cost tables for the closed form of the judged corners no search covered (``have``
    kept, others built), priced for ``pool``."""
    inp = next(iter(results.values())).state.tables.inputs
    by_name = dict(corners(cal))
    judges = dict(have)
    for name in _JUDGED[risk]:
        if name not in results and name not in judges:
            judges[name] = SearchState(tables=CostTables(replace(inp, calibration=by_name[name])))
    for st in judges.values():
        st.pricing = GpuPricing.of(pool, inp.prices, inp.spot)
    return judges


@collector_paused
def robust_replan(
    previous: RobustResult,
    new_pool: Pool,
    *,
    tolerance: float = 0.02,
    top_k: int = 1,
) -> RobustResult:
    """Plans for ``new_pool`` at ``previous``'s risk level, warm-started from ``previous``.

    Each corner ``previous`` searched is replanned incrementally
    (:func:`sailor.planner.replan.replan`, from the plan that runs now, ``previous``'s best,
    re-priced in that corner); the plans the replans simulate are judged in every corner and
    ranked as :func:`robust_search` ranks (under ``robust``: they must fit and meet every
    constraint in every corner, and the worst ratio to each corner's best decides). Among
    plans within ``tolerance`` of the best ratio, the one that moves the fewest layer
    replicas from the running plan comes first. Regrets are against the candidates the
    replans found.

    A plan's figures in a corner whose replan did not simulate it are first the closed form
    (its allocation priced by that corner's tables, which follows the simulator's schedule
    and prices), and the simulator is asked only for the plans that come out on top: they
    are re-ranked with its figures until every returned plan is simulated in every corner.
    A plan whose stages do not fit by the tables' memory bound is simulated right away.

    When no replanned plan fits and meets the constraints in every corner, the new pool is
    searched afresh (:func:`robust_search` with ``previous``'s inputs): a replan reports no
    feasible plan only when a search finds none either.
    """
    if previous.calibration is None:
        raise ValueError("previous has no calibration: pass a result of robust_search")
    run = previous.plans[0] if previous.plans else None
    running = (run.plan, run.allocation) if run is not None and run.allocation else None
    # the corner replans rank by the closed form and simulate nothing: what comes out on top
    # over the set is simulated below, in every corner
    results = {
        name: replan(
            previous.results[name],
            new_pool,
            tolerance=tolerance,
            running=running,
            top_k=_REPLAN_SHOWN,
            simulate_top=0,
        )
        for name in previous.searched
    }
    some = next(iter(results.values()))
    inp = some.state.tables.inputs
    judges = _judges(results, previous.judges, previous.risk, previous.calibration, new_pool)
    out = _rank(
        results,
        previous.risk,
        previous.objective,
        some.constraints,
        previous.calibration,
        inp.spot,
        top_k,
        _PER_CORNER,
        running=run.plan if run is not None else None,
        tolerance=tolerance,
        closed={**{n: r.state for n, r in results.items()}, **judges},
    )
    if not out.plans:
        # each corner replan hands on its closed-form pick only: when none of them fits and
        # meets the constraints in every corner, a search of the new pool can still find a
        # plan that does (a node left a pool planned under a throughput floor: the corner
        # replans' picks missed the floor in some corner, the search's best met it in all)
        return robust_search(
            inp.model,
            inp.profiles,
            new_pool,
            inp.network,
            inp.prices,
            previous.objective,
            some.constraints,
            gpu_specs=inp.gpu_specs,
            calibration=previous.calibration,
            risk=previous.risk,
            spot=inp.spot,
            top_k=top_k,
            per_corner=_PER_CORNER,
            precision=inp.precision,
        )
    return replace(out, judges=judges)


_PER_CORNER = 4
"""Finalists per corner search (``robust_search``'s default ``per_corner``)."""

_REPLAN_SHOWN = 1
"""Closed-form candidates a corner replan hands to the robust ranking: its best, as when
it simulated its pick. Two per corner found plans 1-2% better in their worst corner at
2,048 GPUs, but the extra plans' construction and closed forms cost more than the two
simulations saved (callgrind, docs/planner.md round 6)."""


def _rank(
    results: Mapping[str, SearchResult],
    risk: Risk,
    objective: Objective,
    cons: Constraints,
    cal: Calibration,
    spot: bool | None,
    top_k: int,
    per_corner: int,
    *,
    closed: Mapping[str, SearchState] | None,
    running: Plan | None = None,
    tolerance: float = 0.0,
) -> RobustResult:
    """Judge the finalists of every corner's search in every corner and rank them by
    ``risk``'s rule; with ``running``, plans within ``tolerance`` of the best ratio are
    ordered by the layer replicas they move from it. A figure no search simulated starts as
    the closed form (``closed``: per corner, the tables it prices with) and only the plans
    ranked first are simulated, until every returned plan is simulated in every corner.
    ``closed=None`` simulates every plan in every corner (the reference the tests compare
    the screening with)."""
    by_name = dict(corners(cal))
    searched = tuple(results)
    judged = _JUDGED[risk]
    some = next(iter(results.values()))
    inp = some.state.tables.inputs
    cands: dict[tuple[object, ...], tuple[Plan, dict[str, Estimate], float, Allocation | None]]
    cands = {}
    explain: dict[tuple[object, ...], tuple[str, ...]] = {}
    for name, res in results.items():
        found = f"found by the {name} corner's search"
        allocs = res.allocations if len(res.allocations) == len(res.plans) else ()
        rows: list[tuple[Plan, Estimate | None, float, tuple[str, ...], Allocation | None]]
        rows = [
            (
                r.plan,
                r.estimate,
                r.cost_per_hour_usd,
                (found, *r.explain),
                allocs[i] if allocs else None,
            )
            for i, r in enumerate(res.plans)
        ]
        # simulated candidates, or (a replan that simulated nothing) closed-form ones
        rows += [
            (
                c.plan,
                c.estimate,
                c.fast.cost_per_hour,
                (found, *res.left_out, *explain_candidate(c, res.upper_bound_iter_s)),
                c.alloc,
            )
            for c in res.candidates
            if c.plan is not None and (c.estimate is not None or not res.plans)
        ]
        for p, e, cph, why, alloc in rows[: 2 * per_corner]:
            k = _key(p)
            if k not in cands:
                cands[k] = (p, {name: e} if e is not None else {}, cph, alloc)
                explain[k] = why
        # a plan another corner's search already chose may be among this search's simulated
        # candidates too: keep its estimate here, so that judging it does not simulate it again
        for p, e, _cph, _why, _alloc in rows:
            hit = cands.get(_key(p))
            if hit is not None and e is not None and name not in hit[1]:
                hit[1][name] = e

    def simulated_in(p: Plan, name: str) -> Estimate:
        return simulate(
            p,
            inp.model,
            inp.profiles,
            inp.network,
            inp.prices,
            calibration=by_name[name],
            gpu_specs=inp.gpu_specs,
            spot=bool(spot),
        )

    moved: dict[int, int] = {}  # id(plan) -> layer replicas moved from ``running``

    def moves_of(p: Plan) -> int:
        hit = moved.get(id(p))
        if hit is None:
            hit = moved[id(p)] = moved_layers(running, p)[1]
        return hit

    moves = moves_of if running is not None else None
    plans: list[Row] = []
    for p, known, cph, alloc in cands.values():
        if unplaceable(p, some.pool) is not None:
            continue  # a corner's infeasible candidate whose groups fit no node
        try:
            figs = {n: simulated_figures(e, cons, cph) for n, e in known.items()}
            for n in by_name:
                if n in figs:
                    continue
                st = closed.get(n) if closed is not None else None
                f = closed_form_figures(alloc, st, cons, cph) if st and alloc else None
                figs[n] = f or simulated_figures(simulated_in(p, n), cons, cph)
        except (ProfileLookupError, KeyError, ValueError):
            continue
        plans.append((p, figs, cph, alloc))
    if not plans:
        reasons = "; ".join(f"{n}: {r.reason}" for n, r in results.items() if r.reason)
        return RobustResult(
            (), reasons or "no plan", risk, objective, searched, 0, dict(results), cal
        )

    while True:
        scored = order_by_regret(plans, judged, objective, by_name, moves, tolerance)
        if not scored:
            break
        # the simulator has the last word: simulate what is ranked first where only the
        # closed form is known, and each corner's best plan there (every ratio is to it: the
        # tables' memory bound counts a rank's world and TP communicators, not its
        # gradient-sync groups, so a plan can fit by it and not by the simulator), and rank
        # again until all of them are simulated
        todo = [(x[3], n) for x in scored[:top_k] for n in by_name if not x[3][1][n].estimate]
        for n in by_name:
            top = max((x[3] for x in scored), key=_scorer(objective, n))
            if not top[1][n].estimate and all(r is not top or m != n for r, m in todo):
                todo.append((top, n))
        if not todo:
            break
        for r, n in todo:
            try:
                r[1][n] = simulated_figures(simulated_in(r[0], n), cons, r[2])
            except (ProfileLookupError, KeyError, ValueError):
                plans = [x for x in plans if x is not r]
                break
        if not plans:
            return RobustResult((), "no plan", risk, objective, searched, 0, dict(results), cal)
    if not scored:
        closest = min(plans, key=lambda r: sum(len(r[1][n].violations) for n in judged))
        broke = "; ".join(
            f"{n}: {', '.join(closest[1][n].violations)}"
            for n in judged
            if closest[1][n].violations
        )
        return RobustResult(
            (),
            f"no candidate fits and meets the constraints in every judged corner "
            f"({', '.join(judged)}); closest: {broke}",
            risk,
            objective,
            searched,
            len(plans),
            dict(results),
            cal,
        )
    out = []
    for i, (_, worst_ratio, rt, (p, figs, cph, alloc), viol) in enumerate(scored[:top_k]):
        ests = {n: f.estimate for n, f in figs.items() if f.estimate is not None}
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
                allocation=alloc,
                moved_layer_replicas=moves(p) if moves is not None else 0,
            )
        )
    return RobustResult(tuple(out), "", risk, objective, searched, len(plans), dict(results), cal)


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


def _scorer(objective: Objective, corner: str) -> Callable[[Row], float]:
    """A row's score in ``corner`` (larger is better: ``regret.score_of``)."""
    return lambda r: score_of(objective, r[1][corner], r[2])
