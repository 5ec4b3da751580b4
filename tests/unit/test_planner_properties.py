"""The planner's promises, checked against its own simulator on the measured profiles.

``robust_search`` (docs/planner.md, "Robust planning") returns plans that fit in memory and
meet every constraint in every corner of the uncertainty set; each plan's interval is what
the simulator gives for it; the search is deterministic, and the order of the pool's entries
changes no plan; a returned plan survives a JSON round trip; after a node leaves, a replan
(robust or one corner's) uses only the GPUs that are left, and finds a plan where a search
of the smaller pool finds one. Small pools of
A100-40 and V100-16 nodes in two zones, OPT-350 and GPT-Neo-2.7 (the original artifact's
profiles, network and prices, the built-in calibration).

Needs the original artifact's files (``../shared/reference/sailor``); skipped without them.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest

from sailor.planner import Constraints, replan
from sailor.planner.robust import RobustResult, _key, robust_replan, robust_search
from sailor.schemas import Plan, Pool, PoolEntry
from sailor.simulator import simulate
from sailor.simulator.uncertainty import CORNERS, corners, simulate_corners
from tests.bench_modules import bench_module
from tests.reference_opt350 import REF

pytestmark = pytest.mark.skipif(not REF.is_dir(), reason="reference data not present")

A, B = "us-central1-a", "us-central1-b"

Nodes = dict[tuple[str, str], int]

SCENARIOS: list[tuple[str, str, Nodes, str, Constraints]] = [
    (
        "opt350-cost-mixed",
        "OPT-350",
        {("A100-40", B): 2, ("V100-16", A): 3, ("V100-16", B): 1},
        "cost",
        Constraints(max_cost_per_iter_usd=1.0),
    ),
    (
        "opt350-throughput-a100-cap",
        "OPT-350",
        {("A100-40", A): 1, ("V100-16", A): 1, ("V100-16", B): 3},
        "throughput",
        Constraints(max_gpus_per_type=(("A100-40", 2),)),
    ),
    (
        "opt350-throughput-floor",
        "OPT-350",
        {("A100-40", A): 1, ("A100-40", B): 1, ("V100-16", A): 2},
        "throughput_per_cost",
        Constraints(min_throughput_iter_s=0.02),
    ),
    (
        "neo27-throughput",
        "GPT-Neo-2.7",
        {("A100-40", A): 2, ("V100-16", B): 2},
        "throughput",
        Constraints(),
    ),
]


@cache
def _setup(model: str) -> Any:
    return bench_module("planner_common").load(model)


def _pool(nodes: Nodes) -> Pool:
    return Pool(
        entries=tuple(
            PoolEntry(gpu_type=g, zone=z, nodes=n, gpus_per_node=4)
            for (g, z), n in sorted(nodes.items())
            if n > 0
        )
    )


@cache
def _searched(i: int) -> RobustResult:
    """Scenario ``i``'s search, once per session: the scenario's own test, the determinism
    test's reference (scenario 0) and the pool-order test's sorted pool (scenario 2) share it;
    each of those tests compares it with a fresh search of its own."""
    _, model, nodes, objective, cons = SCENARIOS[i]
    return _search(model, nodes, objective, cons)


def _search(
    model: str, nodes: Nodes, objective: str, cons: Constraints, reverse: bool = False
) -> RobustResult:
    """The robust search of ``nodes``' pool (its entries in reverse with ``reverse``)."""
    s = _setup(model)
    pool = _pool(nodes)
    return robust_search(
        s.model,
        s.profiles,
        Pool(entries=pool.entries[::-1]) if reverse else pool,
        s.network,
        s.prices,
        objective,  # type: ignore[arg-type]
        cons,
        gpu_specs=s.specs,
        calibration=s.calibration,
        risk="robust",
        top_k=3,
    )


def _usd_per_hour(model: str, plan: Plan) -> float:
    prices = _setup(model).prices
    return sum(
        st.replica.tp * prices.gpu_hour(st.replica.gpu_type, st.replica.zone)
        for p in plan.pipelines
        for st in p.stages
    )


def _within(plan: Plan, nodes: Nodes) -> None:
    """Every GPU of ``plan`` is one of ``nodes``' (type, zone): no more than they hold."""
    for key, n in plan.gpus_by_type_zone().items():
        g, _, z = key.partition("@")
        assert n <= 4 * nodes.get((g, z), 0), (key, n, nodes)


def _check_promises(model: str, res: RobustResult, cons: Constraints, nodes: Nodes) -> None:
    s = _setup(model)
    for rp in res.plans:
        assert rp.plan.global_batch_size == s.model.global_batch_size
        _within(rp.plan, nodes)
        figures = simulate_corners(
            rp.plan,
            s.model,
            s.profiles,
            s.network,
            s.prices,
            calibration=res.calibration,
            gpu_specs=s.specs,
        )
        assert list(figures) == list(CORNERS)
        rows = {c.corner: c for c in rp.interval.corners}
        for corner, e in figures.items():
            assert e.fits_in_memory, (corner, rp.rank, e.peak_memory_bytes)
            assert cons.violations(e, _usd_per_hour(model, rp.plan)) == [], (corner, rp.rank)
            # the interval the plan carries is what its simulator says for it
            assert rows[corner].iteration_time_s == pytest.approx(e.iteration_time_s, rel=1e-9)
            assert rows[corner].peak_memory_bytes == e.peak_memory_bytes
            assert rows[corner].fits_in_memory
        # the plan as a file plans the same: its JSON round trip simulates identically
        back = Plan.model_validate_json(rp.plan.model_dump_json())
        median = dict(corners(res.calibration))["median"]
        again = simulate(
            back,
            s.model,
            s.profiles,
            s.network,
            s.prices,
            calibration=median,
            gpu_specs=s.specs,
        )
        assert again == figures["median"]


@pytest.mark.parametrize("case", SCENARIOS, ids=[c[0] for c in SCENARIOS])
def test_robust_plans_keep_their_promises_and_a_replan_stays_in_the_smaller_pool(
    case: tuple[str, str, Nodes, str, Constraints],
) -> None:
    _, model, nodes, _, cons = case
    res = _searched(SCENARIOS.index(case))
    assert res.plans, res.reason
    _check_promises(model, res, cons, nodes)

    # a node the best plan uses leaves: the replans use only what is left
    used = sorted(res.plans[0].plan.gpus_by_type_zone())
    g, _, z = used[0].partition("@")
    fewer = {**nodes, (g, z): nodes[(g, z)] - 1}
    again = robust_replan(res, _pool(fewer))
    # each pool keeps room for a plan: a replan that finds none claims what a search of the
    # smaller pool refutes (the throughput floor's case did: every corner replan's
    # closed-form pick missed the floor in some corner, the search's best met it in all)
    assert again.plans, again.reason
    _check_promises(model, again, cons, fewer)
    for corner in res.searched:
        for rp in replan(res.results[corner], _pool(fewer)).plans:
            _within(rp.plan, fewer)


def test_planning_the_same_input_twice_gives_the_same_plans() -> None:
    _, model, nodes, objective, cons = SCENARIOS[0]
    a = _searched(0)
    b = _search(model, nodes, objective, cons)
    assert [_key(p.plan) for p in a.plans] == [_key(p.plan) for p in b.plans]
    assert [p.plan for p in a.plans] == [p.plan for p in b.plans]
    assert [(p.worst_ratio, p.interval) for p in a.plans] == [
        (p.worst_ratio, p.interval) for p in b.plans
    ]


def test_the_order_of_the_pool_changes_no_plan() -> None:
    _, model, nodes, objective, cons = SCENARIOS[2]
    in_order = _searched(2)  # the search of the pool as _pool orders it (sorted)
    res = _search(model, nodes, objective, cons, reverse=True)
    assert in_order.plans, in_order.reason
    assert res.plans, res.reason
    assert [(_key(p.plan), p.worst_ratio) for p in in_order.plans] == [
        (_key(p.plan), p.worst_ratio) for p in res.plans
    ]
