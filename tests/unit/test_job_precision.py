"""One precision for the life of a job: fixed once, a constraint of every plan, honoured by
the worker before any collective (docs/training.md, "One precision per job").

A job that trained in bf16 and was relaunched in fp16 when a V100 joined overflowed in the
forward under a loss scale of 2^16; a forced fp32 was priced as 16 bits; a forced bf16 on a
plan with V100s was refused by the V100 ranks only, after the world's first collective.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from sailor import catalog
from sailor.controller.decide import decide
from sailor.controller.decision_types import DecideConfig, Observed, Replan, SetDesired
from sailor.controller.planning import DataParallelPlanner
from sailor.controller.planning.in_process import SailorPlanner
from sailor.planner import search
from sailor.schemas import NetworkProfile, Pool, PoolEntry, ProfileDB
from sailor.schemas.hardware import NodeSpec
from sailor.schemas.plan import Pipeline, Plan, ReplicaGroup, Stage
from sailor.schemas.runtime import AgentStatus, DesiredState, Phase
from sailor.schemas.training import BuiltinModel, TrainingConfig
from sailor.simulator import simulate

ZONE = "us-central1-a"
SPEC = catalog.model("OPT-350").model_copy(update={"global_batch_size": 16})
POOL = Pool(
    entries=(
        PoolEntry(gpu_type="A100-40", zone=ZONE, nodes=1, gpus_per_node=4),
        PoolEntry(gpu_type="V100-16", zone=ZONE, nodes=2, gpus_per_node=4),
    )
)


def _search(precision: str | None) -> object:
    return search(
        SPEC,
        ProfileDB(model=SPEC.name),
        POOL,
        NetworkProfile(),
        catalog.prices(),
        gpu_specs=catalog.gpus(),
        calibration=catalog.calibration(),
        precision=precision,  # type: ignore[arg-type]
    )


# -- the planner ------------------------------------------------------------------------------


def test_which_gpu_types_can_run_which_precision() -> None:
    from sailor.schemas.precision import cannot_run

    specs = catalog.gpus()
    assert cannot_run("A100-40", specs, "bf16") == ""
    assert "no bf16 units" in cannot_run("V100-16", specs, "bf16")
    assert cannot_run("V100-16", specs, "fp16") == ""
    assert "no spec" in cannot_run("mystery-gpu", specs, "bf16")
    assert "fp32 only" in cannot_run("cpu", specs, "fp16")
    assert all(cannot_run(g, specs, "fp32") == "" for g in specs)


def test_a_bf16_job_leaves_the_v100s_out_and_says_why() -> None:
    res = _search("bf16")
    assert res.plans  # type: ignore[attr-defined]
    for r in res.plans:  # type: ignore[attr-defined]
        assert r.plan.precision == "bf16"
        assert set(r.plan.gpu_types) == {"A100-40"}
        assert "V100-16" in r.explain[0] and "no bf16 units" in r.explain[0]
    (why,) = res.left_out  # type: ignore[attr-defined]
    assert why.startswith("left out V100-16 (8 GPUs): the job runs bf16")


def test_a_pool_of_v100s_alone_has_no_plan_for_a_bf16_job_and_the_reason_names_them() -> None:
    only = Pool(entries=(PoolEntry(gpu_type="V100-16", zone=ZONE, nodes=2, gpus_per_node=4),))
    res = search(
        SPEC,
        ProfileDB(model=SPEC.name),
        only,
        NetworkProfile(),
        catalog.prices(),
        gpu_specs=catalog.gpus(),
        precision="bf16",
    )
    assert not res.plans
    assert "every GPU type of the pool is left out" in res.reason and "V100-16" in res.reason


def test_a_forced_fp32_job_is_priced_in_fp32() -> None:
    free, fp32 = _search(None), _search("fp32")
    best16 = free.plans[0]  # type: ignore[attr-defined]
    assert best16.plan.precision == "bf16"  # what an unconstrained first plan would run
    for r in fp32.plans:  # type: ignore[attr-defined]
        assert r.plan.precision == "fp32"
        again = simulate(
            r.plan,
            SPEC,
            ProfileDB(model=SPEC.name),
            NetworkProfile(),
            catalog.prices(),
            calibration=catalog.calibration(),
            gpu_specs=catalog.gpus(),
            spot=False,
        )
        assert again.peak_memory_bytes == r.estimate.peak_memory_bytes
    # the same layout in fp32 holds 4-byte activations and computes at the fp32 peak
    as32 = best16.plan.model_copy(update={"precision": "fp32"})
    kw = {"calibration": catalog.calibration(), "gpu_specs": catalog.gpus(), "spot": False}
    e16 = simulate(
        best16.plan, SPEC, ProfileDB(model=SPEC.name), NetworkProfile(), catalog.prices(), **kw
    )  # type: ignore[arg-type]
    e32 = simulate(as32, SPEC, ProfileDB(model=SPEC.name), NetworkProfile(), catalog.prices(), **kw)  # type: ignore[arg-type]
    assert e32.peak_memory_bytes > e16.peak_memory_bytes
    assert e32.iteration_time_s > e16.iteration_time_s
    assert fp32.plans[0].estimate.iteration_time_s > best16.estimate.iteration_time_s  # type: ignore[attr-defined]


def _nodes(*kinds: str) -> tuple[NodeSpec, ...]:
    return tuple(
        NodeSpec(node_id=f"{g}-{i}", gpu_type=g, gpus=4, zone=ZONE, address="h")
        for i, g in enumerate(kinds)
    )


def test_the_controllers_planner_keeps_bf16_when_a_v100_joins() -> None:
    """The first plan on A100s is bf16; a replan in the job's precision after a V100 node
    joins leaves it out (it was fp16 with the V100 in it: each plan chose its own)."""
    planner = SailorPlanner(SPEC, risk="median")
    first = planner.plan(_nodes("A100-40"), None)
    assert first.plan.precision == "bf16"
    joined = _nodes("A100-40", "V100-16")
    again = planner.plan(joined, first.plan, "bf16")
    assert again.plan.precision == "bf16"
    assert set(again.plan.gpu_types) == {"A100-40"}
    assert "left out V100-16" in again.reason and "no bf16 units" in again.reason
    # a job in fp16 from the start may use them (nothing is left out)
    fp16 = SailorPlanner(SPEC, risk="median").plan(joined, None, "fp16")
    assert fp16.plan.precision == "fp16" and "left out" not in fp16.reason


def test_the_stand_in_planner_records_and_honours_the_precision() -> None:
    dp = DataParallelPlanner("tiny-gpt", 4, 8)
    nodes = (*_nodes("A100-40"), *_nodes("V100-16", "V100-16")[1:])
    free = dp.plan(nodes, None)
    assert free.plan.precision == "fp16"  # derived from its GPU types, and recorded
    kept = dp.plan(nodes, None, "bf16")
    assert kept.plan.precision == "bf16" and set(kept.plan.gpu_types) == {"A100-40"}
    assert "left out V100-16" in kept.reason


# -- the controller's decision ------------------------------------------------------------------

CFG = DecideConfig(checkpoint_dir="/ck", stop_ahead_steps=2)
NOW = 1000.0


def _node(i: int, gpu: str = "A100-40") -> NodeSpec:
    return NodeSpec(node_id=f"n{i}", gpu_type=gpu, gpus=1, zone="z-a-1", address="h")


def _obs(ns: dict[str, NodeSpec], *statuses: AgentStatus) -> Observed:
    return Observed(now=NOW, nodes=ns, status={s.node_id: s for s in statuses})


def _launched(cfg: DecideConfig, plan_kinds: tuple[str, ...]) -> DesiredState:
    """The desired state after the IDLE pass launches a plan on ``plan_kinds``."""
    ns = {f"n{i}": _node(i, g) for i, g in enumerate(plan_kinds)}
    res = DataParallelPlanner("m", 4, 8).plan(tuple(ns.values()), None)
    d = DesiredState(
        epoch=7,
        next_plan=res.plan,
        next_placement=res.placement,
        next_membership=tuple(sorted(ns)),
    )
    o = _obs(ns, *(AgentStatus(node_id=n, state="idle") for n in ns))
    (act,) = [a for a in decide(d, o, cfg) if isinstance(a, SetDesired)]
    assert act.state.phase is Phase.LAUNCH
    return act.state


def test_the_first_launch_fixes_the_jobs_precision_and_a_replan_asks_for_it() -> None:
    d = _launched(CFG, ("A100-40",))
    assert d.job_precision == "bf16"
    running = d.model_copy(update={"phase": Phase.RUNNING})
    ns = {"n0": _node(0), "n1": _node(1)}
    o = _obs(ns, AgentStatus(node_id="n0", generation=d.generation, state="running", step=5))
    replans = [a for a in decide(running, o, CFG) if isinstance(a, Replan)]
    assert replans and all(r.precision == "bf16" for r in replans)
    # a V100 (no bf16 units) joining instead waits outside the job: no replan at all
    # (runtime_admission; test_node_runtime_admission.py)
    ns = {"n0": _node(0), "n1": _node(1, "V100-16")}
    o = _obs(ns, AgentStatus(node_id="n0", generation=d.generation, state="running", step=5))
    assert not [a for a in decide(running, o, CFG) if isinstance(a, Replan)]


def test_a_forced_precision_is_the_jobs_from_the_first_plan_on() -> None:
    train = TrainingConfig(model=BuiltinModel(name="tiny-gpt"), precision="fp32")
    cfg = CFG.model_copy(update={"training": train})
    d = DesiredState(epoch=7)
    o = _obs({"n0": _node(0)}, AgentStatus(node_id="n0", state="idle"))
    (replan,) = [a for a in decide(d, o, cfg) if isinstance(a, Replan)]
    assert replan.precision == "fp32"


def test_a_next_plan_in_another_precision_is_never_launched() -> None:
    """A plan made before the job's precision was fixed (fp16: a V100 in it) is dropped and
    planned again in the job's (bf16), not launched."""
    ns = {"n0": _node(0), "n1": _node(1, "V100-16")}
    res = DataParallelPlanner("m", 4, 8).plan(tuple(ns.values()), None)
    assert res.plan.precision == "fp16"
    d = DesiredState(
        epoch=7,
        job_precision="bf16",
        next_plan=res.plan,
        next_placement=res.placement,
        next_membership=("n0", "n1"),
    )
    o = _obs(ns, *(AgentStatus(node_id=n, state="idle") for n in ns))
    acts = decide(d, o, CFG)
    assert not any(isinstance(a, SetDesired) and a.state.phase is Phase.LAUNCH for a in acts)
    (replan,) = [a for a in acts if isinstance(a, Replan)]
    assert replan.precision == "bf16"
    # and the launch itself refuses it (a next plan adopted from online calibration's advice
    # or a planner that ignored the precision): dropped, planned again
    from sailor.controller.launch import launch_next

    acts = launch_next(d, o, CFG, -1)
    (drop,) = [a for a in acts if isinstance(a, SetDesired)]
    assert drop.state.phase is Phase.IDLE and drop.state.next_plan is None
    assert "precision='fp16'" in drop.reason and "the job's is 'bf16'" in drop.reason
    assert [a.precision for a in acts if isinstance(a, Replan)] == ["bf16"]


def test_a_forced_change_takes_over_only_when_allowed() -> None:
    d = DesiredState(epoch=7, job_precision="bf16")
    o = _obs({"n0": _node(0)}, AgentStatus(node_id="n0", state="idle"))
    train = TrainingConfig(model=BuiltinModel(name="tiny-gpt"), precision="fp32")
    kept = decide(d, o, CFG.model_copy(update={"training": train}))
    # not allowed: held with the reason (what to set), nothing planned meanwhile
    assert not [a for a in kept if isinstance(a, Replan)]
    (held,) = [a for a in kept if isinstance(a, SetDesired)]
    assert "allow_precision_change" in held.state.cause
    allowed = train.model_copy(update={"allow_precision_change": True})
    changed = decide(d, o, CFG.model_copy(update={"training": allowed}))
    assert [a.precision for a in changed if isinstance(a, Replan)] == ["fp32"]


# -- the worker -------------------------------------------------------------------------------


def _plan(*kinds: str, precision: str | None) -> Plan:
    pipes = tuple(
        Pipeline(
            stages=(
                Stage(first_layer=0, last_layer=5, replica=ReplicaGroup(gpu_type=g, zone="z-a-1")),
            ),
            microbatch_size=1,
            num_microbatches=8 // len(kinds),
        )
        for g in kinds
    )
    return Plan(model="tiny-gpt", global_batch_size=8, pipelines=pipes, precision=precision)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("plan", "requested", "match"),
    [
        # bf16 forced by the config on a plan with a V100: refused on every rank, not only
        # on the V100's after init_process_group
        (
            _plan("A100-40", "V100-16", precision=None),
            "bf16",
            r"plan\.pipelines\[1\]\.stages\[0\]\.replica\.gpu_type='V100-16'.*precision='bf16'",
        ),
        # a plan recorded in another precision than the job's
        (_plan("A100-40", precision="fp16"), "bf16", r"plan\.precision='fp16'.*precision='bf16'"),
    ],
)
def test_the_worker_refuses_before_any_collective(
    plan: Plan, requested: str, match: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sailor.megatron_patch import rank_main
    from sailor.megatron_patch.boundary import Status
    from sailor.megatron_patch.rank_args import build_parser

    def init(*_a: object, **_k: object) -> None:
        raise AssertionError("init_process_group reached")

    monkeypatch.setattr(rank_main.dist, "init_process_group", init)
    (tmp_path / "plan.json").write_text(plan.model_dump_json())
    tc = TrainingConfig(model=BuiltinModel(name="tiny-gpt"), precision=requested)  # type: ignore[arg-type]
    (tmp_path / "training.json").write_text(json.dumps(tc.model_dump(mode="json")))
    argv = [
        "--plan",
        str(tmp_path / "plan.json"),
        "--rank",
        "0",
        "--world-size",
        str(plan.num_gpus),
        "--master",
        "127.0.0.1:1",
        "--backend",
        "gloo",
        "--train-config",
        str(tmp_path / "training.json"),
    ]
    args: argparse.Namespace = build_parser().parse_args(argv)
    with pytest.raises(ValueError, match=match):
        rank_main.run(args, Status())


def test_a_forced_precision_leaves_out_what_cannot_run_it_before_any_launch() -> None:
    """A job forced to bf16 on a pool of A100s and V100s: before any launch the V100 is not
    admitted (the reason in not_admitted), so the first plan is asked of the A100 alone; on a
    pool of V100s alone nothing is asked (no Replan every pass that the planner refuses)."""
    from sailor.controller.decide import not_admitted
    from sailor.controller.job_precision import job_precision

    train = TrainingConfig(model=BuiltinModel(name="tiny-gpt"), precision="bf16")
    cfg = CFG.model_copy(update={"training": train})
    d = DesiredState(epoch=7)
    ns = {"n0": _node(0), "n1": _node(1, "V100-16")}
    o = _obs(ns, *(AgentStatus(node_id=n, state="idle") for n in ns))
    replans = [a for a in decide(d, o, cfg) if isinstance(a, Replan)]
    assert replans and all([x.node_id for x in r.nodes] == ["n0"] for r in replans)
    why = not_admitted(d, o, precision=job_precision(d, train))
    assert set(why) == {"n1"} and "no bf16 units" in why["n1"]
    only = {"n1": _node(1, "V100-16")}
    o = _obs(only, AgentStatus(node_id="n1", state="idle"))
    assert not [a for a in decide(d, o, cfg) if isinstance(a, Replan)]


def test_a_forced_precision_against_the_recorded_one_holds_the_job_with_the_reason() -> None:
    """A config forcing fp16 on a job recorded in bf16, without allow_precision_change: no
    launch (every rank would refuse it, each refusal a job failure retried with backoff);
    IDLE, the cause says what to set, written once; the launch goes on once the config
    says bf16 (or auto) again."""
    ns = {"n0": _node(0)}
    res = DataParallelPlanner("m", 4, 8).plan(tuple(ns.values()), None, "bf16")
    d = DesiredState(
        epoch=7,
        job_precision="bf16",
        next_plan=res.plan,
        next_placement=res.placement,
        next_membership=("n0",),
    )
    o = _obs(ns, AgentStatus(node_id="n0", state="idle"))
    train = TrainingConfig(model=BuiltinModel(name="tiny-gpt"), precision="fp16")
    cfg = CFG.model_copy(update={"training": train})
    acts = decide(d, o, cfg)
    assert not any(isinstance(a, SetDesired) and a.state.phase is Phase.LAUNCH for a in acts)
    (held,) = [a for a in acts if isinstance(a, SetDesired)]
    assert held.state.phase is Phase.IDLE and held.state.cause == held.reason
    assert "precision='fp16'" in held.reason and "'bf16'" in held.reason
    assert "set precision: bf16" in held.reason and "allow_precision_change" in held.reason
    assert decide(held.state, o, cfg) == []  # held, and not written again each pass
    auto = CFG.model_copy(update={"training": train.model_copy(update={"precision": "auto"})})
    cleared, go = [a for a in decide(held.state, o, auto) if isinstance(a, SetDesired)]
    assert cleared.state.cause == "" and cleared.reason == "no longer held"
    assert go.state.phase is Phase.LAUNCH and go.state.job_precision == "bf16"
    assert go.state.cause == ""  # the launch does not carry the hold's reason


def test_a_teardown_under_a_contradicting_config_ends_in_idle_not_a_launch() -> None:
    from sailor.controller.launch import launch_next

    ns = {"n0": _node(0)}
    res = DataParallelPlanner("m", 4, 8).plan(tuple(ns.values()), None, "bf16")
    d = DesiredState(
        epoch=7,
        phase=Phase.TEARDOWN,
        job_precision="bf16",
        plan=res.plan,
        placement=res.placement,
        membership=("n0",),
        next_plan=res.plan,
        next_placement=res.placement,
        next_membership=("n0",),
    )
    o = _obs(ns, AgentStatus(node_id="n0", state="idle"))
    train = TrainingConfig(model=BuiltinModel(name="tiny-gpt"), precision="fp32")
    (held,) = launch_next(d, o, CFG.model_copy(update={"training": train}), -1)
    assert isinstance(held, SetDesired) and held.state.phase is Phase.IDLE
    assert held.state.plan is None and held.state.next_plan == res.plan
