"""Robust planning (sailor.planner.robust): plans that fit and meet every limit in every
corner of the uncertainty set, ranked by their worst ratio to each corner's best plan."""

from __future__ import annotations

import importlib

import pytest

from sailor import catalog
from sailor.planner import Constraints
from sailor.planner.replan import replan
from sailor.planner.robust import _PER_CORNER, _key, _rank, robust_replan, robust_search
from sailor.schemas import Calibration
from sailor.simulator import simulate
from sailor.simulator.uncertainty import CORNERS, corners
from tests.unit.test_planner_search import make_env, make_pool

ZONE = "us-test1-a"
CAL = Calibration(prior=catalog.calibration().prior, p2p_across_tp="full_copies")
ENV = make_env(
    weights=(0.5, 3.0, 1.0, 1.0, 0.5, 2.0), gbs=64, memory_mb={"fast": 8000, "slow": 6000}
)
POOL = make_pool({("fast", ZONE): 2, ("slow", ZONE): 4})


def _run(risk: str, cons: Constraints | None = None) -> object:
    return robust_search(
        **ENV.kw(),  # type: ignore[arg-type]
        pool=POOL,
        constraints=cons,
        gpu_specs=ENV.specs,
        calibration=CAL,
        risk=risk,  # type: ignore[arg-type]
        top_k=3,
    )


def test_robust_plans_hold_in_every_corner_and_carry_interval_and_regret() -> None:
    res = _run("robust")
    assert res.plans  # type: ignore[attr-defined]
    by = dict(corners(CAL))
    for p in res.plans:  # type: ignore[attr-defined]
        assert p.interval.fits_in_memory
        assert tuple(c.corner for c in p.interval.corners) == CORNERS
        for c in p.interval.corners:  # the interval is the simulator's, corner by corner
            e = simulate(p.plan, **ENV.kw(), calibration=by[c.corner], gpu_specs=ENV.specs)  # type: ignore[arg-type]
            assert e.iteration_time_s == pytest.approx(c.iteration_time_s, rel=1e-12)
        assert all(r >= -1e-12 for r in p.regret.values())
        assert p.worst_ratio == pytest.approx(min(1 - r for r in p.regret.values()))
    ranks = [p.worst_ratio for p in res.plans]  # type: ignore[attr-defined]
    assert ranks == sorted(ranks, reverse=True)
    # the best plan of some corner has no regret there
    for c in CORNERS:
        assert min(p.regret[c] for p in res.plans) >= -1e-12  # type: ignore[attr-defined]


def test_min_throughput_holds_in_the_worst_corner() -> None:
    opt = _run("optimistic")
    best_opt = opt.plans[0].interval.throughput_iter_s  # type: ignore[attr-defined]
    # a floor the optimistic plan meets only in its own corner
    floor = (best_opt.low + best_opt.high) / 2
    res = _run("robust", Constraints(min_throughput_iter_s=floor))
    for p in res.plans:  # type: ignore[attr-defined]
        assert p.interval.throughput_iter_s.low >= floor * (1 - 1e-9)
    if not res.plans:  # type: ignore[attr-defined]
        assert "every judged corner" in res.reason or res.reason  # type: ignore[attr-defined]


def test_each_risk_level_ranks_in_its_corner() -> None:
    for risk in ("optimistic", "median"):
        res = _run(risk)
        corner = risk
        top = res.plans[0]  # type: ignore[attr-defined]
        assert top.regret[corner] == pytest.approx(0.0, abs=1e-12)
        assert res.searched == (corner,)  # type: ignore[attr-defined]


def test_unknown_risk_is_refused() -> None:
    with pytest.raises(ValueError, match="risk="):
        _run("reckless")


def test_robust_replan_holds_in_every_corner_after_a_node_leaves() -> None:
    first = _run("robust")
    smaller = make_pool({("fast", ZONE): 2, ("slow", ZONE): 2})
    res = robust_replan(first, smaller, top_k=3)  # type: ignore[arg-type]
    assert res.plans and res.risk == "robust" and res.searched == first.searched  # type: ignore[attr-defined]
    by = dict(corners(CAL))
    for p in res.plans:
        assert p.plan.num_gpus <= smaller.total_gpus
        assert p.interval.fits_in_memory  # in every corner
        for c in p.interval.corners:  # the simulator's figures, corner by corner
            e = simulate(p.plan, **ENV.kw(), calibration=by[c.corner], gpu_specs=ENV.specs)  # type: ignore[arg-type]
            assert e.iteration_time_s == pytest.approx(c.iteration_time_s, rel=1e-12)
        assert p.worst_ratio == pytest.approx(min(1 - r for r in p.regret.values()))
    # the chain goes on: a replan's result is the next replan's previous
    again = robust_replan(res, make_pool({("fast", ZONE): 2, ("slow", ZONE): 4}))
    assert again.plans and again.plans[0].interval.fits_in_memory


def test_robust_replan_keeps_a_throughput_floor_in_the_worst_corner() -> None:
    opt = _run("optimistic")
    best_opt = opt.plans[0].interval.throughput_iter_s  # type: ignore[attr-defined]
    floor = best_opt.low / 2
    first = _run("robust", Constraints(min_throughput_iter_s=floor))
    res = robust_replan(first, make_pool({("fast", ZONE): 2, ("slow", ZONE): 3}), top_k=3)  # type: ignore[arg-type]
    for p in res.plans:
        assert p.interval.throughput_iter_s.low >= floor * (1 - 1e-9)
        assert not p.violations


def test_median_risk_replan_is_the_median_corner_replan() -> None:
    first = _run("median")
    smaller = make_pool({("fast", ZONE): 2, ("slow", ZONE): 2})
    res = robust_replan(first, smaller)  # type: ignore[arg-type]
    point = replan(first.results["median"], smaller)  # type: ignore[attr-defined]
    assert res.searched == ("median",)
    assert _key(res.plans[0].plan) == _key(point.plans[0].plan)


@pytest.mark.parametrize(
    "counts,floor",
    [((2, 2), False), ((2, 3), False), ((1, 4), False), ((2, 5), False), ((2, 3), True)],
)
def test_robust_replan_ranks_as_the_simulator_would(counts: tuple[int, int], floor: bool) -> None:
    """The replan's closed-form screening (simulate only what comes out on top) picks the
    plans, worst ratios and regrets that simulating every plan in every corner gives."""
    cons = None
    if floor:
        low = _run("optimistic").plans[0].interval.throughput_iter_s.low  # type: ignore[attr-defined]
        cons = Constraints(min_throughput_iter_s=low / 2)
    first = _run("robust", cons)
    pool = make_pool({("fast", ZONE): counts[0], ("slow", ZONE): counts[1]})
    res = robust_replan(first, pool, top_k=3)  # type: ignore[arg-type]
    assert res.judges.keys() == {"optimistic"}  # the one judged corner no search covers
    assert res.judges["optimistic"] is first.judges["optimistic"]  # type: ignore[attr-defined]
    some = next(iter(res.results.values()))
    run = first.plans[0].plan  # type: ignore[attr-defined]
    every = _rank(  # the same replans' plans, each simulated in every corner
        res.results,
        res.risk,
        res.objective,
        some.constraints,
        CAL,
        some.state.tables.inputs.spot,
        3,
        _PER_CORNER,
        closed=None,
        running=run,
        tolerance=0.02,
    )
    assert res.candidates == every.candidates
    assert [_key(p.plan) for p in res.plans] == [_key(p.plan) for p in every.plans]
    for a, b in zip(res.plans, every.plans, strict=True):
        assert a.interval == b.interval
        assert a.worst_ratio == pytest.approx(b.worst_ratio, rel=1e-9)
        assert a.regret == pytest.approx(b.regret, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("floor", [False, True])
def test_robust_search_ranks_as_the_simulator_would(floor: bool) -> None:
    """The search's closed-form screening of the finalists picks the plans, worst ratios and
    regrets that simulating every finalist in every corner gives."""
    cons = None
    if floor:
        low = _run("optimistic").plans[0].interval.throughput_iter_s.low  # type: ignore[attr-defined]
        cons = Constraints(min_throughput_iter_s=low / 2)
    res = _run("robust", cons)
    assert res.judges.keys() == {"optimistic"}  # type: ignore[attr-defined]
    some = next(iter(res.results.values()))  # type: ignore[attr-defined]
    every = _rank(
        res.results,  # type: ignore[attr-defined]
        "robust",
        "throughput",
        some.constraints,
        CAL,
        some.state.tables.inputs.spot,
        3,
        _PER_CORNER,
        closed=None,
    )
    assert res.candidates == every.candidates  # type: ignore[attr-defined]
    assert [_key(p.plan) for p in res.plans] == [_key(p.plan) for p in every.plans]  # type: ignore[attr-defined]
    for a, b in zip(res.plans, every.plans, strict=True):  # type: ignore[attr-defined]
        assert a.interval == b.interval
        assert a.worst_ratio == pytest.approx(b.worst_ratio, rel=1e-9)
        assert a.regret == pytest.approx(b.regret, rel=1e-9, abs=1e-12)


def test_corner_replans_hand_closed_form_candidates_and_only_the_winner_is_simulated(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A robust replan's corner replans simulate nothing: each hands its closed-form ranking
    (the first plans built, none simulated) to the robust ranking, which simulates what
    comes out on top in every corner. With one plan asked for, that is four simulations
    when the first winner holds (six before: one per corner replan, then three)."""
    first = _run("robust")
    smaller = make_pool({("fast", ZONE): 2, ("slow", ZONE): 2})
    calls: list[str] = []
    robust_mod = importlib.import_module("sailor.planner.robust")
    tables_mod = importlib.import_module("sailor.planner.tables")  # Inputs.simulate

    def counted(*a: object, **k: object) -> object:
        calls.append(str(k.get("calibration", "")))
        return simulate(*a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(robust_mod, "simulate", counted)
    monkeypatch.setattr(tables_mod, "simulate", counted)
    res = robust_replan(first, smaller)  # type: ignore[arg-type]
    assert res.plans
    for name, r in res.results.items():
        assert not r.plans, name
        assert "not simulated" in r.reason
        shown = [c for c in r.candidates if c.plan is not None]
        assert shown and all(c.estimate is None for c in r.candidates)
    assert len(calls) % len(CORNERS) == 0 and len(calls) >= len(CORNERS)
    assert len(calls) <= len(CORNERS) * len(res.results)  # re-rankings are bounded


def test_replan_without_simulation_returns_its_closed_form_ranking() -> None:
    first = _run("median")
    smaller = make_pool({("fast", ZONE): 2, ("slow", ZONE): 2})
    prev = first.results["median"]  # type: ignore[attr-defined]
    res = replan(prev, smaller, top_k=2, simulate_top=0)
    assert not res.plans and "not simulated" in res.reason
    assert [c.plan is not None for c in res.candidates[:2]] == [True] * min(2, len(res.candidates))
    assert all(c.estimate is None for c in res.candidates)
    fast = [c.fast.iteration_s for c in res.candidates]
    sim = replan(prev, smaller)  # the same ranking, its best simulated
    assert sim.plans and sim.plans[0].estimate.iteration_time_s == pytest.approx(
        min(fast), rel=0.05
    )


def test_a_replan_chained_off_one_that_simulated_nothing_warm_starts_from_its_best() -> None:
    """A replan of a result without plans (``simulate_top=0``) starts from that result's
    closed-form best, re-runs its recipes and still simulates nothing."""
    first = _run("median")
    prev = first.results["median"]  # type: ignore[attr-defined]
    a = replan(prev, make_pool({("fast", ZONE): 2, ("slow", ZONE): 3}), simulate_top=0)
    assert not a.plans and a.candidates and a.candidates[0].plan is not None
    b = replan(a, make_pool({("fast", ZONE): 2, ("slow", ZONE): 2}), simulate_top=0)
    assert not b.plans and "not simulated" in b.reason
    assert all(c.estimate is None for c in b.candidates)
    c = replan(a, make_pool({("fast", ZONE): 2, ("slow", ZONE): 2}))  # judged as usual
    assert c.plans and c.plans[0].estimate is not None
