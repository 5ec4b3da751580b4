"""Planner: every plan re-simulates to its figures and is feasible; objectives; bad input.

The synthetic environment here (two GPU types, one or two zones, a small model with
per-layer weights drawn by the test) is shared with the other planner tests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from sailor.planner import (
    Constraints,
    NoFeasiblePlanError,
    PlannerInputError,
    plan,
    search,
    throughput_upper_bound,
)
from sailor.planner.api import RankedPlan
from sailor.schemas import (
    BandwidthCurve,
    DeviceOverhead,
    Endpoint,
    GPUPrice,
    GPUSpec,
    LayerProfile,
    LayerSize,
    Link,
    ModelSpec,
    NetworkProfile,
    Pool,
    PoolEntry,
    PriceTable,
    ProfileDB,
)
from sailor.simulator import simulate

MB = 1 << 20


@dataclass(frozen=True)
class Env:
    model: ModelSpec
    profiles: ProfileDB
    network: NetworkProfile
    prices: PriceTable
    specs: dict[str, GPUSpec]

    def kw(self) -> dict[str, object]:
        return {
            "model": self.model,
            "profiles": self.profiles,
            "network": self.network,
            "prices": self.prices,
        }


def make_env(
    weights: tuple[float, ...] = (1.0, 2.0, 2.0, 2.0, 1.5),
    speed: dict[str, float] | None = None,
    memory_mb: dict[str, int] | None = None,
    params_mb: float = 2.0,
    gbs: int = 8,
    zones: tuple[str, ...] = ("us-test1-a",),
    cross_zone_gbps: float = 0.5,
    gpus_per_node: int = 2,
    num_heads: int = 4,
) -> Env:
    """A toy model of ``len(weights)`` layers on GPU types 'fast' and 'slow' (``num_heads``:
    the TP degrees the engine can split it over, ``ModelSpec.tp_problem``, divide it)."""
    speed = speed or {"fast": 1.0, "slow": 2.5}
    memory_mb = memory_mb or {"fast": 400, "slow": 200}
    n = len(weights)
    model = ModelSpec(
        name="toy",
        num_layers=n - 2,
        hidden_size=64,
        num_heads=num_heads,
        ffn_hidden_size=256,
        seq_length=16,
        vocab_size=128,
        global_batch_size=gbs,
        precision="fp16",
    )
    timings = []
    sizes = []
    for g, sp in speed.items():
        for tp in (1, 2):
            for b in (1, 2, 4):
                for layer, w in enumerate(weights):
                    f = 0.01 * w * sp * (b**0.9) / (tp**0.8)
                    timings.append(
                        LayerProfile(
                            gpu_type=g,
                            tp=tp,
                            microbatch_size=b,
                            layer=layer,
                            kind=model.layer_kind(layer),
                            fwd_s=f,
                            bwd_s=2 * f,
                            update_s=0.0005 * w / tp,
                            source="imported",
                        )
                    )
    for tp in (1, 2):
        for layer, w in enumerate(weights):
            sizes.append(
                LayerSize(
                    tp=tp,
                    layer=layer,
                    params=int(params_mb * MB * w / tp),
                    activation_bytes_per_sample=int(4 * MB * w / tp),
                    output_bytes_per_sample=256 * 1024,
                    source="imported",
                )
            )
    overheads = tuple(
        DeviceOverhead(gpu_type=g, tp=tp, bytes=8 * MB, source="test")
        for g in speed
        for tp in (1, 2)
    )
    profiles = ProfileDB(
        model="toy", timings=tuple(timings), sizes=tuple(sizes), overheads=overheads
    )
    links = []
    for za in zones:
        for zb in zones:
            for ga in speed:
                for gb in speed:
                    bw = 10.0 if za == zb else cross_zone_gbps
                    links.append(
                        Link(
                            src=Endpoint(zone=za, gpu_type=ga, gpus_per_node=gpus_per_node),
                            dst=Endpoint(zone=zb, gpu_type=gb, gpus_per_node=gpus_per_node),
                            curve=BandwidthCurve(coeffs=(0.0, 0.0, bw), max_gbps=bw),
                        )
                    )
    intra = tuple(
        Link(
            src=Endpoint(zone=zones[0], gpu_type=g, gpus_per_node=k),
            dst=Endpoint(zone=zones[0], gpu_type=g, gpus_per_node=k),
            curve=BandwidthCurve(coeffs=(0.0, 0.0, 100.0), max_gbps=100.0),
        )
        for g in speed
        for k in (1, 2, 4, 8)
    )
    network = NetworkProfile(links=tuple(links), intra_node=intra)
    prices = PriceTable(
        gpus=tuple(
            GPUPrice(
                gpu_type=g,
                region="*",
                on_demand_usd_per_hour=4.0 / speed[g],
                spot_usd_per_hour=1.0,
            )
            for g in speed
        )
    )
    specs = {
        g: GPUSpec(
            name=g,
            memory_bytes=memory_mb[g] * MB,
            peak_tflops_fp16=100,
            peak_tflops_bf16=100,
            peak_tflops_fp32=10,
            memory_bandwidth_gbps=1000,
            intra_node_link_gbps=100,
            intra_node_link="test",
            default_gpus_per_node=gpus_per_node,
            source="test",
        )
        for g in speed
    }
    return Env(model, profiles, network, prices, specs)


def make_pool(nodes: dict[tuple[str, str], int], gpus_per_node: int = 2) -> Pool:
    return Pool(
        entries=tuple(
            PoolEntry(gpu_type=g, zone=z, nodes=n, gpus_per_node=gpus_per_node)
            for (g, z), n in nodes.items()
        )
    )


def check_claims(
    env: Env, ranked: list[RankedPlan] | tuple[RankedPlan, ...], cons: Constraints
) -> None:
    """Each plan re-simulates to the figures it carries, fits and meets the constraints."""
    for r in ranked:
        est = simulate(
            r.plan, env.model, env.profiles, env.network, env.prices, gpu_specs=env.specs
        )
        assert est.iteration_time_s == pytest.approx(r.estimate.iteration_time_s, rel=1e-9)
        assert est.cost_per_iter_usd == pytest.approx(r.estimate.cost_per_iter_usd, rel=1e-9)
        assert est.peak_memory_bytes == r.estimate.peak_memory_bytes
        assert est.fits_in_memory
        assert all(m.total <= m.capacity for m in est.memory)
        assert not cons.violations(est, r.cost_per_hour_usd)
        assert sum(p.samples for p in r.plan.pipelines) == env.model.global_batch_size
        assert r.upper_bound_fraction <= 1.0 + 1e-9


POOL2 = {("fast", "us-test1-a"): 2, ("slow", "us-test1-a"): 4}


@pytest.mark.parametrize("objective", ["throughput", "cost", "throughput_per_cost"])
def test_every_plan_resimulates_and_is_feasible(objective: str) -> None:
    env = make_env(gbs=32)
    res = search(
        **env.kw(),
        pool=make_pool(POOL2),
        objective=objective,
        gpu_specs=env.specs,
        top_k=4,  # type: ignore[arg-type]
    )
    assert res.plans, res.reason
    check_claims(env, res.plans, Constraints())
    ub = res.upper_bound_iter_s
    assert all(r.throughput_iter_s <= ub * (1 + 1e-9) for r in res.plans)


def test_plans_are_ranked_by_the_objective() -> None:
    env = make_env(gbs=32)
    pool = make_pool(POOL2)
    thr = search(**env.kw(), pool=pool, objective="throughput", gpu_specs=env.specs, top_k=5)
    cost = search(**env.kw(), pool=pool, objective="cost", gpu_specs=env.specs, top_k=5)
    t = [r.throughput_iter_s for r in thr.plans]
    c = [r.cost_per_iter_usd for r in cost.plans]
    assert t == sorted(t, reverse=True)
    assert c == sorted(c)
    assert cost.plans[0].cost_per_iter_usd <= thr.plans[0].cost_per_iter_usd + 1e-12


def test_cost_objective_returns_pipelined_plans_when_a_stage_cannot_hold_the_model() -> None:
    # 5 layers x 2 MB x 16 B/param = 160+ MB of state: no single 'slow' GPU (120 MB) holds it
    env = make_env(memory_mb={"fast": 120, "slow": 120}, gbs=16)
    res = search(**env.kw(), pool=make_pool(POOL2), objective="cost", gpu_specs=env.specs)
    assert res.plans, res.reason
    assert all(p.depth > 1 or p.stages[0].replica.tp > 1 for p in res.plans[0].plan.pipelines)
    check_claims(env, res.plans, Constraints())


def test_mixed_types_and_uneven_partitions_are_used() -> None:
    env = make_env(weights=(0.5, 3.0, 1.0, 1.0, 0.5, 2.0), gbs=64)
    res = search(**env.kw(), pool=make_pool(POOL2), gpu_specs=env.specs, top_k=5)
    best = res.plans[0].plan
    types = {s.replica.gpu_type for p in best.pipelines for s in p.stages}
    assert types == {"fast", "slow"}, res.plans[0].explain
    # faster pipelines take more samples
    fast = [p.samples for p in best.pipelines if p.stages[0].replica.gpu_type == "fast"]
    slow = [p.samples for p in best.pipelines if p.stages[0].replica.gpu_type == "slow"]
    if fast and slow:
        assert max(fast) >= min(slow)


def test_constraints_are_met() -> None:
    env = make_env(gbs=32)
    pool = make_pool(POOL2)
    free = search(**env.kw(), pool=pool, gpu_specs=env.specs).plans[0]
    cons = Constraints(
        max_cost_per_iter_usd=free.cost_per_iter_usd * 0.95,
        max_gpus_per_type=(("fast", 2),),
    )
    res = search(**env.kw(), pool=pool, constraints=cons, gpu_specs=env.specs, top_k=5)
    assert res.plans, res.reason
    check_claims(env, res.plans, cons)
    by_hour = Constraints(max_cost_per_hour_usd=free.cost_per_hour_usd * 0.7)
    res2 = search(**env.kw(), pool=pool, constraints=by_hour, gpu_specs=env.specs)
    check_claims(env, res2.plans, by_hour)
    assert all(r.cost_per_hour_usd <= free.cost_per_hour_usd * 0.7 for r in res2.plans)
    floor = Constraints(min_throughput_iter_s=free.throughput_iter_s * 0.5)
    res3 = search(**env.kw(), pool=pool, objective="cost", constraints=floor, gpu_specs=env.specs)
    check_claims(env, res3.plans, floor)


def test_allowed_zones_and_regions() -> None:
    env = make_env(gbs=16, zones=("us-test1-a", "eu-test2-b"))
    pool = make_pool({("fast", "us-test1-a"): 1, ("fast", "eu-test2-b"): 2})
    for cons in (
        Constraints(allowed_zones=("eu-test2-b",)),
        Constraints(allowed_regions=("eu-test2",)),
    ):
        res = search(**env.kw(), pool=pool, constraints=cons, gpu_specs=env.specs)
        assert res.plans, res.reason
        zones = {s.replica.zone for r in res.plans for p in r.plan.pipelines for s in p.stages}
        assert zones == {"eu-test2-b"}


def test_cross_zone_sync_is_priced() -> None:
    env = make_env(gbs=16, zones=("us-test1-a", "us-test1-b"), cross_zone_gbps=0.05)
    pool = make_pool({("fast", "us-test1-a"): 1, ("fast", "us-test1-b"): 1})
    res = search(**env.kw(), pool=pool, gpu_specs=env.specs, top_k=5)
    check_claims(env, res.plans, Constraints())
    multi = [
        r for r in res.plans if len({k.split("@")[1] for k in r.estimate.gpus_by_type_zone}) > 1
    ]
    assert all(r.estimate.egress_cost_usd > 0 for r in multi)


# -- bad input ---------------------------------------------------------------------------------


def test_unknown_gpu_type_is_an_input_error() -> None:
    env = make_env()
    with pytest.raises(PlannerInputError, match="unknown"):
        plan(**env.kw(), pool=make_pool({("H900", "us-test1-a"): 1}), gpu_specs=env.specs)


def test_empty_pool_is_an_input_error() -> None:
    env = make_env()
    with pytest.raises(PlannerInputError, match="empty"):
        plan(**env.kw(), pool=Pool(entries=()), gpu_specs=env.specs)
    with pytest.raises(PlannerInputError, match="empty"):
        plan(**env.kw(), pool=make_pool({("fast", "us-test1-a"): 0}), gpu_specs=env.specs)


def test_model_that_fits_nowhere_gives_the_reason() -> None:
    env = make_env(memory_mb={"fast": 20, "slow": 20})
    res = search(**env.kw(), pool=make_pool(POOL2), gpu_specs=env.specs)
    assert not res.plans
    assert "fits on no stage" in res.reason
    with pytest.raises(NoFeasiblePlanError, match="fits on no stage"):
        plan(**env.kw(), pool=make_pool(POOL2), gpu_specs=env.specs)


def test_contradictory_constraints_give_the_reason() -> None:
    env = make_env(gbs=16)
    pool = make_pool(POOL2)
    ub = throughput_upper_bound(env.model, env.profiles, pool, gpu_specs=env.specs)
    res = search(
        **env.kw(),
        pool=pool,
        constraints=Constraints(min_throughput_iter_s=ub * 2),
        gpu_specs=env.specs,
    )
    assert not res.plans and "upper bound" in res.reason
    both = Constraints(min_throughput_iter_s=ub * 0.9, max_cost_per_iter_usd=1e-9)
    res2 = search(**env.kw(), pool=pool, constraints=both, gpu_specs=env.specs)
    assert not res2.plans and res2.reason
    with pytest.raises(PlannerInputError):
        Constraints(max_cost_per_iter_usd=-1.0)
    with pytest.raises(PlannerInputError):
        Constraints(allowed_zones=())
    res3 = search(
        **env.kw(),
        pool=pool,
        constraints=Constraints(allowed_zones=("nowhere-1-a",)),
        gpu_specs=env.specs,
    )
    assert not res3.plans and "allowed" in res3.reason


def test_profiles_of_another_model_are_rejected() -> None:
    env = make_env()
    other = env.profiles.model_copy(update={"model": "other"})
    with pytest.raises(PlannerInputError, match="does not match"):
        plan(env.model, other, make_pool(POOL2), env.network, env.prices, gpu_specs=env.specs)


def test_upper_bound_is_positive_and_scales_with_the_pool() -> None:
    env = make_env()
    a = throughput_upper_bound(
        env.model, env.profiles, make_pool({("fast", "us-test1-a"): 1}), gpu_specs=env.specs
    )
    b = throughput_upper_bound(
        env.model, env.profiles, make_pool({("fast", "us-test1-a"): 2}), gpu_specs=env.specs
    )
    assert a > 0 and math.isclose(b, 2 * a)


def test_cost_under_a_floor_buys_pipelines_at_the_floors_time() -> None:
    """Under a throughput floor, the cost objective also buys the cheapest pipelines that
    finish within the floor's time (and a few fractions of it), over all templates and on
    each shared partition: the cheapest plan is often the slowest one meeting the floor,
    which budgets relative to the whole pool's least time may not reach. Each such
    allocation keeps to its budget by the closed form, and the plan returned meets the
    floor."""
    env = make_env(weights=(0.5, 3.0, 1.0, 1.0, 0.5, 2.0), gbs=64)
    pool = make_pool(POOL2)
    free = search(**env.kw(), pool=pool, gpu_specs=env.specs).plans[0]
    for share in (0.5, 0.1):  # near the least time, and far below it
        floor = free.throughput_iter_s * share
        cons = Constraints(min_throughput_iter_s=floor)
        res = search(**env.kw(), pool=pool, objective="cost", constraints=cons, gpu_specs=env.specs)
        assert res.plans, res.reason
        check_claims(env, res.plans, cons)
        at_floor = [c for c in res.candidates if "the floor's time" in c.alloc.how]
        assert at_floor and any("on one partition" in c.alloc.how for c in at_floor)
        for c in at_floor:
            factor = float(c.alloc.how.split("within ")[1].split("x")[0])
            assert c.fast.iteration_s <= factor / floor * (1 + 1e-9), c.alloc.how
        # no plan priced by the relative budgets alone is cheaper than what is returned
        relative = [
            c.estimate.cost_per_iter_usd
            for c in res.candidates
            if c.estimate is not None and not c.violations and "least time" in c.alloc.how
        ]
        assert all(res.plans[0].cost_per_iter_usd <= x + 1e-12 for x in relative)
