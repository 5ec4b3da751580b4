"""Table tests of the controller's periodic checkpoint (``controller/periodic.py``) in ``decide``:
the step asked for, the commands, the commit, an abandoned save that aborts nothing, and a
reconfiguration that takes precedence."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from sailor.controller.decide import decide
from sailor.controller.decision_types import (
    Commit,
    DecideConfig,
    Observed,
    PeriodicOutcome,
    Send,
    SetDesired,
)
from sailor.controller.plan_deadlines import MeasuredIteration
from sailor.schemas.commands import Checkpoint, CommandAdapter
from sailor.schemas.runtime import (
    CommitRecord,
    DesiredState,
    NoticeRecord,
    PeriodicCheckpoint,
    Phase,
)
from tests.unit.test_controller_decide import NOW, nodes, obs, running, st

CFG = DecideConfig(checkpoint_dir="/ck", stop_ahead_steps=2, checkpoint_every_s=600)
SINCE = NOW - 700  # RUNNING began 700 s ago: a periodic checkpoint is due


def _running(**kw: object) -> DesiredState:
    return running((1, 2), phase_since=SINCE, load_step=40, **kw)


def _sets(actions: list[object]) -> list[DesiredState]:
    return [a.state for a in actions if isinstance(a, SetDesired)]


def _outcomes(actions: list[object]) -> list[tuple[str, int]]:
    return [(a.outcome, a.step) for a in actions if isinstance(a, PeriodicOutcome)]


def _checkpoints(actions: list[object]) -> list[Checkpoint]:
    out = []
    for a in actions:
        if isinstance(a, Send) and isinstance(a.command, Checkpoint):
            out.append(a.command)
    return out


def test_a_due_checkpoint_asks_every_node_for_a_step_ahead_without_stopping() -> None:
    """700 s into RUNNING, 110 steps past the first after the load (41): the pace is 700/110
    s a step, so the 2 s lead is one step, less than stop_ahead_steps (2): S = 152 + 2. Every
    node gets a Checkpoint of S (no Stop), with the retention's prune point."""
    commits = (CommitRecord(step=40, directory="/ck"),)
    o = obs(nodes(1, 2), [st(1, step=151), st(2, step=152)], commits=commits)
    a = decide(_running(), o, CFG)
    assert _outcomes(a) == [("requested", 154)]
    (state,) = _sets(a)
    assert state.phase is Phase.RUNNING
    assert state.periodic.step == 154 and state.periodic.requested == NOW
    assert state.periodic.deadline > NOW + 60  # the plan's CHECKPOINT and the steps to S
    cmds = _checkpoints(a)
    assert [c.node_id for c in cmds] == ["n1", "n2"]
    assert all(c.step == 154 and c.directory == "/ck" and c.prune_below == 40 for c in cmds)
    assert all(CommandAdapter.validate_json(c.model_dump_json()) == c for c in cmds)
    assert not any(isinstance(x, Send) and x.command.kind == "stop" for x in a)


def test_the_step_is_ahead_by_the_iterations_of_the_lead() -> None:
    """A measured iteration of 0.1 s: the 2 s lead is 20 steps ahead of the highest report."""
    d = _running()
    assert d.plan is not None
    cfg = CFG.model_copy(
        update={"measured": MeasuredIteration(plan_id=d.plan.plan_id, iteration_s=0.1)}
    )
    a = decide(d, obs(nodes(1, 2), [st(1, step=150), st(2, step=152)]), cfg)
    assert _outcomes(a) == [("requested", 172)]


def test_none_before_the_interval_nor_when_off() -> None:
    o = obs(nodes(1, 2), [st(1, step=151), st(2, step=152)])
    assert decide(running((1, 2), phase_since=NOW - 100), o, CFG) == []
    assert decide(_running(), o, CFG.model_copy(update={"checkpoint_every_s": 0})) == []
    # the interval counts from the last request too (committed or abandoned)
    d = _running(periodic=PeriodicCheckpoint(requested=NOW - 300))
    assert decide(d, o, CFG) == []
    # nor while a node reports no step of this generation
    assert decide(_running(), obs(nodes(1, 2), [st(1, step=151), st(2, gen=0)]), CFG) == []


def test_the_save_in_flight_is_sent_until_acked_and_committed_once_durable() -> None:
    flying = PeriodicCheckpoint(step=154, requested=NOW - 5, deadline=NOW + 60, directory="/ck")
    d = _running(periodic=flying)
    commits = (CommitRecord(step=40, directory="/ck"), CommitRecord(step=20, directory="/ck"))
    o = obs(nodes(1, 2), [st(1, step=153), st(2, step=153)], commits=commits)
    a = decide(d, o, CFG)
    assert [c.node_id for c in _checkpoints(a)] == ["n1", "n2"] and len(a) == 2
    # prunes below the oldest record (20), not the retention's step (40): a save abandoned
    # that still commits deletes no recorded step's files
    assert all(c.prune_below == 20 for c in _checkpoints(a))
    # and names no step given up on: none was
    assert all(c.drop_steps == () for c in _checkpoints(a))
    acked = frozenset(c.command_id for c in _checkpoints(a))
    o = obs(nodes(1, 2), [st(1, step=153), st(2, step=153)], commits=commits, acked=acked)
    assert decide(d, o, CFG) == []
    # every node saved (the workers agreed on step 155: a late request, the same step on all)
    done = [st(1, step=156, saved=155), st(2, step=155, saved=155)]
    a = decide(d, obs(nodes(1, 2), done, commits=commits, acked=acked), CFG)
    commit = next(x for x in a if isinstance(x, Commit))
    assert commit.record.step == 155 and commit.record.generation == 1 and commit.periodic
    assert commit.record.epoch == 7 and commit.record.time == NOW
    assert commit.drop == (20,)  # keep_checkpoints=1: the committer deleted below 40
    assert commit.drop_steps == ()
    assert _outcomes(a) == [("committed", 155)]
    (state,) = _sets(a)
    assert state.phase is Phase.RUNNING and state.periodic == PeriodicCheckpoint(requested=NOW - 5)


def test_a_save_not_durable_by_its_deadline_is_abandoned_not_aborted_and_asked_again() -> None:
    flying = PeriodicCheckpoint(step=154, requested=NOW - 100, deadline=NOW - 1, directory="/ck")
    d = _running(periodic=flying)
    o = obs(nodes(1, 2), [st(1, step=170, saved=154), st(2, step=170)])
    a = decide(d, o, CFG)
    assert _outcomes(a) == [("abandoned", 154)]
    assert not any(isinstance(x, Commit) for x in a)
    (state,) = _sets(a)
    assert state.phase is Phase.RUNNING and not state.aborted
    assert state.periodic == PeriodicCheckpoint(requested=NOW - 100)
    why = next(x for x in a if isinstance(x, PeriodicOutcome)).reason
    assert "n2: at step 170, saved -1" in why and "n1" not in why
    # retried at the next interval: 600 s after the abandoned request
    assert decide(state, o, CFG) == []
    later = Observed(now=NOW + 500, nodes=o.nodes, status=o.status)
    assert _outcomes(decide(state, later, CFG)) == [("requested", 172)]


@pytest.mark.parametrize("what", ["notice", "join", "lost"])
def test_a_reconfiguration_takes_precedence_over_the_save_in_flight(what: str) -> None:
    """A notice (QUIESCE), a join (QUIESCE) or a lost node (abort): the save in flight is
    dropped with the RUNNING phase and audited as abandoned, never recorded later."""
    flying = PeriodicCheckpoint(step=154, requested=NOW - 5, deadline=NOW + 60, directory="/ck")
    d = _running(periodic=flying)
    statuses = [st(1, step=153), st(2, step=153)]
    if what == "notice":
        notice = NoticeRecord(node_id="n2", deadline=NOW + 30)
        o = obs(nodes(1, 2), statuses, notices={"n2": notice})
    elif what == "join":
        o = obs(nodes(1, 2, 3), [*statuses, st(3, gen=-1, state="idle")])
    else:
        o = obs(nodes(1), statuses)
    a = decide(d, o, CFG)
    assert _outcomes(a) == [("abandoned", 154)]
    why = next(x for x in a if isinstance(x, PeriodicOutcome)).reason
    assert why.startswith("superseded: ")
    left = _sets(a)[0]
    assert left.phase is (Phase.TEARDOWN if what == "lost" else Phase.QUIESCE)
    assert left.periodic == PeriodicCheckpoint()
    assert all("pckpt" not in c.command_id for c in _checkpoints(a))


def test_a_save_durable_on_every_node_before_one_was_lost_is_loaded_by_the_abort() -> None:
    """Both nodes reported step 154 durable, then n2 vanished (no notice): the pass records
    the commit first, and the abort's relaunch loads it, not the older commit."""
    flying = PeriodicCheckpoint(step=154, requested=NOW - 5, deadline=NOW + 60, directory="/ck")
    d = _running(periodic=flying)
    commits = (CommitRecord(step=40, directory="/ck"),)
    o = obs(nodes(1), [st(1, step=156, saved=154), st(2, step=155, saved=154)], commits=commits)
    a = decide(d, o, CFG)
    assert [type(x).__name__ for x in a][:3] == ["Commit", "PeriodicOutcome", "SetDesired"]
    assert _outcomes(a) == [("committed", 154)]
    torn = _sets(a)[-1]
    assert torn.phase is Phase.TEARDOWN and torn.aborted and torn.load_step == 154


def test_a_save_asked_under_another_directory_is_recorded_there_or_abandoned() -> None:
    """A leader asked for 154 under /old; a standby whose checkpoint_dir is /ck took over.
    Durable on every node: recorded under /old, where the files are (before, under /ck).
    Not yet durable: abandoned, not re-sent under /ck (the workers took step 154 once and
    would skip it, and the commit would have named /ck)."""
    flying = PeriodicCheckpoint(step=154, requested=NOW - 5, deadline=NOW + 60, directory="/old")
    d = _running(periodic=flying)
    commits = (CommitRecord(step=40, directory="/old"),)
    done = [st(1, step=156, saved=155), st(2, step=156, saved=155)]
    a = decide(d, obs(nodes(1, 2), done, commits=commits), CFG)
    commit = next(x for x in a if isinstance(x, Commit))
    assert (commit.record.step, commit.record.directory) == (155, "/old")
    a = decide(d, obs(nodes(1, 2), [st(1, step=153), st(2, step=153)], commits=commits), CFG)
    assert _checkpoints(a) == [] and _outcomes(a) == [("abandoned", 154)]
    why = next(x for x in a if isinstance(x, PeriodicOutcome)).reason
    assert "asked under /old, this leader's checkpoint_dir is /ck" in why
    (state,) = _sets(a)
    assert state.phase is Phase.RUNNING and state.periodic == PeriodicCheckpoint(requested=NOW - 5)
    # the next one, once due, is asked under this leader's directory
    later = Observed(now=NOW + 600, nodes=nodes(1, 2), status={s.node_id: s for s in done})
    asked = _checkpoints(decide(state, later, CFG))
    assert asked and {c.directory for c in asked} == {"/ck"}
    assert _sets(decide(state, later, CFG))[0].periodic.directory == "/ck"


def test_a_periodic_save_the_workers_passed_is_not_the_reconfigurations_checkpoint() -> None:
    """A reconfiguration's stop step is 150; the workers saved 152 for a periodic request,
    then met the Stop at 160 and hold there. Before, saved 152 >= 150 moved to COMMIT of
    152: 8 steps lost (in place, the workers held 160 with a load step of 152). Now the
    leader waits for the save of the step they hold at."""
    d = running((1, 2), phase=Phase.CHECKPOINT, stop_step=150, phase_deadline=NOW + 60)
    passed = [st(i, step=160, saved=152, state="stopped") for i in (1, 2)]
    a = decide(d, obs(nodes(1, 2), passed), CFG)
    assert not [s for s in _sets(a) if s.phase is Phase.COMMIT]
    held = [st(i, step=160, saved=160, state="stopped") for i in (1, 2)]
    (commit,) = (
        s for s in _sets(decide(d, obs(nodes(1, 2), held), CFG)) if s.phase is Phase.COMMIT
    )
    assert commit.stop_step == 160
    # a save at the very step they hold at is theirs, whichever request it answered
    held = [st(i, step=152, saved=152, state="stopped") for i in (1, 2)]
    (commit,) = (
        s for s in _sets(decide(d, obs(nodes(1, 2), held), CFG)) if s.phase is Phase.COMMIT
    )
    assert commit.stop_step == 152


def test_the_periodic_record_is_validated() -> None:
    with pytest.raises(ValidationError, match=r"deadline.*no save is in flight"):
        PeriodicCheckpoint(deadline=5.0)
    with pytest.raises(ValidationError, match=r"deadline.*ends after its request"):
        PeriodicCheckpoint(step=3, requested=10.0, deadline=5.0)
    with pytest.raises(ValidationError, match=r"directory='': empty, but a save is in flight"):
        PeriodicCheckpoint(step=3, requested=1.0, deadline=5.0)
    with pytest.raises(ValidationError, match=r"directory='/ck': set, but no save"):
        PeriodicCheckpoint(directory="/ck")
    with pytest.raises(ValidationError, match="checkpoint_every_s"):
        DecideConfig(checkpoint_dir="/ck", checkpoint_every_s=-1)


def test_a_save_the_workers_report_failed_is_abandoned_before_its_deadline() -> None:
    """The workers agreed that the save failed (a storage error on one rank), reported it
    and trained on: the leader abandons it at once, audited with what failed, and asks again
    at the next interval; a failure of an earlier save or generation is not this one's."""
    flying = PeriodicCheckpoint(step=154, requested=NOW - 5, deadline=NOW + 60, directory="/ck")
    d = _running(periodic=flying)
    cause = "the checkpoint save failed on rank(s) 1 (h2); rank 1: OSError: No space left"
    failed = st(2, step=157).model_copy(update={"save_failed_step": 155, "save_failure": cause})
    a = decide(d, obs(nodes(1, 2), [st(1, step=157, saved=155), failed]), CFG)
    assert _outcomes(a) == [("abandoned", 154)]
    assert not any(isinstance(x, Commit) for x in a) and not _checkpoints(a)
    (state,) = _sets(a)
    assert state.phase is Phase.RUNNING and not state.aborted
    assert state.periodic == PeriodicCheckpoint(requested=NOW - 5)
    why = next(x for x in a if isinstance(x, PeriodicOutcome)).reason
    assert "n2" in why and "step 155" in why and "No space left" in why, why
    # an earlier save's failure (step 120), or one of the generation before: still in flight
    for old in (
        st(2, step=157).model_copy(update={"save_failed_step": 120, "save_failure": cause}),
        st(2, gen=0, step=157).model_copy(update={"save_failed_step": 155}),
    ):
        a = decide(d, obs(nodes(1, 2), [st(1, step=157), old]), CFG)
        assert _outcomes(a) == [] and len(_checkpoints(a)) == 2


def test_the_periodic_checkpoint_and_its_commit_say_periodic() -> None:
    """The command tells the workers the save is optional; the record tells ``sailor status``
    which commit was periodic."""
    a = decide(_running(), obs(nodes(1, 2), [st(1, step=151), st(2, step=152)]), CFG)
    assert [c.periodic for c in _checkpoints(a)] == [True, True]
    flying = PeriodicCheckpoint(step=154, requested=NOW - 5, deadline=NOW + 60, directory="/ck")
    done = [st(1, step=156, saved=155), st(2, step=155, saved=155)]
    a = decide(_running(periodic=flying), obs(nodes(1, 2), done), CFG)
    assert next(x for x in a if isinstance(x, Commit)).record.periodic
