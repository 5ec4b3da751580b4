"""Oracle: on small random pools, brute force finds no plan better than the planner's top.

Brute force enumerates the planner's search space exhaustively on pools of at most 6 GPUs
(two GPU types, nodes of 2 GPUs) and models of at most 6 layers: every multiset of pipelines
that fits the pool, each pipeline any contiguous partition into stages, each stage any TP
degree that fits a node, at most two GPU types per pipeline (a prefix on one, the rest on the
other), one microbatch size per plan (the planner may also mix them), microbatches spread
optimally (each to the pipeline that finishes it first: optimal for equal microbatches under
the 1F1B closed form). Every brute-force plan is scored by the simulator, as the planner's are.

Tolerance: the planner's best throughput is at least 0.97 x the brute-force best. The
planner's allocation is a heuristic (greedy packing by samples per GPU, a few shared
partitions per scenario, pipelines spanning GPU types packed first), not an exhaustive
search, so it may miss by a little: over 60 random examples of this space the worst ratio
measured was 0.994 (the misses are small batches where the bubble dominates). Pools of 8 GPUs
take the brute force a minute or two each, so the test stays at 6.
"""

from __future__ import annotations

import heapq
import itertools
import os
from collections.abc import Iterator

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sailor.planner import search
from sailor.schemas import Pipeline, Plan, ReplicaGroup, Stage
from sailor.simulator import lookup, simulate
from tests.unit.test_planner_search import Env, make_env, make_pool

_LONG = os.environ.get("SAILOR_LONG") == "1"
"""``make long-test``: the two-zone oracle draws 30 examples (12 in ``make test``)."""

TOLERANCE = 0.97
ZONE = "us-test1-a"


def _compositions(n: int) -> Iterator[tuple[int, ...]]:
    """Last layer of each stage for every split of ``n`` layers."""
    for k in range(n):
        for cuts in itertools.combinations(range(n - 1), k):
            yield (*cuts, n - 1)


Kind = tuple[str, int, str]  # GPU type, TP, zone
Res = tuple[str, str]  # GPU type, zone


def _shapes(n_layers: int, caps: dict[Res, int]) -> list[tuple[tuple[int, int, Kind], ...]]:
    kinds = [(g, tp, z) for (g, z), c in caps.items() if c > 0 for tp in (1, 2)]
    out = []
    for lasts in _compositions(n_layers):
        depth = len(lasts)
        firsts = (0, *(x + 1 for x in lasts[:-1]))
        patterns: set[tuple[Kind, ...]] = set()
        for k in kinds:
            patterns.add((k,) * depth)
        for ka, kb in itertools.permutations(kinds, 2):
            if (ka[0], ka[2]) == (kb[0], kb[2]):  # two kinds: another GPU type or zone
                continue
            for switch in range(1, depth):
                patterns.add((ka,) * switch + (kb,) * (depth - switch))
        for pat in patterns:
            need: dict[Res, int] = {}
            for g, tp, z in pat:
                need[(g, z)] = need.get((g, z), 0) + tp
            if all(need[r] <= caps[r] for r in need):
                out.append(
                    tuple(
                        (a, b, k)
                        for (a, b), k in zip(zip(firsts, lasts, strict=True), pat, strict=True)
                    )
                )
    return out


def _multisets(shapes: list, caps: dict[Res, int]) -> Iterator[list]:
    use = [{r: sum(k[1] for *_, k in s if (k[0], k[2]) == r) for r in caps} for s in shapes]

    def rec(i: int, left: dict[str, int], cur: list) -> Iterator[list]:
        if cur:
            yield list(cur)
        for j in range(i, len(shapes)):
            if all(use[j][g] <= left[g] for g in caps):
                cur.append(shapes[j])
                yield from rec(j, {g: left[g] - use[j][g] for g in caps}, cur)
                cur.pop()

    yield from rec(0, dict(caps), [])


def _pipe(shape: tuple, mbs: int, m: int) -> Pipeline:
    return Pipeline(
        stages=tuple(
            Stage(
                first_layer=a,
                last_layer=b,
                replica=ReplicaGroup(gpu_type=g, zone=z, tp=tp, gpus_per_node=2),
            )
            for a, b, (g, tp, z) in shape
        ),
        microbatch_size=mbs,
        num_microbatches=m,
    )


def brute_force(env: Env, caps: dict[Res, int]) -> float:
    n = env.model.num_all_layers
    gbs = env.model.global_batch_size
    shapes = _shapes(n, caps)
    best = 0.0
    timing: dict[tuple, tuple[float, float] | None] = {}

    def sim(p: Plan) -> float | None:
        est = simulate(p, env.model, env.profiles, env.network, env.prices, gpu_specs=env.specs)
        return est.iteration_time_s if est.fits_in_memory else None

    for mbs in (1, 2, 4):
        if gbs % mbs:
            continue
        total_mb = gbs // mbs
        for shape in shapes:  # per-pipeline fill and period from the simulator
            if (shape, mbs) not in timing:
                t1 = sim(
                    Plan(model="toy", global_batch_size=mbs, pipelines=(_pipe(shape, mbs, 1),))
                )
                t2 = sim(
                    Plan(model="toy", global_batch_size=2 * mbs, pipelines=(_pipe(shape, mbs, 2),))
                )
                timing[(shape, mbs)] = None if t1 is None or t2 is None else (t1, t2 - t1)
        ok = [s for s in shapes if timing[(s, mbs)] is not None]
        for ms in _multisets(ok, caps):
            if len(ms) > total_mb:
                continue
            counts = [0] * len(ms)
            heap = [(timing[(s, mbs)][0], i) for i, s in enumerate(ms)]  # type: ignore[index]
            heapq.heapify(heap)
            for _ in range(total_mb):
                t, i = heapq.heappop(heap)
                counts[i] += 1
                heapq.heappush(heap, (t + timing[(ms[i], mbs)][1], i))  # type: ignore[index]
            if 0 in counts:
                continue
            p = Plan(
                model="toy",
                global_batch_size=gbs,
                pipelines=tuple(_pipe(s, mbs, c) for s, c in zip(ms, counts, strict=True)),
            )
            it = sim(p)
            if it is not None:
                best = max(best, 1.0 / it)
    return best


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    weights=st.lists(st.sampled_from([0.5, 1.0, 2.0, 3.0]), min_size=3, max_size=6),
    fast_nodes=st.integers(0, 1),
    slow_nodes=st.integers(0, 2),
    slow_speed=st.sampled_from([1.5, 2.5, 4.0]),
    mem_slow=st.sampled_from([60, 120, 400]),
    gbs=st.sampled_from([4, 8]),
)
def test_planner_matches_brute_force(
    weights: list[float],
    fast_nodes: int,
    slow_nodes: int,
    slow_speed: float,
    mem_slow: int,
    gbs: int,
) -> None:
    if fast_nodes + slow_nodes == 0:
        slow_nodes = 1
    env = make_env(
        weights=tuple(weights),
        speed={"fast": 1.0, "slow": slow_speed},
        memory_mb={"fast": 400, "slow": mem_slow},
        params_mb=0.5,
        gbs=gbs,
    )
    caps = {("fast", ZONE): 2 * fast_nodes, ("slow", ZONE): 2 * slow_nodes}
    pool = make_pool({("fast", ZONE): fast_nodes, ("slow", ZONE): slow_nodes})
    res = search(**env.kw(), pool=pool, gpu_specs=env.specs)  # type: ignore[arg-type]
    truth = brute_force(env, caps)
    got = res.plans[0].throughput_iter_s if res.plans else 0.0
    if truth == 0.0:
        assert not res.plans, "brute force found nothing feasible but the planner did"
        return
    assert got >= TOLERANCE * truth, (got, truth, res.plans[0].explain if res.plans else res.reason)


ZONE_B = "us-test1-b"
TOLERANCE_ZONES = 0.9
"""Across zones the worst ratio seen was 0.924: one fast node per zone, 0.05 GB/s between the
zones, where the best plan is two single-stage TP-2 pipelines (one per zone) of one
microbatch of 4 and the planner's packing picks smaller microbatches or TP 1 (the allocation
heuristic prices gradient sync for a guessed number of pipelines; not the partition DP)."""


@settings(
    max_examples=30 if _LONG else 12, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(
    weights=st.lists(st.sampled_from([0.5, 1.0, 2.0, 3.0]), min_size=3, max_size=5),
    nodes=st.sampled_from([(1, 0, 1), (0, 1, 1), (1, 0, 0), (0, 0, 1)]),
    slow_speed=st.sampled_from([1.5, 2.5]),
    mem=st.sampled_from([140, 250, 400]),
    cross_zone_gbps=st.sampled_from([0.05, 0.5]),
    gbs=st.sampled_from([4, 8]),
)
def test_planner_matches_brute_force_across_two_zones(
    weights: list[float],
    nodes: tuple[int, int, int],
    slow_speed: float,
    mem: int,
    cross_zone_gbps: float,
    gbs: int,
) -> None:
    """Two zones: a node of fast or slow GPUs in one, a node of fast GPUs in the other (at
    most 4 GPUs: 6 take the brute force minutes); pipelines may span the zones (the hop over
    the cross-zone curve). Small memories force that. Tolerance :data:`TOLERANCE_ZONES`; a
    6-GPU example (fast+slow node in one zone, fast in the other, 0.05 GB/s between them)
    missed by 0.943: a sync-dominated case the allocation's sync guess misprices."""
    fast_a, slow_a, fast_b = nodes
    env = make_env(
        weights=tuple(weights),
        speed={"fast": 1.0, "slow": slow_speed},
        memory_mb={"fast": mem, "slow": mem},
        params_mb=0.5,
        gbs=gbs,
        zones=(ZONE, ZONE_B),
        cross_zone_gbps=cross_zone_gbps,
    )
    caps = {("fast", ZONE): 2 * fast_a, ("slow", ZONE): 2 * slow_a, ("fast", ZONE_B): 2 * fast_b}
    pool = make_pool({("fast", ZONE): fast_a, ("slow", ZONE): slow_a, ("fast", ZONE_B): fast_b})
    res = search(**env.kw(), pool=pool, gpu_specs=env.specs)  # type: ignore[arg-type]
    truth = brute_force(env, {r: c for r, c in caps.items() if c > 0})
    got = res.plans[0].throughput_iter_s if res.plans else 0.0
    if truth == 0.0:
        assert not res.plans, "brute force found nothing feasible but the planner did"
        return
    why = res.plans[0].explain if res.plans else res.reason
    assert got >= TOLERANCE_ZONES * truth, (got, truth, why)


def test_a_plan_in_another_precision_than_the_spec_reuses_the_layer_tables() -> None:
    """The simulator prices a plan at its own precision (a copy of the model spec); the copy
    is kept per (model, precision), so a second simulation of such a plan (the brute force
    above and the planner's search make thousands) builds no layer table or size list again,
    and gives the same answer."""
    env = make_env(
        weights=(1.0, 2.0, 1.0),
        speed={"fast": 1.0, "slow": 2.0},
        memory_mb={"fast": 400, "slow": 400},
        params_mb=0.5,
        gbs=4,
    )
    shape = ((0, 1, ("fast", 1, ZONE)), (2, env.model.num_all_layers - 1, ("slow", 2, ZONE)))
    plan = Plan(model="toy", global_batch_size=4, pipelines=(_pipe(shape, 2, 2),))
    assert plan.resolved_precision(env.specs, env.model.precision) != env.model.precision

    def sim() -> float:
        return simulate(
            plan, env.model, env.profiles, env.network, env.prices, gpu_specs=env.specs
        ).iteration_time_s

    first = sim()
    misses = lookup._MEMO.misses
    assert sim() == first
    assert lookup._MEMO.misses == misses
