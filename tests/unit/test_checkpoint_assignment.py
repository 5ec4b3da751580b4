"""Who writes which layer (pure): every layer exactly once, by a holder, spread over replicas."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from sailor.checkpoint import layers_written_by, place_of, writer_assignment, writer_ranks
from sailor.checkpoint.assignment import layout_summary
from sailor.schemas import Pipeline, Plan, ReplicaGroup, Stage


def _pipeline(cuts: list[int], tps: list[int], n: int, mbs: int = 1, nmb: int = 1) -> Pipeline:
    bounds = [0, *cuts, n]
    stages = tuple(
        Stage(
            first_layer=a,
            last_layer=b - 1,
            replica=ReplicaGroup(gpu_type="A100", zone="z", tp=tp, gpus_per_node=8),
        )
        for (a, b), tp in zip(itertools.pairwise(bounds), tps, strict=True)
    )
    return Pipeline(stages=stages, microbatch_size=mbs, num_microbatches=nmb)


def plan_of(n: int, pipes: list[tuple[list[int], list[int]]]) -> Plan:
    ps = tuple(_pipeline(c, t, n) for c, t in pipes)
    return Plan(model="toy", global_batch_size=len(ps), pipelines=ps)


@st.composite
def plans(draw: st.DrawFn) -> Plan:
    n = draw(st.integers(2, 12))
    pipes = []
    for _ in range(draw(st.integers(1, 3))):
        depth = draw(st.integers(1, min(n, 4)))
        cuts = sorted(draw(st.sets(st.integers(1, n - 1), min_size=depth - 1, max_size=depth - 1)))
        tps = [draw(st.sampled_from([1, 2, 4])) for _ in range(len(cuts) + 1)]
        pipes.append((cuts, tps))
    return plan_of(n, pipes)


@settings(max_examples=150, deadline=None)
@given(plans(), st.data())
def test_every_layer_written_once_by_a_holder(plan: Plan, data: st.DataObject) -> None:
    sizes = data.draw(
        st.dictionaries(st.integers(0, plan.num_layers - 1), st.integers(1, 1000)) | st.none()
    )
    a = writer_assignment(plan, sizes)
    assert sorted(a) == list(range(plan.num_layers))
    for layer, rank in a.items():
        assert layer in place_of(plan, rank).layers
    nranks = len(plan.ranks())
    by_rank = [layers_written_by(plan, r, sizes) for r in range(nranks)]
    assert sorted(x for ls in by_rank for x in ls) == list(range(plan.num_layers))
    assert writer_ranks(plan, sizes) == tuple(r for r in range(nranks) if by_rank[r])


@settings(max_examples=100, deadline=None)
@given(plans(), st.integers(1, 3))
def test_identical_replicas_share_the_work_evenly(plan: Plan, copies: int) -> None:
    # Same partition in every pipeline: each segment's holders differ by at most one layer.
    p0 = plan.pipelines[0]
    same = Plan(model="toy", global_batch_size=copies * p0.samples, pipelines=(p0,) * copies)
    a = writer_assignment(same)
    load = dict.fromkeys(range(len(same.ranks())), 0)
    for r in a.values():
        load[r] += 1
    for stage_first in {s.first_layer for s in p0.stages}:
        holders = [r for r in load if stage_first in place_of(same, r).layers]
        assert max(load[h] for h in holders) - min(load[h] for h in holders) <= 1


def test_two_replicas_split_the_work() -> None:
    plan = plan_of(8, [([4], [1, 1]), ([2, 6], [2, 1, 1])])
    a = writer_assignment(plan)
    pipelines = {place_of(plan, r).pipeline for r in a.values()}
    assert pipelines == {0, 1}
    counts = [len(layers_written_by(plan, r)) for r in range(len(plan.ranks()))]
    assert sum(counts) == 8 and max(counts) == 2  # 6 ranks, 8 layers: nobody writes 3


def test_place_of_and_summary() -> None:
    plan = plan_of(6, [([2], [2, 1])])
    p = place_of(plan, 1)
    assert (p.pipeline, p.stage, p.tp_rank, p.tp_size, p.layers) == (0, 0, 1, 2, (0, 1))
    assert p.group_ranks == (0, 1)
    assert place_of(plan, 2).layers == (2, 3, 4, 5)
    assert layout_summary(plan) == "p0: [0-1]tp2 [2-5]tp1 mbs=1x1"


def test_writes_spread_over_the_replicas_nodes_not_one_replicas_tp_ranks() -> None:
    """Four replicas of a TP-8 pipeline (a stage is one 8-GPU node): a stage's 10 layers go
    to the four nodes holding it (3, 3, 2, 2), not to the first replica's eight TP ranks
    and two of the second's (8, 2, 0, 0): each node writes to its own storage."""
    p0 = _pipeline([10, 20], [8, 8, 8], 30)
    plan = Plan(model="toy", global_batch_size=4, pipelines=(p0,) * 4)
    a = writer_assignment(plan)
    for stage in range(3):
        per_node = [0] * 4
        for rank in a.values():
            where = place_of(plan, rank)
            if where.stage == stage:
                per_node[where.pipeline] += 1
        assert sorted(per_node) == [2, 2, 3, 3], (stage, per_node)
    # with bytes, the same: the largest layer first, then each to the least loaded node
    sizes = {x: 100 + x for x in range(30)}
    b = writer_assignment(plan, sizes)
    for stage in range(3):
        node_bytes = [0] * 4
        for layer, rank in b.items():
            where = place_of(plan, rank)
            if where.stage == stage:
                node_bytes[where.pipeline] += sizes[layer]
        assert max(node_bytes) - min(node_bytes) <= max(sizes.values())
