"""Table tests of the saves the controller gives up on (``controller/drop_steps.py``) in
``decide``: what adds a step to ``DesiredState.drop_steps``, what every Checkpoint names,
what a commit empties, and the bound."""

from __future__ import annotations

from sailor.controller.audit import check
from sailor.controller.decide import decide
from sailor.controller.decision_types import Commit, DecideConfig, SetDesired
from sailor.controller.drop_steps import for_checkpoint, track
from sailor.schemas.commands import Checkpoint
from sailor.schemas.runtime import (
    MAX_DROP_STEPS,
    CommitRecord,
    DesiredState,
    NoticeRecord,
    PeriodicCheckpoint,
    Phase,
)
from tests.unit.test_controller_decide import NOW, nodes, obs, running, st
from tests.unit.test_controller_periodic import CFG, _checkpoints, _running, _sets

RECORDED = (CommitRecord(step=40, directory="/ck"),)


def _checkpoint_of(d: DesiredState, cfg: DecideConfig = CFG) -> Checkpoint:
    o = obs(nodes(1, 2), [st(1, step=59), st(2, step=59)], commits=RECORDED)
    (ckpt, *_) = _checkpoints(decide(d, o, cfg))
    return ckpt


def test_an_aborted_checkpoint_is_given_up_and_the_next_save_drops_it_then_forgets_it() -> None:
    """CHECKPOINT of step 60 past its deadline: the abort remembers 60 in the state it
    writes; the next reconfiguration's Checkpoint names it; its commit empties the list and
    its record names what was asked (audited)."""
    d = running((1, 2), phase=Phase.CHECKPOINT, stop_step=60, phase_deadline=NOW - 1)
    o = obs(nodes(1, 2), [st(1, step=60, saved=60), st(2, step=60)], commits=RECORDED)
    (torn, *_) = _sets(decide(d, o, CFG))
    assert torn.phase is Phase.TEARDOWN and torn.drop_steps == (60,)
    # relaunched from 40; a notice quiesces at 50: its Checkpoint names 60
    q = running((1, 2), gen=2, phase=Phase.QUIESCE, stop_step=50, phase_deadline=NOW + 60)
    q = q.model_copy(update={"drop_steps": torn.drop_steps})
    assert _checkpoint_of(q).drop_steps == (60,)
    done = q.model_copy(update={"phase": Phase.COMMIT})
    o = obs(nodes(1, 2), [st(i, gen=2, step=50, saved=50) for i in (1, 2)], commits=RECORDED)
    a = decide(done, o, CFG)
    (commit,) = [x for x in a if isinstance(x, Commit)]
    assert commit.record.step == 50 and commit.drop_steps == (60,)
    assert [s.drop_steps for s in _sets(a)] == [()]


def test_a_periodic_save_given_up_is_remembered_with_the_steps_nodes_saved_past_it() -> None:
    """Abandoned at its deadline: its step and a later step a node reported durable (the
    workers agreed a late request at a later boundary); superseded by a notice: its step.
    Committed: nothing. Asked under another leader's directory: nothing (its files are not
    in this leader's directory)."""
    late = PeriodicCheckpoint(step=154, requested=NOW - 100, deadline=NOW - 1, directory="/ck")
    o = obs(nodes(1, 2), [st(1, step=170, saved=156), st(2, step=170)], commits=RECORDED)
    (state,) = _sets(decide(_running(periodic=late), o, CFG))
    assert state.drop_steps == (154, 156)
    flying = late.model_copy(update={"deadline": NOW + 60})
    notice = {"n2": NoticeRecord(node_id="n2", deadline=NOW + 30)}
    o = obs(nodes(1, 2), [st(1, step=153), st(2, step=153)], notices=notice, commits=RECORDED)
    (quiesce, *_) = _sets(decide(_running(periodic=flying), o, CFG))
    assert quiesce.phase is Phase.QUIESCE and quiesce.drop_steps == (154,)
    o = obs(nodes(1, 2), [st(i, step=155, saved=154) for i in (1, 2)], commits=RECORDED)
    assert [s.drop_steps for s in _sets(decide(_running(periodic=flying), o, CFG))] == [()]
    elsewhere = late.model_copy(update={"directory": "/other"})
    o = obs(nodes(1, 2), [st(1, step=170), st(2, step=170)], commits=RECORDED)
    (state,) = _sets(decide(_running(periodic=elsewhere), o, CFG))
    assert state.drop_steps == ()


def test_recorded_steps_are_never_named_and_the_list_is_bounded() -> None:
    """A step given up that is recorded (any directory's record) is not remembered, and a
    Checkpoint never names a recorded step nor its own; past MAX_DROP_STEPS the oldest
    steps are forgotten; with keep_checkpoints null no Checkpoint names any."""
    d = running((1, 2), phase=Phase.CHECKPOINT, stop_step=40, phase_deadline=NOW - 1)
    o = obs(nodes(1, 2), [st(1, step=40), st(2, step=40)], commits=RECORDED)
    (torn, *_) = _sets(decide(d, o, CFG))
    assert torn.phase is Phase.TEARDOWN and torn.drop_steps == ()
    full = tuple(range(1000, 1000 + MAX_DROP_STEPS))
    d = d.model_copy(update={"stop_step": 60, "drop_steps": full})
    (torn, *_) = _sets(decide(d, o, CFG))
    assert torn.drop_steps == (*full[1:], 60)
    q = running((1, 2), phase=Phase.QUIESCE, stop_step=70, phase_deadline=NOW + 60)
    assert _checkpoint_of(q.model_copy(update={"drop_steps": (70, 40, 65)})).drop_steps == (65,)
    keep_all = CFG.model_copy(update={"keep_checkpoints": None})
    assert for_checkpoint(q.model_copy(update={"drop_steps": (65,)}), o, keep_all, 70) is None


def test_the_states_of_one_pass_carry_the_list_from_one_to_the_next() -> None:
    """A pass writes states built one on the other (a health record, then the abort): the
    step the second gives up on is added to what the first carried, never lost to it."""
    d = running((1, 2), phase=Phase.CHECKPOINT, stop_step=60, drop_steps=(30,))
    o = obs(nodes(1, 2), [st(1, step=60), st(2, step=60)], commits=RECORDED)
    first = d.model_copy(update={"cause": "a record first"})
    torn = d.model_copy(update={"phase": Phase.TEARDOWN, "stop_step": -1})
    got = track(d, o, CFG, [SetDesired(first, "one"), SetDesired(torn, "two")])
    assert [a.state.drop_steps for a in got if isinstance(a, SetDesired)] == [(30,), (30, 60)]


def test_a_periodic_save_names_no_step_it_may_land_on_and_its_commit_audits_clean() -> None:
    """Steps 60 and 45 were given up on (the job relaunched from 40). A periodic save is
    asked for 58; the request reaches the workers late and they save 60, which is recorded.
    Its Checkpoint named 60 (every step but 58) and so did its Commit: ``sailor audit``
    reported a save asked to drop the step it recorded, on a healthy run. Now no step at or
    above the step asked is named (the save may land on any of them), and the Commit audits
    the list sent without the step saved."""
    p = PeriodicCheckpoint(step=58, requested=NOW - 5, deadline=NOW + 60, directory="/ck")
    d = _running(periodic=p).model_copy(update={"drop_steps": (45, 60)})
    asked = obs(nodes(1, 2), [st(1, step=56), st(2, step=56)], commits=RECORDED)
    assert {c.drop_steps for c in _checkpoints(decide(d, asked, CFG))} == {(45,)}
    o = obs(nodes(1, 2), [st(1, step=61, saved=60), st(2, step=61, saved=60)], commits=RECORDED)
    (c,) = [a for a in decide(d, o, CFG) if isinstance(a, Commit)]
    assert c.record.step == 60 and c.drop_steps == (45,)
    recs = [
        {"kind": "commit", "t": 1.0, "step": 40, "dropped": [], "drop_steps": []},
        {
            "kind": "commit",
            "t": 2.0,
            "step": c.record.step,
            "dropped": list(c.drop),
            "drop_steps": list(c.drop_steps or ()),
        },
    ]
    assert check(recs).violations == []


def test_a_late_stop_saved_past_the_stop_step_gives_nothing_up() -> None:
    """CHECKPOINT of stop step 60; the workers learned of the stop late and saved 62, and
    COMMIT takes 62. That move was read as giving 60 up: the state named 60 and the
    Commit's audited drop_steps named it, a list no Checkpoint was sent with."""
    d = running((1, 2), phase=Phase.CHECKPOINT, stop_step=60, phase_deadline=NOW + 60)
    assert _checkpoint_of(d).drop_steps == ()
    o = obs(nodes(1, 2), [st(1, step=62, saved=62), st(2, step=62, saved=62)], commits=RECORDED)
    (nxt,) = _sets(decide(d, o, CFG))
    assert nxt.phase is Phase.COMMIT and nxt.stop_step == 62 and nxt.drop_steps == ()
    (c,) = [a for a in decide(nxt, o, CFG) if isinstance(a, Commit)]
    assert c.record.step == 62 and c.drop_steps == ()
