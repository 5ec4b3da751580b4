"""Pipelines that span zones, and GPUs priced by their pool entry's spot flag."""

from __future__ import annotations

import pytest

from sailor.planner import Constraints, search
from sailor.planner.pricing import GpuPricing
from sailor.schemas import (
    EgressPrice,
    Pipeline,
    Plan,
    Pool,
    PoolEntry,
    ReplicaGroup,
    Stage,
)
from sailor.simulator import simulate
from tests.unit.test_planner_search import check_claims, make_env, make_pool

Z1, Z2 = "us-test1-a", "us-test1-b"


def _two_stage_env(**kw: object):  # type: ignore[no-untyped-def]
    """A model that fits on two stages of 'fast' but not on one (275 MB GPUs)."""
    return make_env(zones=(Z1, Z2), memory_mb={"fast": 275, "slow": 275}, gpus_per_node=1, **kw)


def test_a_model_that_needs_two_stages_spans_two_zones_of_one_node_each() -> None:
    env = _two_stage_env()
    pool = make_pool({("fast", Z1): 1, ("fast", Z2): 1}, gpus_per_node=1)
    for z in (Z1, Z2):  # neither zone alone can hold it
        alone = search(
            **env.kw(), pool=pool, constraints=Constraints(allowed_zones=(z,)), gpu_specs=env.specs
        )
        assert not alone.plans and "fits on no stage" in alone.reason
    res = search(**env.kw(), pool=pool, gpu_specs=env.specs)
    assert res.plans, res.reason
    best = res.plans[0]
    (pipe,) = best.plan.pipelines
    assert {s.replica.zone for s in pipe.stages} == {Z1, Z2}
    assert best.estimate.egress_cost_usd > 0
    check_claims(env, res.plans, Constraints())


def test_cross_zone_hop_pays_egress_both_ways_as_the_simulator_charges() -> None:
    cheap = _two_stage_env()
    pool = make_pool({("fast", Z1): 1, ("fast", Z2): 1}, gpus_per_node=1)
    res = search(**cheap.kw(), pool=pool, objective="cost", gpu_specs=cheap.specs)
    best = res.plans[0]
    # one pipeline, so the search's closed form is the simulator's: egress included
    cand = next(c for c in res.candidates if c.estimate is not None and c.plan is not None)
    assert cand.fast.cost_per_iter == pytest.approx(cand.estimate.cost_per_iter_usd, rel=1e-6)
    pipe = best.plan.pipelines[0]
    m, b = pipe.num_microbatches, pipe.microbatch_size
    out = b * 256 * 1024  # output bytes per sample of every toy layer
    # the default calibration sends no attention mask (Calibration.sends_attention_mask)
    mask = 0
    per_gb = cheap.prices.egress_per_gb(Z1, Z2)
    expect = m * ((out + mask) + out) / 1e9 * per_gb
    assert best.estimate.egress_cost_usd == pytest.approx(expect, rel=1e-9)
    dear_prices = cheap.prices.model_copy(
        update={"egress": (EgressPrice(src="*", dst="*", usd_per_gb=100.0),)}
    )
    dear = search(
        **{**cheap.kw(), "prices": dear_prices}, pool=pool, objective="cost", gpu_specs=cheap.specs
    )
    assert dear.plans[0].estimate.egress_cost_usd > 1000 * best.estimate.egress_cost_usd
    assert dear.plans[0].cost_per_iter_usd > best.cost_per_iter_usd


def test_leftover_gpu_of_another_zone_joins_as_a_stage() -> None:
    """Three GPUs in one zone, one in the other, two stages per pipeline: the fourth GPU
    is only usable by a pipeline that spans the zones, and it raises throughput."""
    env = _two_stage_env(gbs=16)
    pool = make_pool({("fast", Z1): 3, ("fast", Z2): 1}, gpus_per_node=1)
    res = search(**env.kw(), pool=pool, gpu_specs=env.specs)
    best = res.plans[0]
    assert best.plan.num_gpus == 4
    assert any(len({s.replica.zone for s in p.stages}) == 2 for p in best.plan.pipelines)
    one_zone = search(
        **env.kw(), pool=pool, constraints=Constraints(allowed_zones=(Z1,)), gpu_specs=env.specs
    )
    assert best.throughput_iter_s > one_zone.plans[0].throughput_iter_s
    check_claims(env, res.plans, Constraints())


# -- spot ------------------------------------------------------------------------------------


def _plan(spot: bool | None) -> Plan:
    rg = ReplicaGroup(gpu_type="fast", zone=Z1, tp=1, gpus_per_node=2, spot=spot)
    return Plan(
        model="toy",
        global_batch_size=8,
        pipelines=(
            Pipeline(
                stages=(Stage(first_layer=0, last_layer=4, replica=rg),),
                microbatch_size=1,
                num_microbatches=8,
            ),
        ),
    )


def test_replica_spot_flag_overrides_the_simulate_argument() -> None:
    env = make_env(memory_mb={"fast": 2000, "slow": 2000})
    kw = {"gpu_specs": env.specs}
    sim = [env.model, env.profiles, env.network, env.prices]
    od = simulate(_plan(None), *sim, **kw)  # type: ignore[arg-type]
    sp = simulate(_plan(None), *sim, spot=True, **kw)  # type: ignore[arg-type]
    assert simulate(_plan(True), *sim, **kw).compute_cost_usd == sp.compute_cost_usd  # type: ignore[arg-type]
    assert simulate(_plan(False), *sim, spot=True, **kw).compute_cost_usd == od.compute_cost_usd  # type: ignore[arg-type]
    assert sp.compute_cost_usd < od.compute_cost_usd
    # the wire format without the field still validates (default None)
    old = _plan(None).model_dump(mode="json")
    old["pipelines"][0]["stages"][0]["replica"].pop("spot")
    assert Plan.model_validate(old) == _plan(None)


def _mixed_pool(spot_nodes: int, od_nodes: int) -> Pool:
    return Pool(
        entries=(
            PoolEntry(gpu_type="fast", zone=Z1, nodes=spot_nodes, gpus_per_node=2, spot=True),
            PoolEntry(gpu_type="fast", zone=Z1, nodes=od_nodes, gpus_per_node=2, spot=False),
        )
    )


def test_each_gpu_is_priced_by_its_entrys_spot_flag() -> None:
    env = make_env(memory_mb={"fast": 2000, "slow": 2000})  # spot $1/h, on-demand $4/h
    pool = _mixed_pool(1, 2)
    res = search(**env.kw(), pool=pool, gpu_specs=env.specs)
    best = res.plans[0]
    groups = [s.replica for p in best.plan.pipelines for s in p.stages]
    spot_gpus = sum(r.tp for r in groups if r.spot)
    od_gpus = sum(r.tp for r in groups if r.spot is False)
    assert spot_gpus + od_gpus == best.plan.num_gpus
    assert spot_gpus == min(2, best.plan.num_gpus)  # the cheap GPUs are rented first
    per_hour = spot_gpus * 1.0 + od_gpus * 4.0
    assert best.cost_per_hour_usd == pytest.approx(per_hour)
    assert best.estimate.compute_cost_usd == pytest.approx(
        per_hour * best.estimate.iteration_time_s / 3600
    )
    check_claims(env, res.plans, Constraints())
    # the global switch still overrides every entry
    od = search(**env.kw(), pool=pool, spot=False, gpu_specs=env.specs).plans[0]
    assert od.cost_per_hour_usd == pytest.approx(4.0 * od.plan.num_gpus)
    assert all(s.replica.spot is False for p in od.plan.pipelines for s in p.stages)


def test_cost_objective_prefers_spot_gpus_of_a_mixed_zone() -> None:
    env = make_env(memory_mb={"fast": 2000, "slow": 2000}, gbs=4)
    res = search(**env.kw(), pool=_mixed_pool(1, 3), objective="cost", gpu_specs=env.specs)
    best = res.plans[0]
    groups = [s.replica for p in best.plan.pipelines for s in p.stages]
    if best.plan.num_gpus <= 2:
        assert all(r.spot for r in groups)
    check_claims(env, res.plans, Constraints())


def test_pricing_flags_fill_whole_groups_cheapest_first() -> None:
    env = make_env()
    pr = GpuPricing.of(_mixed_pool(1, 2), env.prices, None)
    r = ("fast", Z1, 2)
    assert pr.flags(r, [1, 2, 1, 2]) == [False, True, False, False]
    assert pr.per_s({r: 6}) == pytest.approx((2 * 1.0 + 4 * 4.0) / 3600)
    assert pr.per_s({r: 1}) == pytest.approx(1.0 / 3600)
