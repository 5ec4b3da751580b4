"""An operator's request to clear bad checkpoint marks (``sailor checkpoint clear-bad``,
``controller/bad_marks.py``) at the decide level: the leader applies it in a pass and
deletes it, never aborting a running generation for it; a TEARDOWN after an abort takes
the newest readable commit again; a suspect mark goes too; steps without a mark are named.
The request's trip through etcd and the CLI: tests/integration/test_checkpoint_clear_bad.py."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from sailor.controller.checkpointing import prune_below
from sailor.controller.decide import decide
from sailor.controller.decision_types import Action, ClearBadDone, Observed, SetDesired
from sailor.schemas.runtime import (
    ClearBadRequest,
    CommitRecord,
    DesiredState,
    Phase,
    SuspectCheckpoint,
)
from tests.unit.test_controller_decide import CFG, NOW, _planned, _sets, nodes, obs, running, st
from tests.unit.test_controller_suspect_checkpoint import (
    _first_strike,
    _loading,
    _o,
    _unreadable,
    _up,
)

IDS = (1, 2)
COMMITS = tuple(CommitRecord(step=s, directory="/ck") for s in (5, 9, 14))
ALL_IDS = (1, 2, 3, 4)


def _states(actions: list[Action]) -> list[DesiredState]:
    return [a.state for a in actions if isinstance(a, SetDesired)]


def _done(actions: list[Action]) -> list[ClearBadDone]:
    return [a for a in actions if isinstance(a, ClearBadDone)]


def _obs(statuses: list[object], **requests: ClearBadRequest) -> Observed:
    return obs(nodes(*IDS), statuses, commits=COMMITS, clear_bad=requests)


def test_a_cleared_step_in_a_teardown_is_what_the_next_launch_loads() -> None:
    """Step 14 was marked bad, the abort fell back to 9. The operator repaired the mount and
    cleared 14 during the teardown: its mark goes, the teardown's checkpoint becomes 14
    again, and the request is deleted with who asked and what went (the audit record)."""
    torn = running(IDS, phase=Phase.TEARDOWN, aborted=True, bad_checkpoints=(14,), load_step=9)
    torn = torn.model_copy(update={"phase_deadline": NOW + 60, "phase_epoch": 7})
    req = ClearBadRequest(steps=(14,), who="ops@head", time=NOW)
    a = decide(torn, _obs([st(1, state="idle"), st(2, state="idle")], r1=req), CFG)
    first = _states(a)[0]
    assert first.bad_checkpoints == () and first.load_step == 14
    assert isinstance(a[0], SetDesired)
    assert a[0].reason == (
        "cleared the bad checkpoint marks of step 14 (operator request r1 by ops@head): "
        "the next launch loads step 14"
    )
    assert _done(a) == [
        ClearBadDone("r1", "ops@head", (14,), False, (14,), "cleared the marks of step 14")
    ]


def test_a_running_generation_is_not_aborted_for_a_cleared_step() -> None:
    """The job runs from 9 (it fell back below 14): clearing 14 changes the mark only; the
    generation goes on, and the next launch that takes the newest readable commit may load
    14. Retention counts 14 as a good commit from then on (no hold for it)."""
    d = running(IDS, bad_checkpoints=(14,), load_step=9)
    req = ClearBadRequest(steps=(14,), who="ops@head")
    a = decide(d, _obs([st(1), st(2)], r1=req), CFG)
    (s,) = _states(a)
    assert s.phase is Phase.RUNNING and s.generation == d.generation and s.load_step == 9
    assert s.bad_checkpoints == ()
    assert [type(x).__name__ for x in a] == ["SetDesired", "ClearBadDone"]
    # behind its only mark, no save deleted a bad-marked commit; once cleared, 14 is kept
    # as the newest good one and the older go past ``keep``
    assert prune_below(COMMITS, "/ck", 2, d.bad_checkpoints) == 5
    assert prune_below(COMMITS, "/ck", 2, s.bad_checkpoints) == 9
    # and an IDLE job's next launch loads it
    ready = s.model_copy(
        update={
            "phase": Phase.IDLE,
            "next_plan": s.plan,
            "next_placement": dict(s.placement),
            "next_membership": s.membership,
        }
    )
    idle = _obs([st(1, state="idle"), st(2, state="idle")])
    (launch,) = _states(decide(ready, idle, CFG))
    assert launch.phase is Phase.LAUNCH and launch.load_step == 14


def test_a_suspect_mark_of_the_step_is_cleared_too_and_all_clears_every_mark() -> None:
    suspect = SuspectCheckpoint(step=14, nodes=("n2",), generation=1)
    d = running(IDS, bad_checkpoints=(5,), suspect_checkpoint=suspect)
    a = decide(d, _obs([st(1), st(2)], r1=ClearBadRequest(steps=(14,))), CFG)
    (s,) = _states(a)
    assert s.suspect_checkpoint == SuspectCheckpoint() and s.bad_checkpoints == (5,)
    a = decide(d, _obs([st(1), st(2)], r2=ClearBadRequest(all=True, who="ops@head")), CFG)
    (s,) = _states(a)
    assert s.suspect_checkpoint == SuspectCheckpoint() and s.bad_checkpoints == ()
    (done,) = _done(a)
    assert done.cleared == (5, 14) and done.all
    assert done.reason == "cleared the marks of step 5, 14"


def test_steps_without_a_mark_are_named_and_change_nothing() -> None:
    d = running(IDS, bad_checkpoints=(14,))
    a = decide(
        d,
        _obs([st(1), st(2)], r1=ClearBadRequest(steps=(3, 14)), r2=ClearBadRequest(steps=(7,))),
        CFG,
    )
    (s,) = _states(a)
    assert s.bad_checkpoints == ()
    assert [(x.request_id, x.cleared, x.reason) for x in _done(a)] == [
        ("r1", (14,), "cleared the marks of step 14; no bad or suspect mark on step 3"),
        ("r2", (), "no bad or suspect mark on step 7"),
    ]
    a = decide(d, _obs([st(1), st(2)], r3=ClearBadRequest(steps=(7,))), CFG)
    assert _states(a) == [] and [x.reason for x in _done(a)] == ["no bad or suspect mark on step 7"]


def test_a_clear_bad_request_names_steps_or_all() -> None:
    with pytest.raises(ValidationError, match=r"steps=\(\): empty: name steps, or set all"):
        ClearBadRequest()
    with pytest.raises(ValidationError, match="a negative step"):
        ClearBadRequest(steps=(-1,))
    with pytest.raises(ValidationError, match="sorted, without repeats"):
        ClearBadRequest(steps=(9, 5))
    req = ClearBadRequest(steps=(5, 9), who="ops@head", time=5.0)
    assert ClearBadRequest.model_validate_json(req.model_dump_json()) == req


def _all_unreadable() -> DesiredState:
    """Every placed node of generation 1 failed to read step 30: marked bad at the abort,
    the teardown falls back to 20."""
    (torn,) = _sets(decide(_loading((1, 2, 3, 4)), _o([_unreadable(i) for i in ALL_IDS]), CFG))
    assert torn.phase is Phase.TEARDOWN and torn.bad_checkpoints == (30,)
    assert torn.load_step == 20
    return torn


def test_a_clear_in_the_teardown_is_not_undone_by_the_reports_it_answered() -> None:
    """Step 30 marked bad (every node of generation 1 failed to read it), cleared in the
    teardown: it stays cleared, and the next launch loads it. Before, the same pass judged
    the aborted generation's read failures again (``suspect_checkpoint.late``, the reports
    still in the statuses): step 30 was marked bad again and the teardown fell back to 20,
    while the request was answered "cleared"."""
    torn = _all_unreadable()
    failed = [_unreadable(i) for i in ALL_IDS]
    a = decide(torn, _o(failed, clear_bad={"r1": ClearBadRequest(steps=(30,))}), CFG)
    last = _states(a)[-1]
    assert last.bad_checkpoints == () and last.load_step == 30
    assert last.reads_spent_through == torn.generation
    assert [x.cleared for x in _done(a)] == [(30,)]
    # nor does the next pass, the request gone and the reports still there
    assert all(s.bad_checkpoints == () for s in _states(decide(last, _o(failed), CFG)))
    # what the clear answered is the aborted generation's reports: the next generation
    # that fails to read the step on every node marks it bad again
    relaunch = _loading(ALL_IDS, gen=2, reads_spent_through=last.reads_spent_through)
    (torn2,) = _sets(decide(relaunch, _o([_unreadable(i, gen=2) for i in ALL_IDS]), CFG))
    assert torn2.bad_checkpoints == (30,) and torn2.load_step == 20


def test_a_cleared_suspect_mark_charges_its_nodes_once() -> None:
    """A first strike (n3 failed to read step 30, charged and excluded): the operator
    clears 30 in the teardown. Before, the same pass judged n3's report again, marked 30
    suspect again and charged n3 a second time (two exclusions for one failure)."""
    torn = _first_strike()
    charged = torn.node_health["n3"]
    statuses = [*_up((1, 2, 4), 1), _unreadable(3)]
    a = decide(torn, _o(statuses, clear_bad={"r1": ClearBadRequest(steps=(30,))}), CFG)
    last = _states(a)[-1]
    assert last.suspect_checkpoint == SuspectCheckpoint()
    assert last.node_health["n3"] == charged


def test_a_clear_of_another_step_leaves_the_teardowns_read_failures_to_be_judged() -> None:
    """A first strike on step 30 (n3 failed to read it, suspect), and an old bad mark on
    step 20 the operator clears in the teardown. n2's report that it failed to read step 30
    too comes in late: it is judged (n2 charged, the suspect's nodes n2 and n3). Before,
    any clear in an aborted teardown spent the generation's read failures, whatever step
    it cleared: n2's real failure went uncounted."""
    torn = _first_strike().model_copy(update={"bad_checkpoints": (20,)})
    statuses = [*_up((1, 4), 1), _unreadable(2), _unreadable(3)]
    a = decide(torn, _o(statuses, clear_bad={"r1": ClearBadRequest(steps=(20,))}), CFG)
    last = _states(a)[-1]
    assert last.bad_checkpoints == () and last.load_step == 30
    assert last.reads_spent_through == -1
    assert last.suspect_checkpoint.nodes == ("n2", "n3")
    assert "n2" in last.node_health
    assert [x.cleared for x in _done(a)] == [(20,)]


def test_the_next_launch_forgets_the_read_failures_a_clear_spent() -> None:
    """The generation whose read failures a clear spent is the aborted one: the next
    launch resets ``reads_spent_through``, so a state after it writes no version-6 field
    for it (``executor.write_desired``). Before, it was kept for every later generation."""
    torn = _all_unreadable()
    failed = [_unreadable(i) for i in ALL_IDS]
    a = decide(torn, _o(failed, clear_bad={"r1": ClearBadRequest(steps=(30,))}), CFG)
    cleared = _states(a)[-1]
    assert cleared.reads_spent_through == torn.generation
    idle = [st(i, state="idle") for i in ALL_IDS]
    acked = frozenset(f"e7-g1-abort-n{i}" for i in ALL_IDS)
    launched = [
        s
        for s in _states(decide(_planned(cleared, ALL_IDS), _o(idle, acked=acked), CFG))
        if s.phase is Phase.LAUNCH
    ]
    assert launched and launched[-1].generation == 2 and launched[-1].load_step == 30
    assert launched[-1].reads_spent_through == -1
