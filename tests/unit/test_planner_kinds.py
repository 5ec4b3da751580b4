"""The planner plans across CPU kinds as it plans across GPU types.

A pool of 2 ``cpu-full`` and 2 ``cpu-slow`` nodes (one "GPU" each) and a ProfileDB where the
slow kind's layers take 2.5 times as long (what ``sailor profile layers --cpu-quota 0.4``
measures, ``tests/integration/test_profile_kinds.py``; synthetic figures here so that the
test is exact and quick). The kinds' memory, prices and calibration come from the ``cpu``
entries (``schemas.device_kind``): nothing in the path from node specs to a placed plan
knows one ``cpu`` type.
"""

from __future__ import annotations

from sailor import catalog
from sailor.controller.planning.in_process import SailorPlanner, pool_of
from sailor.planner import search
from sailor.schemas import (
    DeviceOverhead,
    LayerProfile,
    ModelSpec,
    NetworkProfile,
    NodeSpec,
    Plan,
    Pool,
    PoolEntry,
    ProfileDB,
)

MB = 1 << 20
SLOW = 2.5
"""cpu-slow's layer times over cpu-full's: a quota of 0.4 cores against a free core."""


def _profiles(spec: ModelSpec, block_s: float) -> ProfileDB:
    """Forward times per layer kind (backward 2x, per-layer update), linear in the
    microbatch; cpu-slow's SLOW times cpu-full's."""
    per = {"embedding": 0.15 * block_s, "block": block_s, "head": 0.5 * block_s}
    rows = []
    for kind, slow in (("cpu-full", 1.0), ("cpu-slow", SLOW)):
        for b in (1, 2, 4, 8):
            for layer in range(spec.num_all_layers):
                k = spec.layer_kind(layer)
                f = per[k] * b * slow
                rows.append(
                    LayerProfile(
                        gpu_type=kind,
                        tp=1,
                        microbatch_size=b,
                        layer=layer,
                        kind=k,
                        fwd_s=f,
                        bwd_s=2 * f,
                        update_s=0.5 * per[k] * slow,
                        source="measured",
                    )
                )
    overheads = tuple(
        DeviceOverhead(gpu_type=g, tp=1, bytes=8 * MB, source="test")
        for g in ("cpu-full", "cpu-slow")
    )
    return ProfileDB(model=spec.name, timings=tuple(rows), overheads=overheads)


def _nodes() -> tuple[NodeSpec, ...]:
    return tuple(
        NodeSpec(node_id=f"{k}-{i}", gpu_type=k, gpus=1, zone="local-a", address="127.0.0.1")
        for k in ("cpu-full", "cpu-slow")
        for i in range(2)
    )


def _samples(plan: Plan, kind: str) -> list[int]:
    return [
        p.microbatch_size * p.num_microbatches
        for p in plan.pipelines
        if {s.replica.gpu_type for s in p.stages} == {kind}
    ]


def test_the_controllers_planner_gives_slow_replicas_fewer_samples() -> None:
    """tiny-gpt (the demo's model) on the controller's planner with catalog specs: the
    whole model fits every node, so the plan is data parallel over both kinds, and each
    replica's share of the batch follows its kind's speed."""
    spec = catalog.model("tiny-gpt").model_copy(update={"global_batch_size": 8})
    nodes = _nodes()
    assert {(e.gpu_type, e.nodes) for e in pool_of(nodes).entries} == {
        ("cpu-full", 2),
        ("cpu-slow", 2),
    }
    planner = SailorPlanner(spec, profiles=_profiles(spec, 1e-3))
    res = planner.plan(nodes, None)
    plan = res.plan
    assert set(res.placement) == {n.node_id for n in nodes}, res.reason  # every node used
    kinds = {s.replica.gpu_type for p in plan.pipelines for s in p.stages}
    assert kinds == {"cpu-full", "cpu-slow"}, res.reason
    full, slow = _samples(plan, "cpu-full"), _samples(plan, "cpu-slow")
    assert full and slow and min(full) > max(slow), (full, slow, res.reason)
    assert sum(p.microbatch_size * p.num_microbatches for p in plan.pipelines) == 8
    # placed: every stage on a node of its own kind
    by_id = {n.node_id: n for n in nodes}
    for p in plan.pipelines:
        for s in p.stages:
            assert by_id[s.replica.node_id].gpu_type == s.replica.gpu_type


def _mixed_pipelines(plan: Plan) -> list[tuple[list[int], list[int]]]:
    """(layers per cpu-full stage, layers per cpu-slow stage) of every pipeline with both."""
    out = []
    for p in plan.pipelines:
        full = [s.num_layers for s in p.stages if s.replica.gpu_type == "cpu-full"]
        slow = [s.num_layers for s in p.stages if s.replica.gpu_type == "cpu-slow"]
        if full and slow:
            out.append((full, slow))
    return out


def test_pipelines_across_kinds_give_slow_stages_fewer_layers() -> None:
    """A model that fits no single node (the user's ``cpu`` entry, which the kinds take,
    holds 60 MiB): pipelines span both kinds, and the slow kind's stages get fewer layers."""
    spec = ModelSpec(
        name="kinds-toy",
        num_layers=8,
        hidden_size=256,
        num_heads=4,
        ffn_hidden_size=1024,
        seq_length=32,
        vocab_size=512,
        global_batch_size=8,
        precision="fp32",
    )
    db = _profiles(spec, 2e-3)
    small = {"cpu": catalog.gpus()["cpu"].model_copy(update={"memory_bytes": 60 * MB})}
    pool = Pool(
        entries=tuple(
            PoolEntry(gpu_type=g, zone="local-a", nodes=2, gpus_per_node=1)
            for g in ("cpu-full", "cpu-slow")
        )
    )
    args = (spec, db, pool, NetworkProfile(), catalog.prices())
    res = search(*args, gpu_specs=small, calibration=catalog.calibration(), top_k=5)
    assert res.plans, res.reason
    best = res.plans[0].plan
    assert all(len(p.stages) >= 2 for r in res.plans for p in r.plan.pipelines)  # 60 MiB
    assert {s.replica.gpu_type for p in best.pipelines for s in p.stages} == {
        "cpu-full",
        "cpu-slow",
    }
    mixed = [m for r in res.plans for m in _mixed_pipelines(r.plan)]
    assert mixed, [r.plan.pipelines for r in res.plans]
    for full, slow in mixed:
        assert sum(slow) / len(slow) < sum(full) / len(full), (full, slow)
    # without a spec to fall back to, a kind has no memory bound: one stage may hold it all
    free = search(*args, gpu_specs={}, calibration=catalog.calibration(), top_k=5)
    assert any(len(p.stages) == 1 for r in free.plans for p in r.plan.pipelines)
