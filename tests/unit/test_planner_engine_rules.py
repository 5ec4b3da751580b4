"""Every plan the planner emits is one the engine can run.

The engine's rules, checked without starting processes: each stage of a plan is built as the
engine builds it (``GPTStage`` on ``meta``: TP must divide the query and key/value heads, the
FFN width and the padded vocabulary), the controller binds each replica group inside one node
(``controller.planning.api.place``) and the GPU mapping is checked per node
(``megatron_patch.devices.check_devices``); for tiny models the whole iteration is recorded
on ``meta`` and replayed under NCCL's rules (``megatron_patch.dry_run``). The plans are the
planner's own (``robust_search`` with analytic profiles, as ``sailor plan`` without
``--profiles``) on pools the catalog's models and node shapes make awkward: 20 heads at TP 8,
nodes of 3, 5 and 6 GPUs.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from sailor import catalog
from sailor.comm.nccl_replay import replay
from sailor.controller.planning.api import PlacementError, place
from sailor.controller.planning.in_process import SailorPlanner
from sailor.megatron_patch.devices import check_devices
from sailor.megatron_patch.dry_run import record_iteration
from sailor.megatron_patch.engine import TrainConfig
from sailor.megatron_patch.model import GPTStage
from sailor.megatron_patch.precision import plan_precision
from sailor.megatron_patch.roles import role_of
from sailor.megatron_patch.tp_layers import TPContext
from sailor.planner import Constraints
from sailor.planner.placement import unplaceable
from sailor.planner.robust import robust_search
from sailor.planner.tables import CostTables, Inputs
from sailor.schemas import ModelSpec, NetworkProfile, Pipeline, Plan, ProfileDB, Stage
from sailor.schemas.hardware import NodeSpec, Pool
from sailor.schemas.plan import ReplicaGroup
from sailor.simulator import simulate
from tests.gloo_world import join_gloo, tiny_trainer
from tests.spawn import spawn

Entry = tuple[str, str, int, int]
"""(GPU type, zone, nodes, GPUs per node)."""


def _builds(spec: ModelSpec, first: int, last: int, tp: int) -> str | None:
    """The engine's error building layers ``first..last`` at ``tp`` (None: it builds)."""
    ctx = TPContext(size=tp, rank=0, group=object() if tp > 1 else None)
    try:
        with torch.device("meta"):
            GPTStage(spec, first, last, tp=ctx, init=False)
    except ValueError as exc:
        return str(exc)
    return None


def _pool(entries: list[Entry]) -> Pool:
    return Pool(
        entries=[
            {"gpu_type": g, "zone": z, "nodes": n, "gpus_per_node": k, "spot": True}
            for g, z, n, k in entries
        ]
    )


def _nodes(pool: Pool) -> tuple[NodeSpec, ...]:
    return tuple(
        NodeSpec(node_id=f"n{i}-{j}", gpu_type=e.gpu_type, gpus=e.gpus_per_node, zone=e.zone)
        for i, e in enumerate(pool.entries)
        for j in range(e.nodes)
    )


def _plans(spec: ModelSpec, pool: Pool, objective: str = "throughput") -> list[Plan]:
    res = robust_search(
        spec,
        ProfileDB(model=spec.name, meta={"tool": "empty: analytic estimates only"}),
        pool,
        NetworkProfile(),
        catalog.prices(),
        objective,  # type: ignore[arg-type]
        Constraints(),
        gpu_specs=catalog.gpus(),
        calibration=catalog.calibration(),
        risk="median",
        top_k=3,
    )
    assert res.plans, res.reason
    return [rp.plan for rp in res.plans]


def _engine_problems(plan: Plan, spec: ModelSpec, pool: Pool) -> list[str]:
    out: list[str] = []
    built: set[tuple[int, int, int]] = set()
    for pi, p in enumerate(plan.pipelines):
        for si, s in enumerate(p.stages):
            key = (s.first_layer, s.last_layer, s.replica.tp)
            if key in built:
                continue
            built.add(key)
            why = _builds(spec, *key)
            if why is not None:
                out.append(f"pipelines[{pi}].stages[{si}] tp={s.replica.tp}: {why}")
    for rank in range(plan.num_gpus):
        role_of(plan, rank)
    plan_precision(plan, spec)  # a GPU type that cannot run the plan's precision: refused
    nodes = _nodes(pool)
    bound, _ = place(plan, nodes)  # raises PlacementError if a group fits no node
    for n in nodes:
        check_devices(bound, n.gpus, node=n.node_id)
    return out


# -- the rule, one function on both sides ----------------------------------------------------

_SPECS = [
    *catalog.models().values(),
    ModelSpec(
        name="odd-ffn",
        num_layers=2,
        hidden_size=64,
        num_heads=8,
        ffn_hidden_size=100,
        seq_length=8,
        vocab_size=100,
        global_batch_size=8,
    ),
]


@pytest.mark.parametrize("spec", _SPECS, ids=[s.name for s in _SPECS])
def test_the_models_tp_rule_is_the_engines(spec: ModelSpec) -> None:
    """``ModelSpec.tp_problem`` refuses exactly the TP degrees the engine cannot build."""
    last = spec.num_all_layers - 1
    for tp in (1, 2, 4, 8, 16):
        engine = _builds(spec, 0, last, tp)
        rule = spec.tp_problem(tp)
        assert (engine is None) == (rule is None), (tp, engine, rule)


def test_the_cost_tables_refuse_a_tp_degree_the_engine_cannot_build() -> None:
    """GPT-Neo-2.7 has 20 heads: TP 8 was priced (analytic estimates at any degree)."""
    spec = catalog.model("GPT-Neo-2.7")
    tables = CostTables(
        Inputs(
            model=spec,
            profiles=ProfileDB(model=spec.name, meta={}),
            network=NetworkProfile(),
            prices=catalog.prices(),
            gpu_specs=catalog.gpus(),
            calibration=catalog.calibration(),
        )
    )
    assert tables.arrays("H100-80", 4, 1) is not None
    assert tables.arrays("H100-80", 8, 1) is None
    assert "num_heads=20" in str(tables.failure("H100-80", 8, 1))


def _dp_plan(groups: int, tp: int, gpus_per_node: int) -> Plan:
    replica = ReplicaGroup(
        gpu_type="A100-40", zone="us-central1-a", tp=tp, gpus_per_node=gpus_per_node
    )
    stage = Stage(first_layer=0, last_layer=5, replica=replica)
    return Plan(
        model="tiny-gpt",
        global_batch_size=groups,
        pipelines=tuple(
            Pipeline(stages=(stage,), microbatch_size=1, num_microbatches=1) for _ in range(groups)
        ),
    )


def test_groups_that_add_up_but_fit_no_node_are_unplaceable() -> None:
    """12 GPUs on 4 nodes of 3 hold 4 TP-2 groups, not 6; the check is the controller's."""
    pool = _pool([("A100-40", "us-central1-a", 4, 3)])
    assert unplaceable(_dp_plan(4, 2, 3), pool) is None
    place(_dp_plan(4, 2, 3), _nodes(pool))
    why = unplaceable(_dp_plan(6, 2, 3), pool)
    assert why is not None and "pipelines[4].stages[0]" in why, why
    with pytest.raises(PlacementError, match=r"pipelines\[4\]\.stages\[0\]"):
        place(_dp_plan(6, 2, 3), _nodes(pool))
    assert unplaceable(_dp_plan(12, 1, 3), pool) is None


# -- the planner's own plans against the engine's rules ----------------------------------------

_CASES: list[tuple[str, list[Entry], str]] = [
    # 20 heads: the plans of one 8-GPU node included a TP-8 pipeline
    ("GPT-Neo-2.7", [("H100-80", "us-central1-a", 1, 8)], "throughput"),
    # nodes of 3 GPUs: TP-2 groups counted by GPUs (6 on 12 GPUs), 4 fit the nodes
    ("GPT-Neo-2.7", [("A100-40", "us-central1-a", 4, 3)], "throughput"),
    ("OPT-350", [("A100-40", "us-central1-a", 3, 3)], "throughput"),
    ("OPT-350", [("V100-16", "us-central1-a", 2, 5), ("A100-40", "us-central1-a", 1, 7)], "cost"),
    ("LLAMA-3-8", [("A100-40", "us-central1-a", 2, 6)], "throughput"),
    # nodes of 5 GPUs hold one TP-4 group each: 4 of them, not 5
    ("LLAMA-3-8", [("A100-80", "us-central1-a", 4, 5)], "throughput"),
    ("OPT-30", [("A100-80", "us-central1-a", 4, 8)], "throughput"),
]


@pytest.mark.parametrize(
    ("model", "entries", "objective"),
    _CASES,
    ids=[f"{m}-{'+'.join(f'{n}x{k}{g}' for g, _, n, k in e)}-{o}" for m, e, o in _CASES],
)
def test_the_planners_plans_are_runnable_by_the_engine(
    model: str, entries: list[Entry], objective: str
) -> None:
    spec = catalog.model(model)
    pool = _pool(entries)
    for plan in _plans(spec, pool, objective):
        assert plan.num_layers == spec.num_all_layers
        assert sum(p.samples for p in plan.pipelines) == spec.global_batch_size
        assert _engine_problems(plan, spec, pool) == []


_TINY: list[tuple[str, list[Entry]]] = [
    ("tiny-llama", [("A100-40", "us-central1-a", 2, 3)]),
    ("tiny-gpt", [("V100-16", "us-central1-a", 1, 5), ("A100-40", "us-west1-b", 1, 2)]),
]


@pytest.mark.parametrize(
    ("model", "entries"), _TINY, ids=[f"{m}-{len(e)}-entries" for m, e in _TINY]
)
def test_the_planners_tiny_plans_replay_under_nccl_rules(model: str, entries: list[Entry]) -> None:
    """The engine's whole iteration (1F1B with each pipeline's microbatches, the gradient
    sync, the step agreement) recorded on meta for every rank and replayed."""
    spec = catalog.model(model)
    pool = _pool(entries)
    for plan in _plans(spec, pool):
        assert _engine_problems(plan, spec, pool) == []
        res = replay(record_iteration(plan, spec))
        assert res.ok, res.message


# -- a few of them run for real ----------------------------------------------------------------

_GLOO_TIMEOUT_S = 60.0


def _gloo_rank(rank: int, plan: Plan, store: str, out: str) -> None:
    join_gloo(store, rank, plan.num_gpus, _GLOO_TIMEOUT_S)
    tr = tiny_trainer(plan, rank, TrainConfig(seed=0), _GLOO_TIMEOUT_S)
    res = tr.train_step()
    Path(f"{out}.{rank}").write_text(f"{res.loss!r} {res.samples}")
    dist.destroy_process_group()


_GLOO: list[tuple[str, list[Entry]]] = [
    ("tiny-llama", [("A100-40", "us-central1-a", 1, 3)]),
    ("tiny-gpt", [("V100-16", "us-central1-a", 1, 2), ("A100-40", "us-west1-b", 1, 2)]),
]


@pytest.mark.parametrize(
    ("model", "entries"), _GLOO, ids=[f"{m}-{len(e)}-entries" for m, e in _GLOO]
)
def test_the_planners_best_tiny_plan_trains_a_step_on_gloo(
    tmp_path: Path, model: str, entries: list[Entry]
) -> None:
    """The planner's first plan, run by the engine's trainer on real gloo ranks (on the CPU,
    in fp32): every rank finishes the step with the same finite loss over the global batch."""
    spec = catalog.model(model)
    plan = _plans(spec, _pool(entries))[0]
    assert plan.num_gpus <= 4  # two shared cores
    out = tmp_path / "loss"
    spawn(_gloo_rank, args=(plan, str(tmp_path / "store"), str(out)), nprocs=plan.num_gpus)
    got = [Path(f"{out}.{r}").read_text().split() for r in range(plan.num_gpus)]
    losses = {float(loss) for loss, _ in got}
    assert len(losses) == 1 and math.isfinite(losses.pop()), got
    assert {int(n) for _, n in got} == {spec.global_batch_size}


def test_the_controllers_planner_places_its_best_plan_on_nodes_of_five() -> None:
    """What a job on 4 nodes of 5 A100-80 got: the planner's best plan had 5 TP-4 groups
    (20 GPUs counted), and the controller's placement raised PlacementError for the fifth."""
    nodes = tuple(
        NodeSpec(node_id=f"n{i}", gpu_type="A100-80", gpus=5, zone="us-central1-a")
        for i in range(4)
    )
    # robust: its TP-4 plan (the median corner alone now prefers TP-1 pipelines here, since
    # efficiencies are taken on the link at hand); each corner's search is still run
    res = SailorPlanner(catalog.model("LLAMA-3-8"), risk="robust").plan(nodes, None)
    assert res.plan.num_gpus <= 16
    for n in nodes:
        check_devices(res.plan, n.gpus, node=n.node_id)
    assert any(s.replica.tp == 4 for p in res.plan.pipelines for s in p.stages)


def test_a_replan_on_a_node_joining_places_its_plan_on_nodes_of_five() -> None:
    """The incremental replan takes the same check: 3 -> 4 nodes of 5 A100-80 raised
    PlacementError (pipelines[2].stages[2]: no node with 2 free GPUs) at the replan."""
    nodes = tuple(
        NodeSpec(node_id=f"n{i}", gpu_type="A100-80", gpus=5, zone="us-central1-a")
        for i in range(4)
    )
    planner = SailorPlanner(catalog.model("LLAMA-3-8"), risk="median")
    first = planner.plan(nodes[:3], None)
    res = planner.plan(nodes, first.plan)
    assert "(replan)" in res.reason, res.reason
    for n in nodes:
        check_devices(res.plan, n.gpus, node=n.node_id)


def test_a_group_goes_to_a_node_of_the_shape_it_was_priced_on() -> None:
    """A zone with a 4-GPU node (id first) and a 2-GPU node: a TP-2 group priced on the
    2-GPU shape, then a TP-4 group priced on the 4-GPU one. The placement took the first node
    by id whatever its shape (the TP-2 group took half the 4-GPU node, and the TP-4 group
    found none); the planner's check and the placement now agree that it fits."""

    def group(tp: int, shape: int, first: int, last: int) -> Stage:
        replica = ReplicaGroup(gpu_type="A100-40", zone="us-central1-a", tp=tp, gpus_per_node=shape)
        return Stage(first_layer=first, last_layer=last, replica=replica)

    pipe = Pipeline(
        stages=(group(2, 2, 0, 2), group(4, 4, 3, 5)), microbatch_size=1, num_microbatches=8
    )
    plan = Plan(model="tiny-gpt", global_batch_size=8, pipelines=(pipe,))
    pool = _pool([("A100-40", "us-central1-a", 1, 4), ("A100-40", "us-central1-a", 1, 2)])
    assert unplaceable(plan, pool) is None
    nodes = (
        NodeSpec(node_id="a", gpu_type="A100-40", gpus=4, zone="us-central1-a"),
        NodeSpec(node_id="b", gpu_type="A100-40", gpus=2, zone="us-central1-a"),
    )
    bound, ranks = place(plan, nodes)
    assert ranks == {"a": (2, 3, 4, 5), "b": (0, 1)}
    for n in nodes:
        check_devices(bound, n.gpus, node=n.node_id)


def test_the_simulator_refuses_a_tp_degree_the_engine_cannot_build() -> None:
    """``sailor simulate`` of a hand-written plan: tiny-gpt's 4 heads over 8 TP ranks was
    priced from analytic estimates as if the engine could run it."""
    spec = catalog.model("tiny-gpt")

    def one_stage(tp: int) -> Plan:
        replica = ReplicaGroup(gpu_type="A100-40", zone="us-central1-a", tp=tp, gpus_per_node=8)
        stage = Stage(first_layer=0, last_layer=spec.num_all_layers - 1, replica=replica)
        gbs = spec.global_batch_size
        pipe = Pipeline(stages=(stage,), microbatch_size=1, num_microbatches=gbs)
        return Plan(model=spec.name, global_batch_size=gbs, pipelines=(pipe,))

    def run(plan: Plan) -> float:
        db = ProfileDB(model=spec.name, meta={})
        est = simulate(
            plan,
            spec,
            db,
            NetworkProfile(),
            catalog.prices(),
            calibration=catalog.calibration(),
            gpu_specs=catalog.gpus(),
        )
        return est.iteration_time_s

    with pytest.raises(ValueError, match=r"stages\[0\]\.replica\.tp=8: .*num_heads=4"):
        run(one_stage(8))
    assert run(one_stage(4)) > 0
