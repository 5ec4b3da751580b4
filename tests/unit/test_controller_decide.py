"""Table tests of the controller's pure decision and its state machine."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from sailor.controller.checkpointing import prune_below
from sailor.controller.decide import decide
from sailor.controller.decision_types import (
    ClearNotice,
    ClearReadmit,
    Commit,
    DecideConfig,
    Observed,
    RecalibrationAdvice,
    Replan,
    Send,
    SetDesired,
)
from sailor.controller.node_health import held
from sailor.controller.phases import LEGAL, check_transition
from sailor.controller.planning import DataParallelPlanner
from sailor.megatron_patch.errors import outlived_kill_record
from sailor.schemas.commands import Command, CommandAdapter, Launch, plan_digest, training_digest
from sailor.schemas.hardware import NodeSpec
from sailor.schemas.runtime import (
    AgentStatus,
    CommitRecord,
    DesiredState,
    NodeHealth,
    NoticeRecord,
    Phase,
    ReadmitRequest,
)
from sailor.schemas.training import BuiltinModel, TrainingConfig

CFG = DecideConfig(checkpoint_dir="/ck", stop_ahead_steps=2, notice_margin_s=5)
NOW = 1000.0


def node(i: int) -> NodeSpec:
    return NodeSpec(node_id=f"n{i}", gpu_type="A100-40", gpus=1, zone="z-a-1", address="h")


def nodes(*ids: int) -> dict[str, NodeSpec]:
    return {f"n{i}": node(i) for i in ids}


def running(ids: tuple[int, ...], gen: int = 1, step: int = 10, **kw: object) -> DesiredState:
    res = DataParallelPlanner("m", 4, 8).plan(tuple(node(i) for i in ids), None)
    base = DesiredState(
        epoch=7,
        generation=gen,
        phase=Phase.RUNNING,
        plan=res.plan,
        placement=res.placement,
        membership=tuple(sorted(f"n{i}" for i in ids)),
    )
    return base.model_copy(update=kw)


def st(
    i: int, gen: int = 1, state: str = "running", step: int = 10, saved: int = -1
) -> AgentStatus:
    return AgentStatus(
        node_id=f"n{i}",
        generation=gen,
        state=state,
        step=step,
        saved_step=saved,  # type: ignore[arg-type]
    )


def obs(ns: dict[str, NodeSpec], statuses: list[AgentStatus], **kw: object) -> Observed:
    return Observed(now=NOW, nodes=ns, status={s.node_id: s for s in statuses}, **kw)  # type: ignore[arg-type]


def kinds(actions: list[object]) -> list[str]:
    out = []
    for a in actions:
        if isinstance(a, SetDesired):
            out.append(f"set:{a.state.phase.value}")
        elif isinstance(a, Send):
            out.append(f"send:{a.command.kind}:{a.command.node_id}")
        else:
            out.append(type(a).__name__.lower())
    return out


def test_steady_state_does_nothing() -> None:
    assert decide(running((1, 2)), obs(nodes(1, 2), [st(1), st(2)]), CFG) == []


def test_idle_with_nodes_replans_then_launches() -> None:
    d = DesiredState(epoch=7)
    a = decide(d, obs(nodes(1), []), CFG)
    assert kinds(a) == ["replan"]
    res = DataParallelPlanner("m", 4, 8).plan((node(1),), None)
    d2 = d.model_copy(
        update={"next_plan": res.plan, "next_placement": res.placement, "next_membership": ("n1",)}
    )
    assert decide(d2, obs(nodes(1), []), CFG) == []  # n1's agent has written no status yet
    a = decide(d2, obs(nodes(1), [st(1, gen=-1, state="idle")]), CFG)
    assert kinds(a) == ["set:launch"]
    new = a[0].state  # type: ignore[union-attr]
    assert new.generation == 1 and new.load_step == -1 and new.master == "h:29501"


def test_idle_launch_loads_latest_commit() -> None:
    res = DataParallelPlanner("m", 4, 8).plan((node(1),), None)
    d = DesiredState(
        epoch=7, next_plan=res.plan, next_placement=res.placement, next_membership=("n1",)
    )
    commits = (CommitRecord(step=4, directory="/ck"), CommitRecord(step=9, directory="/ck"))
    a = decide(d, obs(nodes(1), [st(1, gen=-1, state="idle")], commits=commits), CFG)
    assert a[0].state.load_step == 9  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("ns", "notices", "expect", "why"),
    [
        (nodes(1, 2, 3), {}, ["set:quiesce", "replan"], "join"),
        (
            nodes(1, 2),
            {"n2": NoticeRecord(node_id="n2", deadline=NOW + 30)},
            ["set:quiesce", "replan"],
            "notice",
        ),
        (nodes(1), {}, ["set:teardown"], "lost"),
    ],
)
def test_running_reacts(
    ns: dict[str, NodeSpec], notices: dict[str, NoticeRecord], expect: list[str], why: str
) -> None:
    a = decide(running((1, 2)), obs(ns, [st(1), st(2, step=12)], notices=notices), CFG)
    assert kinds(a) == expect, why
    new = a[0].state  # type: ignore[union-attr]
    if why == "notice":
        assert new.stop_step == 14 and new.phase_deadline == NOW + 25
    if why == "lost":
        assert new.aborted and new.load_step == -1


def test_running_worker_failure_aborts_to_last_commit() -> None:
    a = decide(
        running((1,)),
        obs(nodes(1), [st(1, state="failed")], commits=(CommitRecord(step=5, directory="/ck"),)),
        CFG,
    )
    assert kinds(a) == ["set:teardown"] and a[0].state.load_step == 5  # type: ignore[union-attr]


def test_an_unreadable_checkpoint_is_not_loaded_again() -> None:
    """A launch whose worker cannot read the checkpoint (corrupt or gone) falls back to the
    newest other recorded commit; before, every relaunch loaded the same step and failed
    the same way, forever. Its retention no longer counts that step either."""
    commits = (CommitRecord(step=5, directory="/ck"), CommitRecord(step=9, directory="/ck"))
    record = '{"rank": 0, "origin": "local", "error_type": "CorruptCheckpointError", ...}'
    failed = st(1, state="failed").model_copy(update={"failure": record})
    d = running((1,), phase=Phase.LOAD, load_step=9, phase_deadline=NOW + 50)
    a = decide(d, obs(nodes(1), [failed], commits=commits), CFG)
    assert kinds(a) == ["set:teardown"], a
    torn = a[0].state  # type: ignore[union-attr]
    assert torn.bad_checkpoints == (9,) and torn.load_step == 5
    assert "checkpoint 9 unreadable" in torn.cause
    # the idle launch after it loads step 5 as well, and the next save keeps step 5
    idle = torn.model_copy(
        update={
            "phase": Phase.IDLE,
            "next_plan": d.plan,
            "next_placement": d.placement,
            "next_membership": ("n1",),
        }
    )
    a = decide(idle, obs(nodes(1), [st(1, state="idle")], commits=commits), CFG)
    assert kinds(a) == ["set:launch"] and a[0].state.load_step == 5  # type: ignore[union-attr]
    assert prune_below(commits, "/ck", 1, bad=(9,)) == 5
    # any other failure while loading relaunches from the same step, as before
    other = st(1, state="failed").model_copy(update={"failure": "rank 0: NCCL timeout"})
    a = decide(d, obs(nodes(1), [other], commits=commits), CFG)
    assert a[0].state.load_step == 9 and a[0].state.bad_checkpoints == ()  # type: ignore[union-attr]


def test_quiesce_sends_stop_and_checkpoint_once_acked() -> None:
    d = running((1,), phase=Phase.QUIESCE, stop_step=12, phase_deadline=NOW + 10, next_plan=None)
    a = decide(d, obs(nodes(1), [st(1, step=11)]), CFG)
    assert kinds(a) == ["send:stop:n1", "send:checkpoint:n1", "replan"]
    acked = frozenset(s.command.command_id for s in a if isinstance(s, Send))
    a = decide(d, obs(nodes(1), [st(1, step=12)], acked=acked), CFG)
    assert kinds(a) == ["replan", "set:checkpoint"]


def test_checkpoint_commit_teardown_launch_verify_running() -> None:
    d = running((1,), phase=Phase.CHECKPOINT, stop_step=12, phase_deadline=NOW + 10)
    res = DataParallelPlanner("m", 4, 8).plan((node(1), node(2)), None)
    d = d.model_copy(
        update={
            "next_plan": res.plan,
            "next_placement": res.placement,
            "next_membership": ("n1", "n2"),
        }
    )
    ns = nodes(1, 2)
    a = decide(d, obs(ns, [st(1, step=12, saved=12, state="stopped")]), CFG)
    # not yet acked in this epoch: the commands are sent again (idempotent), and it moves on
    assert kinds(a) == ["send:stop:n1", "send:checkpoint:n1", "set:commit"]
    d = a[-1].state  # type: ignore[union-attr]
    a = decide(d, obs(ns, [st(1, step=12, saved=12, state="stopped")]), CFG)
    assert kinds(a) == ["commit", "set:teardown"]
    assert isinstance(a[0], Commit) and a[0].record.step == 12
    d = a[1].state  # type: ignore[union-attr]
    a = decide(d, obs(ns, [st(1, state="stopped")]), CFG)
    assert kinds(a) == ["send:abort:n1"]
    # n2 registered, its status not seen yet: no launch to it (see the next test)
    assert decide(d, obs(ns, [st(1, state="idle")]), CFG) == []
    a = decide(d, obs(ns, [st(1, state="idle"), st(2, gen=-1, state="idle")]), CFG)
    assert kinds(a) == ["set:launch"]
    d = a[0].state  # type: ignore[union-attr]
    assert d.generation == 2 and d.load_step == 12 and sorted(d.placement) == ["n1", "n2"]
    a = decide(d, obs(ns, []), CFG)
    assert kinds(a) == ["send:launch:n1", "send:launch:n2"]
    launch = a[0].command  # type: ignore[union-attr]
    assert launch.load_step == 12 and launch.checkpoint == "/ck" and launch.world_size == 2
    acked = frozenset(x.command.command_id for x in a if isinstance(x, Send))
    a = decide(d, obs(ns, [], acked=acked), CFG)
    assert kinds(a) == ["set:load"]
    d = a[0].state  # type: ignore[union-attr]
    a = decide(d, obs(ns, [st(1, gen=2, step=-1), st(2, gen=2, step=-1)]), CFG)
    assert kinds(a) == ["set:verify"]
    d = a[0].state  # type: ignore[union-attr]
    assert decide(d, obs(ns, [st(1, gen=2, step=12), st(2, gen=2, step=13)]), CFG) == []
    a = decide(d, obs(ns, [st(1, gen=2, step=13), st(2, gen=2, step=13)]), CFG)
    assert kinds(a) == ["set:running"]


def test_deadline_or_node_loss_in_transition_aborts() -> None:
    d = running((1, 2), phase=Phase.QUIESCE, stop_step=12, phase_deadline=NOW - 1)
    a = decide(d, obs(nodes(1, 2), [st(1), st(2)]), CFG)
    assert kinds(a) == ["set:teardown"] and "deadline" in a[0].state.cause  # type: ignore[union-attr]
    d = running((1, 2), phase=Phase.LOAD, phase_deadline=NOW + 50)
    a = decide(d, obs(nodes(1), [st(1)]), CFG)
    assert kinds(a) == ["set:teardown"] and a[0].state.aborted  # type: ignore[union-attr]


def test_second_notice_tightens_deadline() -> None:
    d = running((1, 2), phase=Phase.CHECKPOINT, stop_step=12, phase_deadline=NOW + 20)
    notices = {"n2": NoticeRecord(node_id="n2", deadline=NOW + 10)}
    a = decide(d, obs(nodes(1, 2), [st(1), st(2)], notices=notices), CFG)
    assert kinds(a) == ["set:checkpoint"] and a[0].state.phase_deadline == NOW + 5  # type: ignore[union-attr]


def test_teardown_clears_notices_of_gone_nodes_and_goes_idle_without_nodes() -> None:
    d = running((1,), phase=Phase.TEARDOWN, phase_deadline=NOW + 10)
    notices = {"n1": NoticeRecord(node_id="n1", deadline=NOW)}
    a = decide(d, obs({}, [], notices=notices), CFG)
    assert kinds(a) == ["clearnotice", "set:idle"] and isinstance(a[0], ClearNotice)


def test_teardown_after_abort_plans_while_workers_are_torn_down() -> None:
    d = running((1, 2), phase=Phase.TEARDOWN, phase_deadline=NOW + 10)
    a = decide(d, obs(nodes(1), [st(1, state="running")]), CFG)
    assert kinds(a) == ["send:abort:n1", "replan"]
    res = DataParallelPlanner("m", 4, 8).plan((node(1),), None)
    planned = d.model_copy(
        update={
            "next_plan": res.plan,
            "next_placement": res.placement,
            "next_membership": ("n1",),
        }
    )
    # planned, but a worker still runs: no launch yet, and no second plan
    assert kinds(decide(planned, obs(nodes(1), [st(1, state="running")]), CFG)) == ["send:abort:n1"]
    assert kinds(decide(planned, obs(nodes(1), [st(1, state="idle")]), CFG)) == ["set:launch"]


def test_stale_generation_status_is_ignored() -> None:
    d = running((1,), gen=3, phase=Phase.LOAD, phase_deadline=NOW + 10)
    assert decide(d, obs(nodes(1), [st(1, gen=2)]), CFG) == []


def test_transition_table() -> None:
    check_transition(Phase.RUNNING, Phase.QUIESCE)
    for p in Phase:
        if p is not Phase.IDLE:
            check_transition(p, Phase.TEARDOWN)
    with pytest.raises(ValueError, match="running -> launch"):
        check_transition(Phase.RUNNING, Phase.LAUNCH)
    with pytest.raises(ValueError):
        check_transition(Phase.IDLE, Phase.TEARDOWN)
    assert set(LEGAL) == set(Phase)


def test_replan_carries_previous_plan() -> None:
    d = running((1,))
    a = decide(d, obs(nodes(1, 2), [st(1)]), CFG)
    rp = next(x for x in a if isinstance(x, Replan))
    assert rp.previous == d.plan and [n.node_id for n in rp.nodes] == ["n1", "n2"]


def test_a_node_back_long_after_its_notice_is_usable_again() -> None:
    d = running((1,))
    ns = nodes(1, 2)  # n2 got a notice, was left out, and is registered again (same id)
    recent = {"n2": NoticeRecord(node_id="n2", deadline=NOW - 30)}
    assert decide(d, obs(ns, [st(1)], notices=recent), CFG) == []
    old = {"n2": NoticeRecord(node_id="n2", deadline=NOW - CFG.notice_expiry_s - 1)}
    a = decide(d, obs(ns, [st(1)], notices=old), CFG)
    assert isinstance(a[0], ClearNotice) and a[0].node_id == "n2"
    assert kinds(a)[1:] == kinds(decide(d, obs(ns, [st(1)]), CFG)) != []


def test_commands_built_without_validation_are_valid_commands() -> None:
    """decide builds commands from the desired state's values without re-validating them:
    each must still be exactly what validating it would give (the agent validates it)."""
    res = DataParallelPlanner("m", 4, 8).plan((node(1), node(2)), None)
    ns = nodes(1, 2)
    sent: list[Command] = []
    d = running((1, 2), phase=Phase.QUIESCE, stop_step=12, phase_deadline=NOW + 10)
    sent += [a.command for a in decide(d, obs(ns, []), CFG) if isinstance(a, Send)]
    d = running((1, 2), phase=Phase.TEARDOWN, phase_deadline=NOW + 10, cause="x" * 300)
    sent += [a.command for a in decide(d, obs(ns, [st(1), st(2)]), CFG) if isinstance(a, Send)]
    for load in (-1, 12):
        d = running(
            (1, 2),
            gen=2,
            phase=Phase.LAUNCH,
            phase_deadline=NOW + 10,
            plan=res.plan,
            placement=res.placement,
            load_step=load,
            master="h:29502",
        )
        sent += [a.command for a in decide(d, obs(ns, []), CFG) if isinstance(a, Send)]
    assert sorted({c.kind for c in sent}) == ["abort", "checkpoint", "launch", "stop"]
    assert len(sent) == 10
    for cmd in sent:
        assert CommandAdapter.validate_json(CommandAdapter.dump_json(cmd)) == cmd
        if isinstance(cmd, Launch):
            assert cmd.plan_sha256 == plan_digest(res.plan) and cmd.world_size == 2


def test_launch_digest_follows_the_plan() -> None:
    """The digest is remembered per plan object: another plan gets its own."""
    ns = nodes(1, 2)
    for ids in ((1, 2), (1,), (1, 2)):
        res = DataParallelPlanner("m", 4, 8).plan(tuple(node(i) for i in ids), None)
        d = running(ids, gen=2, phase=Phase.LAUNCH, phase_deadline=NOW + 10, master="h:1")
        d = d.model_copy(update={"plan": res.plan, "placement": res.placement})
        for _ in range(2):
            cmds = [a.command for a in decide(d, obs(ns, []), CFG) if isinstance(a, Send)]
            assert [c.plan_sha256 for c in cmds] == [plan_digest(res.plan)] * len(ids)  # type: ignore[union-attr]
            assert [c.world_size for c in cmds] == [res.plan.num_gpus] * len(ids)  # type: ignore[union-attr]


def test_launch_names_the_training_config_of_its_generation() -> None:
    """A launch puts the configured training config into the desired state and names it by
    digest in every Launch; a generation keeps the config it was launched with."""
    training = TrainingConfig(model=BuiltinModel(name="tiny-gpt"), seed=3)
    cfg = CFG.model_copy(update={"training": training})
    res = DataParallelPlanner("m", 4, 8).plan((node(1), node(2)), None)
    d = DesiredState(
        epoch=7, next_plan=res.plan, next_placement=res.placement, next_membership=("n1", "n2")
    )
    idle = [st(1, gen=-1, state="idle"), st(2, gen=-1, state="idle")]
    launched = decide(d, obs(nodes(1, 2), idle), cfg)[0].state  # type: ignore[union-attr]
    assert launched.phase is Phase.LAUNCH and launched.training == training
    for c, want in ((cfg, training_digest(training)), (CFG, training_digest(training))):
        cmds = [a.command for a in decide(launched, obs(nodes(1, 2), []), c) if isinstance(a, Send)]
        assert [cmd.training_sha256 for cmd in cmds] == [want, want]  # type: ignore[union-attr]
        for cmd in cmds:
            assert CommandAdapter.validate_json(CommandAdapter.dump_json(cmd)) == cmd
    # no training config: none in the desired state, '' in the Launch
    plain = decide(d, obs(nodes(1, 2), idle), CFG)[0].state  # type: ignore[union-attr]
    assert plain.training is None
    cmds = [a.command for a in decide(plain, obs(nodes(1, 2), []), CFG) if isinstance(a, Send)]
    assert {cmd.training_sha256 for cmd in cmds} == {""}  # type: ignore[union-attr]


def _advice(gen: int = 1, members: tuple[str, ...] = ("n1", "n2")) -> RecalibrationAdvice:
    res = DataParallelPlanner("m", 4, 8).plan(tuple(node(int(n[1:])) for n in members[:1]), None)
    return RecalibrationAdvice(
        generation=gen,
        plan=res.plan,
        placement=res.placement,
        membership=members,
        cause="recalibration: v1 says so",
    )


def test_recalibration_verdict_quiesces_toward_its_plan_without_replanning() -> None:
    adv = _advice()
    a = decide(running((1, 2)), obs(nodes(1, 2), [st(1), st(2, step=12)], recalibration=adv), CFG)
    assert kinds(a) == ["set:quiesce"]
    new = a[0].state  # type: ignore[union-attr]
    assert new.cause.startswith("recalibration") and new.stop_step == 14
    assert new.next_plan == adv.plan and new.next_membership == ("n1", "n2")
    # the quiesce that follows sends Stop/Checkpoint but does not plan again
    a = decide(new, obs(nodes(1, 2), [st(1), st(2, step=12)], recalibration=adv), CFG)
    assert "replan" not in kinds(a) and kinds(a)[0] == "send:stop:n1"


@pytest.mark.parametrize(
    ("adv", "ns", "why"),
    [
        (_advice(gen=0), nodes(1, 2), "decided for another generation"),
        (_advice(members=("n1", "n2", "n3")), nodes(1, 2), "made for other nodes"),
        (_advice(), nodes(1, 2, 3), "a join goes first (and replans with the calibration)"),
    ],
)
def test_recalibration_verdict_that_no_longer_applies_is_ignored(
    adv: RecalibrationAdvice, ns: dict[str, NodeSpec], why: str
) -> None:
    a = decide(running((1, 2)), obs(ns, [st(1), st(2)], recalibration=adv), CFG)
    if len(ns) == 3:
        assert kinds(a) == ["set:quiesce", "replan"], why
        assert a[0].state.cause.startswith("nodes joined")  # type: ignore[union-attr]
    else:
        assert a == [], why


# --- in-place reconfiguration -------------------------------------------------------------

IN_PLACE = CFG.model_copy(update={"in_place": True})


def _planned(d: DesiredState, ids: tuple[int, ...]) -> DesiredState:
    res = DataParallelPlanner("m", 4, 8).plan(tuple(node(i) for i in ids), None)
    return d.model_copy(
        update={
            "next_plan": res.plan,
            "next_placement": res.placement,
            "next_membership": tuple(f"n{i}" for i in ids),
        }
    )


def _spare_st(i: int, spares: int, wanted: int = 1) -> AgentStatus:
    return st(i, gen=-1, state="idle").model_copy(
        update={"spares": spares, "spares_wanted": wanted}
    )


def test_in_place_teardown_keeps_held_workers_and_launches_them_in_place() -> None:
    d = _planned(running((1, 2, 3), phase=Phase.TEARDOWN, load_step=12), (1, 2))
    ns = nodes(1, 2, 3)
    gone = {"n3": NoticeRecord(node_id="n3", deadline=NOW + 30)}  # n3 is being reclaimed
    # held workers are not aborted; a running one is asked to hold; held ones the next
    # layout has no rank for (n3) are let go
    a = decide(
        d,
        obs(ns, [st(1, state="held"), st(2, state="running"), st(3, state="held")], notices=gone),
        IN_PLACE,
    )
    sends = [x.command for x in a if isinstance(x, Send)]
    assert [(c.kind, c.node_id, c.hold) for c in sends] == [  # type: ignore[union-attr]
        ("abort", "n2", True),
        ("abort", "n3", False),
    ]
    assert "set:launch" not in kinds(a)  # n2 still running
    a = decide(
        d,
        obs(ns, [st(1, state="held"), st(2, state="held"), st(3, state="held")], notices=gone),
        IN_PLACE,
    )
    assert kinds(a)[-1] == "set:launch"
    nxt = a[-1].state  # type: ignore[union-attr]
    assert nxt.path == "in_place" and "in place" in nxt.path_reason
    launches = [x.command for x in decide(nxt, obs(ns, []), IN_PLACE) if isinstance(x, Send)]
    assert launches and all(isinstance(c, Launch) and c.in_place for c in launches)
    # without in_place the same teardown kills every worker and restarts
    a = decide(
        d,
        obs(ns, [st(1, state="held"), st(2, state="running"), st(3, state="idle")], notices=gone),
        CFG,
    )
    assert [(x.command.node_id, x.command.hold) for x in a if isinstance(x, Send)] == [  # type: ignore[union-attr]
        ("n1", False),
        ("n2", False),
    ]


def test_a_failed_in_place_launch_falls_back_to_restart_once() -> None:
    d = running((1, 2), phase=Phase.LOAD, phase_deadline=NOW - 1, path="in_place")
    a = decide(d, obs(nodes(1, 2), [st(1), st(2, state="idle")]), IN_PLACE)
    torn = a[0].state  # type: ignore[union-attr]
    assert torn.phase is Phase.TEARDOWN and torn.in_place_failed
    # the fallback kills held workers instead of keeping them, then restarts
    planned = _planned(torn, (1, 2))
    a = decide(planned, obs(nodes(1, 2), [st(1, state="held"), st(2, state="idle")]), IN_PLACE)
    assert [(x.command.node_id, x.command.hold) for x in a if isinstance(x, Send)] == [
        ("n1", False)
    ]  # type: ignore[union-attr]
    a = decide(planned, obs(nodes(1, 2), [st(1, state="idle"), st(2, state="idle")]), IN_PLACE)
    nxt = a[-1].state  # type: ignore[union-attr]
    assert nxt.path == "restart" and "fallback" in nxt.path_reason
    assert not any(
        x.command.in_place
        for x in decide(nxt, obs(nodes(1, 2), []), IN_PLACE)
        if isinstance(x, Send)
    )  # type: ignore[union-attr]
    # once it runs, the next launch is in place again
    verify = nxt.model_copy(update={"phase": Phase.VERIFY, "phase_deadline": NOW + 10})
    a = decide(verify, obs(nodes(1, 2), [st(1, gen=2, step=13), st(2, gen=2, step=13)]), IN_PLACE)
    assert a[0].state.phase is Phase.RUNNING and not a[0].state.in_place_failed  # type: ignore[union-attr]
    # an abort of a restart launch is no failure of the in-place path
    d = running((1, 2), phase=Phase.LOAD, phase_deadline=NOW - 1, path="restart")
    assert not decide(d, obs(nodes(1, 2), [st(1), st(2)]), IN_PLACE)[0].state.in_place_failed  # type: ignore[union-attr]


def test_a_second_restart_after_a_fallback_says_the_restart_failed_too() -> None:
    """The restart after a fallback's own abort stays on the restart path (no generation ran
    since the in-place launch failed) and says so: it said "the in-place launch of
    generation G failed" of a G that was itself a restart (seen after a taken rendezvous
    port, tests/integration/test_runtime_rendezvous_port.py, before that was no failure)."""
    d = running((1, 2), gen=3, phase=Phase.LOAD, phase_deadline=NOW - 1, path="restart")
    d = d.model_copy(update={"in_place_failed": True})
    stalled = [st(1, gen=3), st(2, gen=3, state="idle")]  # n2 never came up: the deadline
    torn = decide(d, obs(nodes(1, 2), stalled), IN_PLACE)[0].state  # type: ignore[union-attr]
    assert torn.phase is Phase.TEARDOWN and torn.in_place_failed
    planned = _planned(torn, (1, 2))
    a = decide(planned, obs(nodes(1, 2), [st(1, state="idle"), st(2, state="idle")]), IN_PLACE)
    nxt = a[-1].state  # type: ignore[union-attr]
    assert nxt.path == "restart" and nxt.path_reason.startswith("fallback"), nxt.path_reason
    assert "generation 3 (restart) did not run either" in nxt.path_reason, nxt.path_reason
    assert "in-place launch of generation 3" not in nxt.path_reason


def test_an_in_place_launch_aborted_by_a_worker_quotes_its_error_not_its_record() -> None:
    """The abort's cause (and so the fallback's ``path_reason``) quotes the failure as
    ``error_type: message``: the first 200 characters of the JSON record were ~115 of keys,
    and the message was cut before it said why (the demo's in-place launch of a notice,
    its rank 0's rendezvous port taken: "... port: 11263" without "EADDRINUSE")."""
    message = (
        "The server socket has failed to listen on any local network address. port: 11263, "
        "useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use"
    )
    record = json.loads(_record("peer", message, "DistNetworkError"))
    record.update(step=28, last_step=28)  # as the worker writes it: keys before the message
    failed = st(2, state="failed").model_copy(update={"failure": json.dumps(record)})
    d = running((1, 2), phase=Phase.LOAD, phase_deadline=NOW + 60, path="in_place")
    a = decide(d, obs(nodes(1, 2), [st(1), failed]), IN_PLACE)
    torn = a[0].state  # type: ignore[union-attr]
    assert torn.phase is Phase.TEARDOWN and torn.in_place_failed
    assert torn.cause.startswith(
        "during load: worker failed on n2: DistNetworkError: The server socket"
    ), torn.cause
    assert "EADDRINUSE" in torn.cause and '"origin"' not in torn.cause, torn.cause


def test_in_place_join_waits_for_the_warm_spares() -> None:
    d = running((1,))
    ns = nodes(1, 2)
    assert decide(d, obs(ns, [st(1), _spare_st(2, spares=0)]), IN_PLACE) == []
    assert decide(d, obs(ns, [st(1)]), IN_PLACE) == []  # no status yet
    a = decide(d, obs(ns, [st(1), _spare_st(2, spares=1)]), IN_PLACE)
    assert kinds(a)[0] == "set:quiesce" and "n2" in a[0].state.cause  # type: ignore[union-attr]
    # an agent that keeps no spares is ready at once; without in_place nothing waits
    assert (
        kinds(decide(d, obs(ns, [st(1), _spare_st(2, 0, wanted=0)]), IN_PLACE))[0] == "set:quiesce"
    )
    assert kinds(decide(d, obs(ns, [st(1), _spare_st(2, spares=0)]), CFG))[0] == "set:quiesce"


def test_a_held_worker_whose_world_broke_aborts_the_layout() -> None:
    d = running((1, 2))
    broke = st(2, state="held").model_copy(update={"failure": "Connection closed by peer"})
    a = decide(d, obs(nodes(1, 2), [st(1), broke]), IN_PLACE)
    assert kinds(a) == ["set:teardown"] and "world broke on n2" in a[0].state.cause  # type: ignore[union-attr]


def test_no_launch_to_a_node_whose_status_vanished_with_its_lease() -> None:
    """A lost node's status and node keys go with its lease, but their watches report them
    apart: with the status gone and the node key still seen, the planned layout (made while
    the node was registered) must not launch, or it aborts at once during LAUNCH (in place:
    a failure of the in-place path, a fallback to restart for nothing)."""
    d = _planned(running((1, 2), phase=Phase.TEARDOWN, load_step=12), (1, 2))
    assert decide(d, obs(nodes(1, 2), [st(1, state="held")]), IN_PLACE) == []
    a = decide(d, obs(nodes(1), [st(1, state="held")]), IN_PLACE)
    assert kinds(a) == ["replan"]  # the node key's deletion arrives: plan without it


@pytest.mark.parametrize(
    ("steps", "keep", "expect"),
    [
        ((), 1, -1),  # nothing recorded: nothing to prune
        ((4,), 1, 4),  # the newest recorded stays beside the new save
        ((4, 9), 1, 9),
        ((4, 9), 2, 4),
        ((4, 9), 3, -1),
        ((4, 9, 15), 2, 9),
        ((4, 9, 15), None, -1),  # keep everything
    ],
)
def test_prune_below_keeps_the_newest_recorded_commits(
    steps: tuple[int, ...], keep: int | None, expect: int
) -> None:
    commits = tuple(CommitRecord(step=s, directory="/ck") for s in steps)
    # records of another directory (an earlier checkpoint_dir) do not count
    other = (CommitRecord(step=99, directory="/old"),)
    assert prune_below(commits + other, "/ck", keep) == expect


def test_a_save_prunes_older_checkpoints_and_the_commit_drops_their_records() -> None:
    cfg = CFG.model_copy(update={"keep_checkpoints": 2})
    commits = (
        *(CommitRecord(step=s, directory="/ck") for s in (3, 6, 9)),
        CommitRecord(step=1, directory="/old"),
    )
    d = running((1,), phase=Phase.QUIESCE, stop_step=12, phase_deadline=NOW + 10)
    # the saves given up on (an aborted CHECKPOINT of 15; 9 and 1: given up, then saved
    # again and recorded, in any directory; 12: the step being saved)
    d = d.model_copy(update={"drop_steps": (15, 9, 1, 12)})
    a = decide(d, obs(nodes(1), [st(1, step=11)], commits=commits), cfg)
    ckpt = next(x.command for x in a if isinstance(x, Send) and x.command.kind == "checkpoint")
    assert ckpt.prune_below == 6  # type: ignore[union-attr]
    # only the steps given up on, never a recorded one nor its own: its committer deletes
    # those it finds committed at or above 6
    assert ckpt.drop_steps == (15,)  # type: ignore[union-attr]
    # the wire form carries both to the agent
    wire = CommandAdapter.validate_json(ckpt.model_dump_json())
    assert wire.prune_below == 6 and wire.drop_steps == (15,)  # type: ignore[union-attr]
    d = d.model_copy(update={"phase": Phase.COMMIT})
    a = decide(d, obs(nodes(1), [st(1, step=12, saved=12, state="stopped")], commits=commits), cfg)
    # /old@1 goes too: below the retention of /ck (its files stay, outside the directory)
    assert isinstance(a[0], Commit) and a[0].record.step == 12 and a[0].drop == (1, 3)
    assert a[0].drop_steps == (15,)  # audited: what the save's committer was told to drop
    assert [x.state.drop_steps for x in a if isinstance(x, SetDesired)] == [()]  # carried
    # keep_checkpoints null keeps everything: no deletion of abandoned saves either
    keep_all = CFG.model_copy(update={"keep_checkpoints": None})
    quiesce = d.model_copy(update={"phase": Phase.QUIESCE})
    a = decide(quiesce, obs(nodes(1), [st(1, step=11)], commits=commits), keep_all)
    ckpt = next(x.command for x in a if isinstance(x, Send) and x.command.kind == "checkpoint")
    assert ckpt.prune_below == -1 and ckpt.drop_steps is None  # type: ignore[union-attr]
    # keep None: nothing pruned, nothing dropped
    a = decide(d, obs(nodes(1), [st(1, step=12)], commits=commits), keep_all)
    assert isinstance(a[0], Commit) and a[0].drop == ()


def test_a_checkpoint_command_may_not_prune_its_own_step() -> None:
    with pytest.raises(ValueError, match=r"prune_below=13.*step \(12\)"):
        CommandAdapter.validate_python(
            {
                "kind": "checkpoint",
                "command_id": "c",
                "epoch": 1,
                "node_id": "n1",
                "deadline": NOW,
                "step": 12,
                "directory": "/ck",
                "prune_below": 13,
            }
        )


@pytest.mark.parametrize(
    ("address", "host"),
    [
        ("10.0.0.7", "10.0.0.7"),
        ("10.0.0.7:22", "10.0.0.7"),
        ("fd00::17", "[fd00::17]"),
        ("[fd00::17]", "[fd00::17]"),
        ("[fd00::17]:22", "[fd00::17]"),
        ("", "127.0.0.1"),
    ],
)
def test_the_rendezvous_master_of_every_address_form(address: str, host: str) -> None:
    """The launch's master is the first placed node's host and the generation's port, for
    host, host:port, [v6], [v6]:port and a bare IPv6 address: a URL torch can parse
    (``tcp://fd00::17:29501`` is not one); a node without an address: loopback."""
    res = DataParallelPlanner("m", 4, 8).plan((node(1),), None)
    d = DesiredState(
        epoch=7, next_plan=res.plan, next_placement=res.placement, next_membership=("n1",)
    )
    ns = {"n1": node(1).model_copy(update={"address": address})}
    (a,) = decide(d, obs(ns, [st(1, gen=-1, state="idle")]), CFG)
    assert isinstance(a, SetDesired) and a.state.phase is Phase.LAUNCH
    assert a.state.master == f"{host}:29501"


# --- nodes whose workers keep failing (controller/node_health.py) --------------------------


def _record(origin: str, message: str = "boom", error_type: str = "RuntimeError") -> str:
    """A worker's error record as the agent reports it (megatron_patch/errors.py)."""
    return json.dumps(
        {
            "rank": 0,
            "step": -1,
            "origin": origin,
            "retry": origin != "config",
            "error_type": error_type,
            "message": message,
            "traceback": "Traceback ...",
        }
    )


def fails(i: int, origin: str = "local", gen: int = 1, message: str = "boom") -> AgentStatus:
    return st(i, gen=gen, state="failed").model_copy(
        update={"failure": _record(origin, message, "ValueError" if origin == "config" else "X")}
    )


def _replanned(a: list[object]) -> list[str]:
    (rp,) = [x for x in a if isinstance(x, Replan)]
    return [n.node_id for n in rp.nodes]


def test_a_config_failure_excludes_its_node_at_once_and_the_next_plan_leaves_it_out() -> None:
    """A failure whose record says retry false: no relaunch on that node (before, the next
    plan was made over every registered node and aborted the same way, forever); the peer
    that failed because of it is not at fault."""
    d = running((1, 2))
    bad = fails(2, "config", message="tp=3 does not divide 8 heads")
    a = decide(d, obs(nodes(1, 2), [fails(1, "peer"), bad]), CFG)
    assert kinds(a) == ["set:teardown"]
    torn, reason = a[0].state, a[0].reason  # type: ignore[union-attr]
    assert "worker failed on n2" in torn.cause  # the node it began on, not the peer n1
    assert set(torn.node_health) == {"n2"}
    rec = torn.node_health["n2"]
    assert rec.excluded_until == NOW + CFG.exclusion.exclude_s and rec.exclusions == 1
    assert "excluded n2 until" in reason and "retry false" in reason
    assert "tp=3 does not divide 8 heads" in reason and "600 s" in reason
    a = decide(torn, obs(nodes(1, 2), [st(1, state="idle"), st(2, state="idle")]), CFG)
    assert _replanned(a) == ["n1"]


def test_three_failures_in_a_row_on_one_node_exclude_it() -> None:
    health: dict[str, object] = {}
    for gen in (1, 2, 3):
        d = running((1, 2), gen=gen, node_health=health)
        a = decide(d, obs(nodes(1, 2), [st(1, gen=gen), fails(2, gen=gen)]), CFG)
        torn = a[0].state  # type: ignore[union-attr]
        health = torn.node_health
        assert health["n2"].failures == gen and health["n2"].generation == gen
        # the teardown that follows sees the same failed status: counted once
        late = decide(torn, obs(nodes(1, 2), [st(1, gen=gen), fails(2, gen=gen)]), CFG)
        assert "set:teardown" not in kinds(late) and "send:abort:n2" in kinds(late)
        if gen < 3:
            assert health["n2"].excluded_until == 0 and "excluded" not in a[0].reason  # type: ignore[union-attr]
    assert health["n2"].excluded_until == NOW + 600
    assert "excluded n2" in a[0].reason and "3 consecutive failures" in a[0].reason  # type: ignore[union-attr]
    a = decide(torn, obs(nodes(1, 2), [st(1, state="idle"), st(2, state="idle")]), CFG)
    assert _replanned(a) == ["n1"]


def _accusing(i: int, culprit: int, gen: int = 1) -> AgentStatus:
    """Node ``i``'s status once its worker failed of rank ``culprit``'s bytes that do not
    decode: a peer record naming that rank (``culprit``, as failure_record writes it)."""
    record = json.loads(_record("peer", f"rank {culprit} sent an object that does not decode"))
    failure = json.dumps({**record, "culprit": culprit})
    return st(i, gen=gen, state="failed").model_copy(update={"failure": failure})


def test_a_peers_bad_bytes_charge_the_senders_node_and_the_replan_leaves_it_out() -> None:
    """n4's rank sends its peers bytes that do not decode: n1 and n2 fail of them with
    origin peer naming that rank (``culprit``; an all_gather_object fails every receiver),
    n4 keeps running. Before, nobody was counted and n4 stayed in every layout; now n4 is
    counted each generation (the abort's reason names it, the rank and the reporter),
    excluded at the policy's third failure, and the next plan leaves it out. n1 and n2
    never are. A culprit that is no rank of the layout counts nothing."""
    health: dict[str, object] = {}
    ids = (1, 2, 3, 4)
    for gen in (1, 2, 3):
        d = running(ids, gen=gen, node_health=health)
        (culprit,) = d.placement["n4"]
        n1, n2 = _accusing(1, culprit, gen), _accusing(2, culprit, gen)
        a = decide(d, obs(nodes(*ids), [n1, n2, *(st(i, gen=gen) for i in ids[2:])]), CFG)
        torn, reason = a[0].state, a[0].reason  # type: ignore[union-attr]
        health = torn.node_health
        assert set(health) == {"n4"} and health["n4"].failures == gen, health
        assert f"PeerBlamed: rank {culprit} named guilty by n1" in reason, reason
    assert health["n4"].excluded_until == NOW + 600
    a = decide(torn, obs(nodes(*ids), [st(i, state="idle") for i in ids]), CFG)
    assert _replanned(a) == ["n1", "n2", "n3"]
    # forged: a rank past the layout's
    d = running(ids)
    forged = {**json.loads(_record("peer")), "culprit": 99}
    n1 = st(1, state="failed").model_copy(update={"failure": json.dumps(forged)})
    a = decide(d, obs(nodes(*ids), [n1, *(st(i) for i in ids[1:])]), CFG)
    torn, reason = a[0].state, a[0].reason  # type: ignore[union-attr]
    assert torn.node_health == {} and "culprit '99' named by n1 ignored" in reason, reason


def test_a_lone_accusers_charge_is_taken_back_when_a_later_teardown_pass_bears_it_out() -> None:
    """The abort comes at n1's report alone naming n4's rank: a dispute, n1 and n4 counted.
    The Abort clears n1's failure; n2's report of the same bytes comes in at a TEARDOWN
    pass: n1's count is taken back, n4's stays (the accusations of the generation are in
    the desired state, ``DesiredState.accusations``). Before, the abort counted n4 alone
    on n1's word."""
    ids = (1, 2, 3, 4)
    d = running(ids, gen=2)
    (culprit,) = d.placement["n4"]
    a = decide(d, obs(nodes(*ids), [_accusing(1, culprit, 2), *(st(i, 2) for i in ids[1:])]), CFG)
    torn, reason = a[0].state, a[0].reason  # type: ignore[union-attr]
    assert torn.phase is Phase.TEARDOWN and set(torn.node_health) == {"n1", "n4"}, reason
    assert f"PeerBlamed: rank {culprit} named guilty by n1 alone" in reason, reason
    assert torn.accusations.named == {"n1": "n4"}
    cleared = st(1, gen=2, state="idle")
    a = decide(torn, obs(nodes(*ids), [cleared, _accusing(2, culprit, 2), st(3, 2), st(4, 2)]), CFG)
    later, reason = a[0].state, a[0].reason  # type: ignore[union-attr]
    assert set(later.node_health) == {"n4"} and later.node_health["n4"].failures == 1, reason
    assert "taken back from n1: its accusation of n4 is borne out" in reason, reason
    assert later.accusations.named == {"n1": "n4", "n2": "n4"}


def test_an_in_place_world_broken_by_a_peers_bytes_charges_the_senders_node() -> None:
    """In-place workers hold (no error file) when a peer's bytes break their world: their
    status names the sender (``AgentStatus.culprit``), and the abort charges its node, not
    the holders'. Before, held nodes were never counted, nor was the sender."""
    ids = (1, 2, 3, 4)
    d = running(ids, gen=2, path="in_place")
    (culprit,) = d.placement["n4"]
    cause = f"PeerObjectError: rank {culprit} sent an object that does not decode: JSONDecodeError"
    held = [
        st(i, gen=2, state="held").model_copy(update={"failure": cause, "culprit": culprit})
        for i in (1, 2)
    ]
    a = decide(d, obs(nodes(*ids), [*held, st(3, gen=2), st(4, gen=2)]), CFG)
    torn, reason = a[0].state, a[0].reason  # type: ignore[union-attr]
    assert torn.phase is Phase.TEARDOWN and "worker world broke on n1" in torn.cause
    assert set(torn.node_health) == {"n4"}, torn.node_health
    assert f"PeerBlamed: rank {culprit} named guilty by n1: {cause}"[:80] in reason, reason
    # held of a world that broke of a dead peer (no culprit): nobody counted, as before
    plain = [
        st(i, gen=2, state="held").model_copy(update={"failure": "gloo: timeout"}) for i in (1, 2)
    ]
    a = decide(d, obs(nodes(*ids), [*plain, st(3, gen=2), st(4, gen=2)]), CFG)
    assert a[0].state.node_health == {}  # type: ignore[union-attr]


def test_peer_failures_do_not_count_and_unreadable_ones_do() -> None:
    d = running((1, 2))
    n2 = st(2, state="failed").model_copy(update={"failure": "rank 1 exit -9: Killed"})
    a = decide(d, obs(nodes(1, 2), [fails(1, "peer"), n2]), CFG)
    torn = a[0].state  # type: ignore[union-attr]
    assert set(torn.node_health) == {"n2"} and torn.node_health["n2"].failures == 1
    assert "worker failed on n2" in torn.cause
    # only the peer's report is in: nothing counted, and the node the failure began on
    # counts when its report arrives during the teardown
    a = decide(d, obs(nodes(1, 2), [fails(1, "peer"), st(2)]), CFG)
    torn = a[0].state  # type: ignore[union-attr]
    assert torn.node_health == {}
    a = decide(torn, obs(nodes(1, 2), [fails(1, "peer"), n2]), CFG)
    assert kinds(a) == ["set:teardown"] and "counted on n2" in a[0].reason  # type: ignore[union-attr]
    assert a[0].state.node_health["n2"].failures == 1  # type: ignore[union-attr]


def test_a_node_that_trained_starts_its_count_again() -> None:
    """VERIFY -> RUNNING (every node stepped past the load step) ends the failure streak of
    the layout's nodes; a node excluded before keeps its exclusion count (the backoff)."""
    streak = NodeHealth(failures=2, generation=1, cause="X: boom")
    back = NodeHealth(failures=3, generation=1, exclusions=1, excluded_until=NOW - 5)
    other = NodeHealth(failures=1, generation=1)
    d = running(
        (1, 2),
        gen=2,
        phase=Phase.VERIFY,
        phase_deadline=NOW + 10,
        load_step=12,
        node_health={"n1": streak, "n2": back, "n3": other},
    )
    ns = nodes(1, 2, 3)
    assert decide(d, obs(ns, [st(1, gen=2, step=12), st(2, gen=2, step=13)]), CFG) == []
    a = decide(d, obs(ns, [st(1, gen=2, step=13), st(2, gen=2, step=13)]), CFG)
    assert kinds(a) == ["set:running"]
    health = a[0].state.node_health  # type: ignore[union-attr]
    assert "n1" not in health  # nothing else to remember
    assert health["n2"].failures == 0 and health["n2"].exclusions == 1
    assert health["n3"] == other  # not in the layout: did not train


def test_an_exclusion_ends_and_the_next_one_lasts_twice_as_long() -> None:
    until = NOW + 10
    rec = NodeHealth(failures=3, generation=1, exclusions=1, excluded_until=until, cause="X")
    idle = DesiredState(epoch=7, generation=1, node_health={"n2": rec})
    ns, sts = nodes(1, 2), [st(1, state="idle"), st(2, state="idle")]
    assert _replanned(decide(idle, obs(ns, sts), CFG)) == ["n1"]
    later = Observed(now=until + 1, nodes=ns, status={s.node_id: s for s in sts})
    assert _replanned(decide(idle, later, CFG)) == ["n1", "n2"]
    # on probation (it has not trained since): its next failure excludes it again, longer
    lengths = []
    health = {"n2": rec}
    for gen in (2, 3, 4, 5):
        d = running((1, 2), gen=gen, node_health=health)
        a = decide(d, obs(nodes(1, 2), [st(1, gen=gen), fails(2, gen=gen)]), CFG)
        health = a[0].state.node_health  # type: ignore[union-attr]
        lengths.append(health["n2"].excluded_until - NOW)
    assert lengths == [1200, 2400, 3600, 3600]  # doubled, capped at max_exclude_s


def test_with_every_node_excluded_the_controller_waits_and_says_why() -> None:
    d = running((1,))
    a = decide(d, obs(nodes(1), [fails(1, "config", message="bad --seq-len")]), CFG)
    torn = a[0].state  # type: ignore[union-attr]
    # the failed worker is aborted first, then nothing is left to plan for: IDLE
    assert kinds(decide(torn, obs(nodes(1), [fails(1, "config")]), CFG)) == ["send:abort:n1"]
    a = decide(torn, obs(nodes(1), [st(1, state="idle")]), CFG)
    assert kinds(a) == ["set:idle"]
    idle, reason = a[0].state, a[0].reason  # type: ignore[union-attr]
    # a configuration error nobody trained past is the job's: held, no node excluded
    assert reason.startswith("no usable node: held the job until the training config changes")
    assert "bad --seq-len" in reason and idle.node_health == {}
    assert idle.cause == reason
    # and no relaunch loop: a config hold does not end by itself (the same config fails
    # alike), only with another training config or `sailor node readmit --all`
    end = idle.job_health.excluded_until
    later = Observed(now=end + 1, nodes=nodes(1), status={"n1": st(1, state="idle")})
    assert decide(idle, later, CFG) == []
    req = {"r1": ReadmitRequest(all=True, time=end)}
    assert kinds(decide(idle, replace(later, readmit=req), CFG)) == [
        "set:idle",
        "clearreadmit",
        "replan",
    ]
    fixed = CFG.model_copy(update={"training": TrainingConfig(model=BuiltinModel(name="tiny-gpt"))})
    assert kinds(decide(idle, later, fixed)) == ["set:idle", "replan"]


def test_the_record_of_a_node_that_is_away_is_kept_until_it_has_nothing_to_say() -> None:
    """A lease flap or an agent restart deregisters a node for a moment: its exclusion and
    backoff stay (before, the record went at once: an excluded config-error node came back
    at level 1, its exclusion forgotten). A record goes once the node is away and its
    exclusion ended ``max_exclude_s`` ago; a streak alone, ``failures`` generations on."""
    rec = NodeHealth(failures=1, generation=1, exclusions=2, excluded_until=NOW + 60)
    streak = NodeHealth(failures=2, generation=1, cause="X")
    d = running((1,), node_health={"n1": NodeHealth(failures=1, generation=1), "n3": rec})
    d = d.model_copy(update={"node_health": d.node_health | {"n4": streak}})
    assert decide(d, obs(nodes(1), [st(1)]), CFG) == []  # n3 and n4 away: all kept
    # n3 back after the flap: still excluded, nothing to plan for
    assert decide(d, obs(nodes(1, 3), [st(1), st(3, gen=-1, state="idle")]), CFG) == []
    # long after: n3's exclusion ended max_exclude_s ago; n4's streak is 3 generations old
    later = Observed(now=NOW + 60 + 3600, nodes=nodes(1), status={"n1": st(1)})
    a = decide(d.model_copy(update={"generation": 4}), later, CFG)
    assert kinds(a) == ["set:running"] and "forgot the failures of n3, n4" in a[0].reason  # type: ignore[union-attr]
    assert set(a[0].state.node_health) == {"n1"}  # type: ignore[union-attr]
    # one second earlier both stay (n4's streak: generation 3 is within 3 of it)
    sooner = replace(later, now=NOW + 60 + 3599)
    assert decide(d.model_copy(update={"generation": 3}), sooner, CFG) == []


def test_exclusions_keep_decide_a_function_of_its_inputs() -> None:
    """Replaying the same observations gives the same actions; the excluded set ``decide``
    uses is the desired state's, whatever the caller put in ``Observed.excluded``; the
    inputs are not modified."""
    rec = NodeHealth(failures=3, generation=1, exclusions=1, excluded_until=NOW + 60)
    d = running((1,), gen=1, node_health={"n2": rec})
    before = d.model_copy(deep=True)
    o = obs(nodes(1, 2, 3), [st(1)])
    runs = [decide(d, o, CFG) for _ in range(2)]
    runs.append(decide(d, replace(o, excluded=frozenset({"n3"})), CFG))
    assert runs[0] == runs[1] == runs[2]
    assert kinds(runs[0]) == ["set:quiesce", "replan"] and _replanned(runs[0]) == ["n1", "n3"]
    assert d == before and o.excluded == frozenset()
    # a pass through a whole abort, replayed: the same desired states and reasons
    trace = []
    for _ in range(2):
        x = running((1, 2))
        steps = [
            obs(nodes(1, 2), [fails(1, "peer"), fails(2, "config")]),
            obs(nodes(1, 2), [st(1, state="idle"), st(2, state="idle")]),
        ]
        out = []
        for ob in steps:
            acts = decide(x, ob, CFG)
            out.append(acts)
            x = next((s.state for s in acts if isinstance(s, SetDesired)), x)
        trace.append(out)
    assert trace[0] == trace[1]


def test_a_node_that_refuses_launches_is_excluded_and_does_not_hold_up_the_others() -> None:
    """A killed worker that outlived SIGKILL keeps its GPU: the agent stays ``failed`` with
    a retry-false record and refuses every launch (agent/supervisor.py). The launch that
    times out on it counts it; once excluded and its Abort acked, it holds up no launch on
    the other nodes (before: every launch waited for it, or timed out on it, forever)."""
    stuck = json.dumps(outlived_kill_record([(4242, 1, "D")], 130.0, step=9))[:2000]
    n2 = st(2, gen=1, state="failed").model_copy(update={"failure": stuck})
    d = running((1, 2), gen=2, phase=Phase.LAUNCH, phase_deadline=NOW - 1)
    a = decide(d, obs(nodes(1, 2), [st(1, gen=1, state="idle"), n2]), CFG)
    assert kinds(a) == ["set:teardown"] and "launch deadline passed" in a[0].state.cause  # type: ignore[union-attr]
    torn = a[0].state  # type: ignore[union-attr]
    assert torn.node_health["n2"].excluded_until == NOW + 600
    assert "OutlivedKill" in a[0].reason and "retry false" in a[0].reason  # type: ignore[union-attr]
    planned = _planned(torn, (1,))
    sts = [st(1, gen=1, state="idle"), n2]
    assert kinds(decide(planned, obs(nodes(1, 2), sts), CFG)) == ["send:abort:n2"]
    acked = frozenset({"e7-g2-abort-n2"})
    assert kinds(decide(planned, obs(nodes(1, 2), sts, acked=acked), CFG)) == ["set:launch"]
    # not excluded (its exclusion ended, or was forgotten) and still reporting the older
    # generation's failure after its Abort: it holds up nothing either, and the next
    # layout leaves it out (before: "is still waited for", forever)
    other = _planned(planned.model_copy(update={"node_health": {}}), (1, 2))
    a = decide(other, obs(nodes(1, 2), sts, acked=acked), CFG)
    assert kinds(a) == ["replan"] and _replanned(a) == ["n1"]
    assert kinds(decide(_planned(other, (1,)), obs(nodes(1, 2), sts, acked=acked), CFG)) == [
        "set:launch"
    ]


def test_a_node_still_failed_after_its_exclusion_ends_holds_up_no_teardown() -> None:
    """The reviewer's hang (/tmp/review-rt/demo_hang.py): n2's killed worker outlived
    SIGKILL and its agent keeps reporting that failure; its exclusion ends. Before, RUNNING
    took n2 as a join (a whole reconfiguration for a node that refuses launches) and every
    TEARDOWN after it waited for n2 for good (+0 s ... +86400 s: TEARDOWN). Now a node whose
    agent reports a failure outside the layout is in no layout, and once its Abort is acked
    it holds up nothing; when its agent reports the process gone, it joins."""
    stuck = json.dumps(outlived_kill_record([(4242, 0, "D")], 130.0, step=9))
    n2 = st(2, gen=2, state="failed").model_copy(update={"failure": stuck})
    rec = NodeHealth(
        failures=1, generation=2, exclusions=1, excluded_until=NOW - 1, cause="OutlivedKill"
    )
    d = running((1,), gen=3, node_health={"n2": rec})
    assert decide(d, obs(nodes(1, 2), [st(1, gen=3), n2]), CFG) == []  # no join
    td = _planned(d.model_copy(update={"phase": Phase.TEARDOWN, "phase_deadline": NOW + 20}), (1,))
    sts = [st(1, gen=3, state="idle"), n2]
    assert kinds(decide(td, obs(nodes(1, 2), sts), CFG)) == ["send:abort:n2"]
    acked = frozenset({"e7-g3-abort-n2"})
    for t in (NOW, NOW + 60, NOW + 3600, NOW + 86400):
        o = replace(obs(nodes(1, 2), sts, acked=acked), now=t)
        a = decide(td, o, CFG)
        assert kinds(a) == ["set:launch"], (t, a)
        assert set(a[0].state.placement) == {"n1"}  # type: ignore[union-attr]
    # the process is gone: the agent reports idle, and n2 joins the running layout
    a = decide(d, obs(nodes(1, 2), [st(1, gen=3), st(2, gen=2, state="idle")]), CFG)
    assert kinds(a) == ["set:quiesce", "replan"] and "nodes joined: n2" in a[0].state.cause  # type: ignore[union-attr]
    # with no other node, the teardown goes IDLE and says why
    solo = _planned(td, (1,)).model_copy(update={"next_plan": None})
    a = decide(solo, obs(nodes(2), [n2], acked=acked), CFG)
    assert kinds(a) == ["set:idle"] and "n2 reports a failure outside the layout" in a[0].reason  # type: ignore[union-attr]


def test_a_node_that_misses_the_teardown_deadline_is_left_out_and_counted() -> None:
    """TEARDOWN waits for a busy node until its deadline, then goes on without it: the node
    is charged and excluded (its workers may hold its GPUs), so the next layout leaves it
    out; before, it waited for the node for good."""
    d = _planned(
        running((1, 2), phase=Phase.TEARDOWN, phase_deadline=NOW + 20, load_step=5), (1, 2)
    )
    sts = [st(1, state="idle"), st(2, state="running")]
    assert kinds(decide(d, obs(nodes(1, 2), sts), CFG)) == ["send:abort:n2"]
    late = replace(obs(nodes(1, 2), sts), now=NOW + 21)
    a = decide(d, late, CFG)
    assert kinds(a) == ["send:abort:n2", "set:teardown"]
    new, reason = a[-1].state, a[-1].reason  # type: ignore[union-attr]
    assert "teardown deadline passed, going on without n2" in reason
    assert "excluded n2 until" in reason and "its Abort not acked" in reason
    rec = new.node_health["n2"]
    assert rec.excluded_until == NOW + 21 + 600 and rec.cause.startswith("TeardownMissed")
    # then: planned again without n2, which no longer holds anything up
    a = decide(new, late, CFG)
    assert kinds(a) == ["send:abort:n2", "replan"] and _replanned(a) == ["n1"]
    a = decide(_planned(new, (1,)), late, CFG)
    assert kinds(a) == ["send:abort:n2", "set:launch"]


def test_a_failure_of_every_node_alike_is_the_jobs_not_the_nodes() -> None:
    """The reviewer's demo_jobwide.py: a training config every rank refuses (retry false)
    excluded every node at once, and the records outlived a controller restarted with a
    fixed config. Now the job is held instead (no launch, the same backoff), the nodes keep
    a clean record, and a controller whose training config differs forgets it."""
    t_bad = TrainingConfig(model=BuiltinModel(name="tiny-gpt"), seed=1)
    cfg = CFG.model_copy(update={"training": t_bad})
    d = running((1, 2), training=t_bad)
    why = "seq_len 8192 > max_position 4096"
    a = decide(d, obs(nodes(1, 2), [fails(i, "config", message=why) for i in (1, 2)]), cfg)
    torn, reason = a[0].state, a[0].reason  # type: ignore[union-attr]
    assert torn.node_health == {}
    assert torn.job_health.excluded_until == NOW + 600 and torn.job_health.origin == "config"
    assert "held the job until" in reason and "2 of the placed nodes failed alike" in reason
    a = decide(torn, obs(nodes(1, 2), [st(i, state="idle") for i in (1, 2)]), cfg)
    assert kinds(a) == ["set:idle"] and "no usable node: held the job" in a[0].reason  # type: ignore[union-attr]
    idle = a[0].state  # type: ignore[union-attr]
    assert decide(idle, obs(nodes(1, 2), [st(i, state="idle") for i in (1, 2)]), cfg) == []
    # a controller restarted with a fixed config: the hold goes, and it plans at once
    fixed = cfg.model_copy(update={"training": t_bad.model_copy(update={"seed": 2})})
    a = decide(idle, obs(nodes(1, 2), [st(i, state="idle") for i in (1, 2)]), fixed)
    assert kinds(a) == ["set:idle", "replan"] and "training config changed" in a[0].reason  # type: ignore[union-attr]
    assert a[0].state.job_health == NodeHealth()  # type: ignore[union-attr]
    assert _replanned(a) == ["n1", "n2"]


def test_a_node_counted_before_its_peers_reported_the_same_failure_is_taken_back() -> None:
    """Reports come in one by one: n1's config error is counted (and excludes n1) before
    n2's report shows the whole job failed alike. Then n1's count and exclusion are taken
    back and the job is held; later passes change nothing."""
    d = running((1, 2))
    a = decide(d, obs(nodes(1, 2), [fails(1, "config", message="bad seq_len"), st(2)]), CFG)
    torn = a[0].state  # type: ignore[union-attr]
    assert torn.node_health["n1"].excluded_until == NOW + 600
    sts = [st(1, state="idle"), fails(2, "config", message="bad seq_len")]
    a = decide(torn, obs(nodes(1, 2), sts), CFG)
    assert kinds(a) == ["set:teardown"]
    back, reason = a[0].state, a[0].reason  # type: ignore[union-attr]
    assert back.node_health == {} and back.job_health.excluded_until == NOW + 600
    assert "not counted against n1 (taken back), n2: the job's" in reason
    assert kinds(decide(back, obs(nodes(1, 2), sts), CFG)) == ["send:abort:n2"]


@pytest.mark.parametrize(
    ("failing", "job"),
    [((1, 2, 3), True), ((1, 2), False)],  # 3 of 4 placed: the job's; 2 of 4: each node's
)
def test_the_same_local_error_on_most_placed_nodes_counts_against_the_job(
    failing: tuple[int, ...], job: bool
) -> None:
    d = running((1, 2, 3, 4))
    sts = [
        fails(i, message=f"CUDA out of memory on rank {i}") if i in failing else st(i)
        for i in (1, 2, 3, 4)
    ]
    torn = decide(d, obs(nodes(1, 2, 3, 4), sts), CFG)[0].state  # type: ignore[union-attr]
    assert (torn.job_health.failures == 1) is job
    assert set(torn.node_health) == (set() if job else {f"n{i}" for i in failing})
    assert torn.job_health.excluded_until == 0  # retry true: 1 of 3 in a row


def test_unreadable_checkpoints_count_against_no_node() -> None:
    """The reviewer's demo_ckpt.py: a storage outage makes every rank fail to read each
    checkpoint; the abort already falls back to an older one. Three in a row excluded every
    node; now nothing is counted."""
    health: dict[str, NodeHealth] = {}
    for gen in (1, 2, 3):
        d = running(
            (1, 2),
            gen=gen,
            node_health=health,
            phase=Phase.LOAD,
            phase_deadline=NOW + 50,
            load_step=30 - gen,
        )
        sts = [fails(i, gen=gen, message="CorruptCheckpointError: shard 3") for i in (1, 2)]
        torn = decide(d, obs(nodes(1, 2), sts), CFG)[0].state  # type: ignore[union-attr]
        assert torn.bad_checkpoints == (30 - gen,)
        assert torn.node_health == {} and torn.job_health == NodeHealth()
        health = torn.node_health


def _sigabrt(i: int) -> AgentStatus:
    rec = {
        "rank": i,
        "step": 9,
        "origin": "local",
        "retry": True,
        "error_type": "Signal",
        "signal": "SIGABRT",
        "message": f"rank {i} killed by SIGABRT after step 9 without an error record",
        "written_by": "parent",
    }
    return st(i, state="failed").model_copy(update={"failure": json.dumps(rec)})


def test_a_sigabrt_after_another_nodes_own_error_is_not_counted() -> None:
    """NCCL's watchdog aborts the ranks whose collective timed out after a peer died; the
    parent writes that SIGABRT as the rank's own failure (origin local). With another
    node's own error in the same generation, the SIGABRT nodes are not charged — nor when
    the SIGABRT was counted first (taken back once the error is in)."""
    d = running((1, 2, 3))
    a = decide(d, obs(nodes(1, 2, 3), [fails(1), _sigabrt(2), st(3)]), CFG)
    torn = a[0].state  # type: ignore[union-attr]
    assert set(torn.node_health) == {"n1"}
    assert "not counted against n2: SIGABRT after another node's own failure" in a[0].reason  # type: ignore[union-attr]
    # the SIGABRT reported first, alone: counted against nobody; the error comes in: its own
    a = decide(d, obs(nodes(1, 2, 3), [st(1), _sigabrt(2), st(3)]), CFG)
    first = a[0].state  # type: ignore[union-attr]
    assert first.node_health == {} and first.job_health == NodeHealth()
    a = decide(first, obs(nodes(1, 2, 3), [fails(1), st(2, state="idle"), st(3)]), CFG)
    assert set(a[0].state.node_health) == {"n1"}  # type: ignore[union-attr]


def test_an_operator_readmits_nodes_and_the_request_is_deleted_once_applied() -> None:
    rec = NodeHealth(failures=1, generation=1, exclusions=1, excluded_until=NOW + 600, cause="X")
    job = NodeHealth(failures=1, generation=1, exclusions=1, excluded_until=NOW + 600)
    d = DesiredState(epoch=7, generation=1, node_health={"n1": rec, "n2": rec}, job_health=job)
    sts = [st(1, state="idle"), st(2, state="idle")]
    req = {"r1": ReadmitRequest(nodes=("n2", "n9"), who="ops@head")}
    a = decide(d, obs(nodes(1, 2), sts, readmit=req), CFG)
    assert kinds(a) == ["set:idle", "clearreadmit"]
    assert a[0].reason == "readmitted n2 (operator request r1 by ops@head)"  # type: ignore[union-attr]
    assert set(a[0].state.node_health) == {"n1"} and a[0].state.job_health == job  # type: ignore[union-attr]
    assert a[1] == ClearReadmit("r1", "forgot n2; no failure record of n9")
    # --all: every record and the job's hold; then it plans at once
    a = decide(d, obs(nodes(1, 2), sts, readmit={"r2": ReadmitRequest(all=True)}), CFG)
    assert kinds(a) == ["set:idle", "clearreadmit", "replan"]
    assert a[0].state.node_health == {} and a[0].state.job_health == NodeHealth()  # type: ignore[union-attr]
    assert "readmitted n1, n2, the job" in a[0].reason  # type: ignore[union-attr]
    # a request naming nothing on record is just deleted
    none = {"r3": ReadmitRequest(nodes=("n9",))}
    a = decide(d, obs(nodes(1, 2), sts, readmit=none), CFG)
    assert a == [ClearReadmit("r3", "no failure record of n9")]
    empty = DesiredState(epoch=7, generation=1)
    a = decide(empty, obs(nodes(1, 2), sts, readmit={"r4": ReadmitRequest(all=True)}), CFG)
    assert a[0] == ClearReadmit("r4", "no failure record to forget")


def test_a_changed_training_config_forgets_config_errors_only() -> None:
    t = TrainingConfig(model=BuiltinModel(name="tiny-gpt"), seed=1)
    cfg_err = NodeHealth(
        failures=1, generation=1, exclusions=1, excluded_until=NOW + 600, origin="config"
    )
    local = cfg_err.model_copy(update={"origin": "local"})
    d = DesiredState(epoch=7, generation=1, training=t, node_health={"n1": cfg_err, "n2": local})
    sts = [st(1, state="idle"), st(2, state="idle")]
    same = CFG.model_copy(update={"training": t})
    assert decide(d, obs(nodes(1, 2), sts), same) == []  # both excluded, nothing to do
    # a copy of the same config (as read back from etcd) is no change
    again = CFG.model_copy(
        update={"training": TrainingConfig.model_validate_json(t.model_dump_json())}
    )
    assert decide(d, obs(nodes(1, 2), sts), again) == []
    other = CFG.model_copy(update={"training": t.model_copy(update={"seed": 2})})
    a = decide(d, obs(nodes(1, 2), sts), other)
    assert kinds(a) == ["set:idle", "replan"] and _replanned(a) == ["n1"]
    assert set(a[0].state.node_health) == {"n2"}  # type: ignore[union-attr]


# ---- review of the failing-node handling (e461e2b): each test failed on that code ----

_TA = TrainingConfig(model=BuiltinModel(name="tiny-gpt"), seed=1)


def _sets(a: list[object]) -> list[DesiredState]:
    return [x.state for x in a if isinstance(x, SetDesired)]


def test_a_changed_config_forgets_a_config_error_once_and_the_teardown_goes_on() -> None:
    """A controller restarted with a fixed training config while a configuration error of
    the current generation is still reported: the record is forgotten once and that
    generation is not counted again (before: forgotten and re-counted in every pass, two
    desired states a pass and never an Abort)."""
    cfg_b = CFG.model_copy(update={"training": _TA.model_copy(update={"seed": 2})})
    d = running((1, 2), training=_TA, phase=Phase.LOAD, phase_deadline=NOW + 100)
    o = obs(nodes(1, 2), [fails(i, "config", message="bad seq_len") for i in (1, 2)])
    torn = _sets(decide(d, o, cfg_b))[0]
    a = decide(torn, o, cfg_b)
    assert kinds(a) == ["set:teardown", "send:abort:n1", "send:abort:n2", "replan"]
    forgot = _sets(a)[0]
    assert forgot.job_health == NodeHealth() and forgot.forgiven_through == torn.generation
    # the next pass changes nothing: it writes nothing
    assert _sets(decide(forgot, replace(o, now=NOW + 30), cfg_b)) == []


def test_a_readmit_during_teardown_is_not_undone_by_the_failures_still_reported() -> None:
    d = running((1, 2), phase=Phase.LOAD, phase_deadline=NOW + 100, load_step=-1)
    sts = [fails(i, "config", message="bad seq_len") for i in (1, 2)]
    torn = _sets(decide(d, obs(nodes(1, 2), sts), CFG))[0]
    assert held(torn.job_health, NOW)
    sts2 = [st(1, state="idle"), fails(2, "config", message="bad seq_len")]
    req = {"r1": ReadmitRequest(all=True, time=NOW)}
    a = decide(torn, obs(nodes(1, 2), sts2, readmit=req), CFG)
    (after,) = _sets(a)
    assert after.node_health == {} and after.job_health == NodeHealth()
    assert kinds(a) == ["set:teardown", "clearreadmit", "send:abort:n2", "replan"]


def _sig(i: int, gen: int = 1) -> AgentStatus:
    return _sigabrt(i).model_copy(update={"generation": gen})


def test_sigabrts_are_never_the_majority_that_makes_a_failure_the_jobs() -> None:
    """An ECC error on n3; NCCL's watchdog SIGABRTs the ranks on the three others: n3 is
    charged, the job is not (before: the three SIGABRTs were 'alike', and the job held)."""
    ecc = fails(3, message="CUDA error: uncorrectable ECC error encountered")
    d = running((1, 2, 3, 4))
    (torn,) = _sets(decide(d, obs(nodes(1, 2, 3, 4), [_sig(1), _sig(2), ecc, _sig(4)]), CFG))
    assert set(torn.node_health) == {"n3"} and torn.job_health == NodeHealth()


def test_only_sigabrts_charge_no_node_but_the_job() -> None:
    """Every rank SIGABRTed (a dead NIC hangs every collective): the node at fault is not
    known, so no node is charged, but the job is (before: nobody, and the job was relaunched
    at full rate forever); the teardown's passes do not count it again."""
    d = running((1, 2, 3, 4))
    o = obs(nodes(1, 2, 3, 4), [_sig(i) for i in (1, 2, 3, 4)])
    a = decide(d, o, CFG)
    (torn,) = _sets(a)
    assert torn.node_health == {}
    assert (torn.job_health.failures, torn.job_health.generation) == (1, 1)
    assert "SIGABRT" in torn.job_health.cause and not held(torn.job_health, NOW)
    reason = a[0].reason  # type: ignore[union-attr]
    assert "the node at fault is not known" in reason
    assert "counted against the job (failure 1 in a row): only SIGABRTs" in reason
    assert "by 4 of the 4 placed node(s) (n1, n2, n3, n4)" in reason
    assert _sets(decide(torn, o, CFG)) == []


def test_a_nodes_own_error_after_only_sigabrts_takes_the_jobs_count_back() -> None:
    """Three of four nodes SIGABRT first (counted against the job); in the teardown n4
    reports the ECC error the watchdogs were giving up on: n4 is charged, the job's count
    is taken back, and later passes do not count the job again."""
    d = running((1, 2, 3, 4))
    first = obs(nodes(1, 2, 3, 4), [_sig(1), _sig(2), _sig(3), st(4)])
    (torn,) = _sets(decide(d, first, CFG))
    assert torn.job_health.failures == 1 and torn.node_health == {}
    ecc = fails(4, message="CUDA error: uncorrectable ECC error encountered")
    later = obs(nodes(1, 2, 3, 4), [_sig(1), st(2, state="idle"), _sig(3), ecc])
    a = decide(torn, later, CFG)
    (after,) = _sets(a)
    assert set(after.node_health) == {"n4"} and after.job_health == NodeHealth()
    assert "taken back from the job: n4 reported a failure of its own" in a[0].reason  # type: ignore[union-attr]
    idle = obs(nodes(1, 2, 3, 4), [_sig(1), st(2, state="idle"), _sig(3), st(4, state="idle")])
    assert _sets(decide(after, idle, CFG)) == []


def _teardown_state(epoch: int = 7, phase_epoch: int = 7) -> DesiredState:
    d = running((1, 2, 3, 4), phase=Phase.TEARDOWN, load_step=20, stop_step=20)
    return d.model_copy(
        update={
            "epoch": epoch,
            "phase_epoch": phase_epoch,
            "phase_since": NOW,
            "phase_deadline": NOW + 150,
        }
    )


def test_a_leader_adopting_a_teardown_restarts_its_deadline() -> None:
    """A leader back 200 s after the TEARDOWN began (a restart): nothing of its epoch is
    acked yet. Before, every busy node was charged at once and the job went IDLE."""
    d = _teardown_state(epoch=8, phase_epoch=7)
    sts = [st(i, state="stopped", step=20, saved=20) for i in (1, 2, 3, 4)]
    a = decide(d, replace(obs(nodes(1, 2, 3, 4), sts), now=NOW + 200), CFG)
    (restarted,) = _sets(a)
    assert restarted.phase_deadline == NOW + 200 + 150 and restarted.phase_epoch == 8
    assert restarted.node_health == {}
    assert kinds(a)[1:5] == [f"send:abort:n{i}" for i in (1, 2, 3, 4)]


def test_the_teardown_deadline_exceeds_the_agents_kill_bound() -> None:
    # the agent acks an Abort after its kill: 3 s SIGTERM grace + 120 s teardown_timeout_s
    assert CFG.deadlines.teardown > 3 + 120


def test_a_node_that_acked_its_abort_is_not_charged_at_the_teardown_deadline() -> None:
    d = _teardown_state()
    sts = [st(i, state="idle") for i in (1, 3)] + [st(i, state="stopped") for i in (2, 4)]
    acked = frozenset(f"e7-g1-abort-n{i}" for i in (1, 2, 3))
    a = decide(d, replace(obs(nodes(1, 2, 3, 4), sts, acked=acked), now=NOW + 151), CFG)
    (charged,) = _sets(a)
    assert set(charged.node_health) == {"n4"}  # n2 acked (its status lags): done


def test_a_stale_failed_node_outside_the_layout_is_sent_an_abort_in_any_phase() -> None:
    """n2's workers of generation 1 failed while a lease flap had it out of the teardown;
    it reports that failure forever unless told: an Abort clears it (before, it was left
    out of every layout for good). A killed worker that outlived SIGKILL is not: its agent
    withdraws it once the process is gone."""
    n2 = fails(2, "peer", gen=1, message="NCCL communicator was aborted")
    d = running((1, 3), gen=2)
    o = obs(nodes(1, 2, 3), [st(1, gen=2), st(3, gen=2), n2])
    a = decide(d, o, CFG)
    assert kinds(a) == ["send:abort:n2"]
    assert a[0].command.command_id == "e7-g2-clear-n2"  # type: ignore[union-attr]
    assert decide(d, replace(o, acked=frozenset({"e7-g2-clear-n2"})), CFG) == []
    idle = DesiredState(epoch=7, generation=2)
    assert kinds(decide(idle, obs(nodes(2), [n2]), CFG)) == ["send:abort:n2"]
    stuck = json.dumps(outlived_kill_record([(4242, 1, "D")], 130.0, step=9))
    n2_stuck = st(2, gen=1, state="failed").model_copy(update={"failure": stuck})
    assert decide(idle, obs(nodes(2), [n2_stuck]), CFG) == []


def _oom(i: int, gib: str) -> AgentStatus:
    msg = (
        f"CUDA out of memory. Tried to allocate {gib} GiB. GPU {i} has a total capacity of "
        "79.15 GiB of which 312.00 MiB is free. Including non-PyTorch memory, this process has "
        "78.83 GiB memory in use. Of the allocated memory 74.10 GiB is allocated by PyTorch, "
        "and 3.21 GiB is reserved by PyTorch but unallocated."
    )
    rec = {"rank": i, "step": 0, "origin": "local", "retry": True}
    rec |= {"error_type": "OutOfMemoryError", "message": msg}
    return st(i, state="failed").model_copy(update={"failure": json.dumps(rec)})


def test_the_same_error_with_numbers_of_other_widths_is_alike() -> None:
    """Real CUDA OOM messages: the sizes differ in width, so cutting at 200 characters
    first and then leaving the numbers out gave each node its own signature."""
    sts = [_oom(1, "2.00"), _oom(2, "12.50"), _oom(3, "112.00"), _oom(4, "1.50")]
    (torn,) = _sets(decide(running((1, 2, 3, 4)), obs(nodes(1, 2, 3, 4), sts), CFG))
    assert torn.node_health == {} and torn.job_health.failures == 1


def test_a_config_error_on_two_nodes_holds_the_job_when_no_node_trained_with_it() -> None:
    """Two nodes report the same configuration error and none trained with the config: the
    job's (a bad config fails every node; before, each node was excluded in turn through
    the whole pool). One node's alone is that node's: a ValueError before the first step
    is a "config" error on one node too (a bad local file), and it must not hold a job the
    others can run (a review found one node's reshape error holding the job for a week)."""
    d = running((1, 2, 3, 4), phase=Phase.LOAD, phase_deadline=NOW + 100, load_step=-1)

    def refuses(i: int, message: str) -> AgentStatus:  # before its first step
        return fails(i, "config", message=message).model_copy(update={"step": -1})

    msg = "seq_length 8192 > max_position_embeddings 4096"
    sts = [refuses(i, msg) for i in (1, 2)]
    sts += [st(i, state="running", step=-1) for i in (3, 4)]
    (torn,) = _sets(decide(d, obs(nodes(1, 2, 3, 4), sts), CFG))
    assert torn.node_health == {} and held(torn.job_health, NOW + 10**6)
    # one node's alone: that node's, the job goes on without it
    alone = [refuses(1, "cannot reshape array of size 0")]
    alone += [st(i, state="running", step=-1) for i in (2, 3, 4)]
    (torn,) = _sets(decide(d, obs(nodes(1, 2, 3, 4), alone), CFG))
    assert set(torn.node_health) == {"n1"} and torn.job_health == NodeHealth()
    # two alike, but one that trained with that config makes them the nodes'
    sts = [*(refuses(i, msg) for i in (1, 2)), st(3, step=5), st(4, step=-1)]
    (torn,) = _sets(decide(d, obs(nodes(1, 2, 3, 4), sts), CFG))
    assert set(torn.node_health) == {"n1", "n2"} and torn.job_health == NodeHealth()


def test_a_checkpoint_two_nodes_cannot_read_is_marked_bad_and_nobody_stays_charged() -> None:
    """Each rank reads only its own stage's files, so one corrupt file fails a minority of
    the nodes: a review found healthy nodes excluded one by one while the job never left
    the corrupt step, when a minority was charged and the checkpoint kept. Now the first
    node is charged and left out, the step loaded again from the others; when another
    node fails to read it too, it is bad and the first node's charge is taken back
    (controller/suspect_checkpoint.py; a broken mount: tests/unit/
    test_controller_suspect_checkpoint.py)."""
    cfg = CFG.model_copy(update={"keep_checkpoints": 3})
    commits = tuple(CommitRecord(step=s, directory="/ck") for s in (10, 20, 30))
    d = running((1, 2, 3, 4), phase=Phase.LOAD, phase_deadline=NOW + 50, load_step=30)
    broken = "CorruptCheckpointError: layer 17 of step 30: checksum mismatch"
    sts = [st(i, state="running", step=30) for i in (1, 2, 4)] + [fails(3, message=broken)]
    (torn,) = _sets(decide(d, obs(nodes(1, 2, 3, 4), sts, commits=commits), cfg))
    assert torn.bad_checkpoints == () and torn.load_step == 30
    assert torn.suspect_checkpoint.nodes == ("n3",) and set(torn.node_health) == {"n3"}
    # the relaunch without n3 puts layer 17 on n2: it cannot read it either
    again = running(
        (1, 2, 4),
        gen=2,
        phase=Phase.LOAD,
        phase_deadline=NOW + 50,
        load_step=30,
        node_health=torn.node_health,
        suspect_checkpoint=torn.suspect_checkpoint,
    )
    sts = [st(i, gen=2, state="running", step=30) for i in (1, 4)]
    sts.append(fails(2, gen=2, message=broken))
    (torn,) = _sets(decide(again, obs(nodes(1, 2, 3, 4), sts, commits=commits), cfg))
    assert torn.bad_checkpoints == (30,) and torn.load_step == 20 and torn.node_health == {}


def test_a_readmit_request_is_applied_whatever_the_operators_clock_says() -> None:
    """A request's time is the operator's clock: a review found one 61 min behind the
    controller's dropped unapplied while the CLI printed "readmitted". A request the CLI
    gave up on is withdrawn by the CLI itself."""
    rec = NodeHealth(failures=1, generation=1, exclusions=1, excluded_until=NOW + 9000, cause="X")
    d = DesiredState(epoch=7, generation=1, node_health={"n1": rec})
    old = {"r1": ReadmitRequest(nodes=("n1",), time=NOW)}
    a = decide(d, replace(obs(nodes(1), [st(1, state="idle")], readmit=old), now=NOW + 3661), CFG)
    (done,) = _sets(a)
    assert done.node_health == {} and "clearreadmit" in kinds(a)


def test_the_replan_a_state_waits_for_is_the_one_its_passes_ask_for() -> None:
    """``wanted_replan``: what a failed search's reason (``plan_failed``) belongs to. The
    replan a pass asks for whenever it asks for one; the same in the passes of QUIESCE to
    TEARDOWN that do something else first (COMMIT); none when nothing is to be planned."""
    from sailor.controller.decide import wanted_replan

    def asked(d: DesiredState, o: Observed) -> Replan | None:
        return next((a for a in decide(d, o, CFG) if isinstance(a, Replan)), None)

    def same(a: Replan | None, b: Replan | None) -> bool:
        if a is None or b is None:
            return a is b
        return (a.nodes, a.precision) == (b.nodes, b.precision)

    three = obs(nodes(1, 2, 3), [st(1), st(2), st(3, 0, "idle", -1)])
    quiesce = running((1, 2), phase=Phase.QUIESCE, stop_step=12, phase_deadline=NOW + 60)
    teardown = running((1, 2), phase=Phase.TEARDOWN, phase_deadline=NOW + 60)
    commit = running((1, 2), phase=Phase.COMMIT, stop_step=12)
    idle = DesiredState(epoch=7)
    for d, o in [
        (quiesce, three),
        (teardown, obs(nodes(1, 2, 3), [st(1, 1, "idle"), st(2, 1, "idle"), st(3, 0, "idle")])),
        (idle, obs(nodes(1, 2), [st(1, 0, "idle", -1), st(2, 0, "idle", -1)])),
        (running((1, 2)), three),  # the pass that leaves RUNNING asks; RUNNING waits for none
    ]:
        want = wanted_replan(d, o, CFG)
        if d.phase is Phase.RUNNING:
            assert want is None and asked(d, o) is not None
        else:
            assert want is not None and same(want, asked(d, o)), d.phase
    want = wanted_replan(commit, three, CFG)  # the commit's pass asks for nothing
    assert want is not None and [n.node_id for n in want.nodes] == ["n1", "n2", "n3"]
    assert asked(commit, three) is None
    # none: every node gone, the next plan made for these nodes already, a launch under way
    assert wanted_replan(idle, obs({}, []), CFG) is None
    planned = DataParallelPlanner("m", 4, 8).plan(tuple(node(i) for i in (1, 2, 3)), None)
    ready = quiesce.model_copy(
        update={"next_plan": planned.plan, "next_membership": ("n1", "n2", "n3")}
    )
    assert wanted_replan(ready, three, CFG) is None
    launch = running((1, 2), phase=Phase.LAUNCH, phase_deadline=NOW + 60)
    assert wanted_replan(launch, three, CFG) is None
