"""Which recorded commit a launch loads, from where, and when none may be loaded.

A commit is recorded with the directory it was saved under (``CommitRecord.directory``):
after ``checkpoint_dir`` moved, a launch loads it from there, not from the new directory
(before, every node failed to read ``/ck/step 900``, the step was marked bad and the job
walked down the old records to a fresh start). Records of the earlier directory go once
``keep`` good commits of the new one are newer. When the job has commits but every one is
marked bad (a checkpoint mount that did not come back), the job is held in IDLE with a
cause saying what to do, never started from step 0; a job with no commit starts fresh.
"""

from __future__ import annotations

import json
from dataclasses import replace

from sailor.controller.checkpointing import prune_below
from sailor.controller.decide import decide
from sailor.controller.decision_types import ClearBadDone, Commit, Observed, Send, SetDesired
from sailor.controller.launch import UNLOADABLE_PREFIX
from sailor.schemas.commands import Launch
from sailor.schemas.runtime import (
    AgentStatus,
    ClearBadRequest,
    CommitRecord,
    DesiredState,
    PeriodicCheckpoint,
    Phase,
)
from tests.unit.test_controller_decide import (
    CFG,
    NOW,
    _planned,
    _sets,
    nodes,
    obs,
    running,
    st,
)

MOVED = (CommitRecord(step=900, directory="/old"), CommitRecord(step=500, directory="/ck"))


def _idle(ids: tuple[int, ...] = (1, 2)) -> DesiredState:
    return _planned(running(ids, phase=Phase.IDLE, placement={}, plan=None), ids)


def _launches(actions: list[object]) -> list[Launch]:
    return [a.command for a in actions if isinstance(a, Send) and isinstance(a.command, Launch)]


def _reader_error(i: int, error: str, gen: int = 1) -> AgentStatus:
    """A worker's record of the checkpoint reader's error of step 30."""
    message = {
        "NoCheckpointError": "step 30 is not committed (step-000000030/COMMITTED absent)",
        "CorruptCheckpointError": "/ck/step-000000030/layer-00001.bin: checksum mismatch",
    }[error]
    record = {"rank": i - 1, "origin": "local", "retry": False}
    record |= {"error_type": error, "message": message}
    return st(i, gen=gen, state="failed").model_copy(update={"failure": json.dumps(record)})


def test_a_commit_of_an_earlier_directory_is_loaded_from_its_own() -> None:
    """Records /old@900 and /ck@500 (checkpoint_dir now /ck): the launch loads 900 from
    /old, where it was saved; a commit of the current directory from it."""
    idle = _idle()
    o = obs(nodes(1, 2), [st(1, gen=-1, state="idle"), st(2, gen=-1, state="idle")])
    o = obs(o.nodes, list(o.status.values()), commits=MOVED)
    (launch,) = _sets(decide(idle, o, CFG))
    assert launch.phase is Phase.LAUNCH and launch.load_step == 900
    sent = _launches(decide(launch, o, CFG))
    assert [(c.checkpoint, c.load_step) for c in sent] == [("/old", 900)] * 2
    fell = launch.model_copy(update={"load_step": 500})
    assert {c.checkpoint for c in _launches(decide(fell, o, CFG))} == {"/ck"}
    fresh = launch.model_copy(update={"load_step": -1})
    assert {c.checkpoint for c in _launches(decide(fresh, o, CFG))} == {""}


def test_records_of_an_earlier_directory_go_with_the_current_ones_retention() -> None:
    """keep 1: the save of 1200 keeps /ck@1100 and drops every record below it, /old@900
    included (its files stay: a committer deletes under its own directory only); the
    retention of /ck is counted on /ck's records alone."""
    commits = (*MOVED, CommitRecord(step=1100, directory="/ck"))
    assert prune_below(commits, "/ck", 1) == 1100
    assert prune_below(commits, "/old", 1) == 900
    d = running((1,), phase=Phase.COMMIT, stop_step=1200)
    a = decide(
        d, obs(nodes(1), [st(1, step=1200, saved=1200, state="stopped")], commits=commits), CFG
    )
    assert isinstance(a[0], Commit) and a[0].record.directory == "/ck"
    assert a[0].drop == (500, 900)
    # fewer than keep good commits under /ck: nothing of /old goes
    a = decide(
        d, obs(nodes(1), [st(1, step=1200, saved=1200, state="stopped")], commits=MOVED[:1]), CFG
    )
    assert isinstance(a[0], Commit) and a[0].drop == ()
    # a periodic commit drops alike (before, only /ck@500: /old@900 stayed for ever)
    flying = PeriodicCheckpoint(step=1200, requested=NOW - 5, deadline=NOW + 60, directory="/ck")
    d = running((1,), periodic=flying)
    a = decide(d, obs(nodes(1), [st(1, step=1201, saved=1200)], commits=commits), CFG)
    (commit,) = (x for x in a if isinstance(x, Commit))
    assert commit.periodic and commit.record.directory == "/ck" and commit.drop == (500, 900)
    a = decide(d, obs(nodes(1), [st(1, step=1201, saved=1200)], commits=MOVED[:1]), CFG)
    (commit,) = (x for x in a if isinstance(x, Commit))
    assert commit.drop == ()


def _every_commit_unreadable(error: str) -> tuple[DesiredState, Observed]:
    """Steps 10 and 20 are marked bad; every placed node fails to read 30, the last one:
    the abort marks it bad too. Returns (the teardown's state, the idle observation)."""
    commits = tuple(CommitRecord(step=s, directory="/ck") for s in (10, 20, 30))
    d = running((1, 2), phase=Phase.LOAD, load_step=30, bad_checkpoints=(10, 20))
    d = d.model_copy(update={"phase_deadline": 1e12})
    o = obs(nodes(1, 2), [_reader_error(i, error) for i in (1, 2)], commits=commits)
    (torn,) = _sets(decide(d, o, CFG))
    assert torn.phase is Phase.TEARDOWN and torn.bad_checkpoints == (10, 20, 30)
    idle = obs(o.nodes, [st(i, state="idle") for i in (1, 2)], commits=commits)
    return _planned(torn, (1, 2)), idle


def test_every_commit_marked_bad_holds_the_job_instead_of_starting_from_step_0() -> None:
    """Before, the teardown launched with load_step -1: a fresh start over 30 steps. Now
    IDLE, held, the cause naming what to do; the hold is written once; clearing the marks
    (the mount is back) launches from the newest commit."""
    torn, idle = _every_commit_unreadable("NoCheckpointError")
    (held,) = _sets(decide(torn, idle, CFG))
    assert held.phase is Phase.IDLE and held.load_step == -1
    assert held.cause.startswith(UNLOADABLE_PREFIX)
    assert "step 30, 20, 10, under /ck" in held.cause
    assert "sailor checkpoint clear-bad" in held.cause and "mount" in held.cause
    assert "not committed there on any node, NoCheckpointError" in held.cause  # the abort's
    assert decide(held, idle, CFG) == []
    clear = replace(idle, clear_bad={"r1": ClearBadRequest(all=True)})
    states = _sets(decide(held, clear, CFG))
    assert states[-1].phase is Phase.LAUNCH and states[-1].load_step == 30
    assert not states[-1].cause.startswith(UNLOADABLE_PREFIX)


def test_the_abort_tells_an_absent_step_from_corrupt_files() -> None:
    """Every placed node failing alike: NoCheckpointError (nothing committed there, on any
    node: the storage) or CorruptCheckpointError (its files) is said in the cause."""
    torn, _ = _every_commit_unreadable("CorruptCheckpointError")
    assert "every placed node (its files missing, truncated or failing" in torn.cause
    torn, _ = _every_commit_unreadable("NoCheckpointError")
    assert "is the storage mounted?" in torn.cause


def test_a_job_without_any_commit_still_starts_fresh() -> None:
    idle = _idle()
    o = obs(nodes(1, 2), [st(1, gen=-1, state="idle"), st(2, gen=-1, state="idle")])
    (launch,) = _sets(decide(idle, o, CFG))
    assert launch.phase is Phase.LAUNCH and launch.load_step == -1


def _moved() -> tuple[DesiredState, Observed]:
    """The storage moved: /old copied to /ck (checkpoint_dir now /ck), /old gone. Both
    records name /old; launches of each failed to read it and marked it bad: held."""
    commits = (CommitRecord(step=800, directory="/old"), CommitRecord(step=900, directory="/old"))
    idle = _idle().model_copy(update={"bad_checkpoints": (800, 900)})
    o = obs(nodes(1, 2), [st(1, gen=-1, state="idle"), st(2, gen=-1, state="idle")])
    return idle, replace(o, commits=commits)


def test_a_job_held_after_its_storage_moved_is_told_so_and_repointed_resumes() -> None:
    """Before, the hold said to check the storage and clear the marks, which only loops
    (each launch reads /old again), and deleting the records started from step 0. Now the
    cause names the records of another directory and what to do, and clear-bad --all
    --repoint re-points them to /ck and clears their marks: the launch loads 900 from /ck."""
    idle, o = _moved()
    (held,) = _sets(decide(idle, o, CFG))
    assert held.phase is Phase.IDLE and held.cause.startswith(UNLOADABLE_PREFIX)
    assert "Step 900, 800 recorded under /old, not checkpoint_dir /ck" in held.cause
    assert "sailor checkpoint clear-bad --all --repoint --from /old loads" in held.cause
    assert "make /old readable on the nodes again" in held.cause
    ask = replace(o, clear_bad={"r1": ClearBadRequest(all=True, repoint=True, who="op")})
    a = decide(held, ask, CFG)
    (done,) = (x for x in a if isinstance(x, ClearBadDone))
    assert [(c.step, c.directory) for c in done.repointed] == [(800, "/ck"), (900, "/ck")]
    assert done.cleared == (800, 900) and "re-pointed the records of step 800, 900" in done.reason
    launch = _sets(a)[-1]
    assert launch.phase is Phase.LAUNCH and launch.load_step == 900 and not launch.bad_checkpoints
    moved = replace(o, commits=done.repointed)
    assert {c.checkpoint for c in _launches(decide(launch, moved, CFG))} == {"/ck"}
    # without --repoint the marks go and the launch reads /old again: the loop of before
    a = decide(held, replace(o, clear_bad={"r1": ClearBadRequest(all=True)}), CFG)
    (done,) = (x for x in a if isinstance(x, ClearBadDone))
    assert done.repointed == ()
    assert {c.checkpoint for c in _launches(decide(_sets(a)[-1], o, CFG))} == {"/old"}


def test_a_repoint_without_marks_rewrites_only_the_records() -> None:
    """Moved before any launch failed: a re-point of step 900 changes no desired state; the
    record comes with the request's deletion. A step with no mark and no record elsewhere
    is said so."""
    _, o = _moved()
    d = running((1, 2))
    o = replace(o, status={s.node_id: s for s in (st(1), st(2))})
    req = ClearBadRequest(steps=(500, 900), repoint=True)
    a = decide(d, replace(o, commits=(*o.commits, *MOVED[1:]), clear_bad={"r1": req}), CFG)
    assert not _sets(a)
    (done,) = (x for x in a if isinstance(x, ClearBadDone))
    assert [(c.step, c.directory) for c in done.repointed] == [(900, "/ck")]
    assert "no bad or suspect mark nor a record elsewhere than /ck on step 500" in done.reason


def _launch_dirs(a: list[object]) -> list[str | None]:
    """The ``load_directory`` of each move to LAUNCH in ``a`` (what its phase record names)."""
    return [
        x.load_directory for x in a if isinstance(x, SetDesired) and x.state.phase is Phase.LAUNCH
    ]


def test_a_launch_names_the_directory_it_loads_from() -> None:
    """The move to LAUNCH carries the checkpoint root its Launch commands load from, for
    the phase record (``Executor.write_desired``): the load step's recorded directory, not
    ``checkpoint_dir``; the new one once a re-point in the same pass moved the record; ''
    for a fresh start. Before, the record named the load step only: an operator could not
    tell which directory a relaunch read."""
    idle, o = _moved()
    marks_gone = replace(o, clear_bad={"r1": ClearBadRequest(all=True, who="op")})
    a = decide(idle, marks_gone, CFG)
    assert _launch_dirs(a) == ["/old"]
    assert {c.checkpoint for c in _launches(decide(_sets(a)[-1], o, CFG))} == {"/old"}
    moved = replace(o, clear_bad={"r1": ClearBadRequest(all=True, repoint=True, who="op")})
    assert _launch_dirs(decide(idle, moved, CFG)) == ["/ck"]
    fresh = obs(nodes(1, 2), [st(1, gen=-1, state="idle"), st(2, gen=-1, state="idle")])
    assert _launch_dirs(decide(_idle(), fresh, CFG)) == [""]
    # any other state names none
    assert all(
        x.load_directory is None
        for x in decide(idle, o, CFG)
        if isinstance(x, SetDesired) and x.state.phase is not Phase.LAUNCH
    )
