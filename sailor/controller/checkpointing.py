"""The checkpoint of a reconfiguration in a ``decide`` pass, and how many are kept.

QUIESCE and CHECKPOINT (``quiesce_like``): a Stop and a Checkpoint to every node of the
layout for the agreed stop step, a later notice tightening the deadline, the next plan
asked for meanwhile. COMMIT (``committing``): the saved step recorded (a bad mark of that
step, on files now replaced, cleared), and the records of the steps its committer deleted
forgotten. Both follow the retention rule ``prune_below``: the
oldest recorded step a new save leaves in place; and each Checkpoint names the saves the
controller gave up on (``drop_steps``, ``controller/drop_steps.py``), so its committer
deletes those that committed anyway.

Pure: no I/O, no clock, no module-level state.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from sailor.controller import drop_steps
from sailor.controller.aborts import abort, unhealthy
from sailor.controller.decision_types import (
    Action,
    Commit,
    DecideConfig,
    Observed,
    Send,
    SetDesired,
    build_command,
    command_id_for,
    move_to,
    plan_nodes_at,
    replan_if_needed,
)
from sailor.schemas.commands import Checkpoint, Stop
from sailor.schemas.runtime import AgentStatus, CommitRecord, DesiredState, Phase

__all__ = [
    "committing",
    "prune_below",
    "quiesce_like",
]


def quiesce_like(d: DesiredState, o: Observed, cfg: DecideConfig) -> list[Action]:
    why = unhealthy(d, o)
    if why:
        return abort(d, o, cfg, f"during {d.phase.value}: {why}")
    if o.now > d.phase_deadline:
        return abort(d, o, cfg, f"{d.phase.value} deadline passed")
    # a later notice tightens the deadline instead of aborting a checkpoint that can still make it
    noticed = [o.notices[n].deadline - cfg.notice_margin_s for n in d.placement if n in o.notices]
    if noticed and min(noticed) < d.phase_deadline:
        tighter = d.model_copy(update={"phase_deadline": min(noticed)})
        return [SetDesired(tighter, "notice tightened the deadline")]
    actions: list[Action] = []
    plan_id = d.plan.plan_id if d.plan else ""
    for n in sorted(d.placement):
        cid = command_id_for(d, "stop", n, d.stop_step)
        if cid not in o.acked:
            stop = build_command(
                Stop,
                command_id=cid,
                epoch=d.epoch,
                plan_id=plan_id,
                node_id=n,
                deadline=d.phase_deadline,
                at_step=d.stop_step,
            )
            actions.append(Send(stop))
        cid = command_id_for(d, "ckpt", n, d.stop_step)
        if cid not in o.acked:
            ckpt = build_command(
                Checkpoint,
                command_id=cid,
                epoch=d.epoch,
                plan_id=plan_id,
                node_id=n,
                deadline=d.phase_deadline,
                step=d.stop_step,
                directory=cfg.checkpoint_dir,
                prune_below=min(_prune_below(d, o, cfg), d.stop_step),
                drop_steps=drop_steps.for_checkpoint(d, o, cfg, d.stop_step),
            )
            actions.append(Send(ckpt))
    actions += replan_if_needed(d, o, d.cause, cfg)
    if d.phase is Phase.QUIESCE and plan_nodes_at(d, o, lambda s: s.step >= d.stop_step):
        actions.append(SetDesired(move_to(d, Phase.CHECKPOINT, o.now, cfg), "reached stop step"))
    elif d.phase is Phase.CHECKPOINT and plan_nodes_at(d, o, _saved_where_held(d.stop_step)):
        # Workers that learned of the stop step late stop and save a little after it (all at
        # the same step: they agree on it collectively); commit the step they saved.
        saved = min(o.status[n].saved_step for n in d.placement)
        nxt = move_to(d, Phase.COMMIT, o.now, cfg, stop_step=saved)
        actions.append(SetDesired(nxt, f"all shards of step {saved} durable"))
    return actions


def _saved_where_held(stop_step: int) -> Callable[[AgentStatus], bool]:
    """Whether a node's workers saved the step they stopped at: at or after the stop step,
    and not below the step they report. A save its workers passed is not the one the
    reconfiguration waits for: a periodic save (``controller/periodic.py``) of step
    T_p >= the stop step, taken before the Stop reached workers that then stopped at
    T > T_p, would commit T_p and lose T - T_p steps (in place, the held step would not be
    the load step). A worker reports a save made in passing at the next boundary, after
    that step's progress line, so its report is always below the step it reports then; a
    save at the step it holds at is reported with that step."""

    def saved(s: AgentStatus) -> bool:
        return s.saved_step >= max(stop_step, s.step)

    return saved


def _recorded(commits: Sequence[CommitRecord], directory: str) -> set[int]:
    """The steps of the commits recorded under ``directory``."""
    return {c.step for c in commits if c.directory == directory}


def prune_below(
    commits: Sequence[CommitRecord], directory: str, keep: int | None, bad: tuple[int, ...] = ()
) -> int:
    """The oldest step a new save under ``directory`` leaves in place: that of the
    ``keep``-th newest commit recorded there; -1 (delete nothing) with fewer records, or
    ``keep`` None. Only recorded commits count: one on disk that no leader recorded (lost
    between the marker and the record) never pushes out one a restart may load; nor does
    one a launch could not read (``bad``).

    Bad-marked commits, retention: a save deletes only step directories below the step it
    returns (never its own or newer ones), so a commit marked bad that is newer than where
    the job resumed (a fallback) cannot go until the job trained past it again. While the
    job is behind its newest bad mark (no good commit newer than it: it fell back, maybe to
    a fresh start) no bad-marked commit goes at all: the step is held at the oldest of
    them. A mark may be wrong (a storage outage every node saw, a mount the two-strike rule
    of ``controller/suspect_checkpoint.py`` could not rule out), and while the job has not
    redone that progress those commits are all that is left of it: an operator can still
    check them (``sailor ckpt verify``), repair the storage and clear the mark (``sailor
    checkpoint clear-bad``: ``controller/bad_marks.py``). A cleared step is a good commit
    like any other: it counts toward ``keep``, and while the job is behind it (it fell back
    below it) no save deletes it, as no save deletes a step newer than its own; the hold
    stays on the marks left. Once a good commit is newer than
    every mark the job has redone that progress and they are pruned as any other (without
    counting toward ``keep``). The cost is bounded: the bad commits, and the fallback run's
    own saves between the oldest and the newest of them."""
    recorded = _recorded(commits, directory)
    steps = sorted(recorded - set(bad), reverse=True)
    if keep is None or len(steps) < keep:
        return -1
    below = steps[keep - 1]
    marked = sorted(recorded & set(bad))
    if marked and steps[0] < marked[-1]:
        below = min(below, marked[0])
    return below


def _prune_below(d: DesiredState, o: Observed, cfg: DecideConfig) -> int:
    """:func:`prune_below` of the controller's directory, its retention and the desired
    state's unreadable checkpoints: what the next save's committer may delete below."""
    return prune_below(o.commits, cfg.checkpoint_dir, cfg.keep_checkpoints, d.bad_checkpoints)


def committing(d: DesiredState, o: Observed, cfg: DecideConfig) -> list[Action]:
    record = CommitRecord(
        step=d.stop_step,
        directory=cfg.checkpoint_dir,
        plan_id=d.plan.plan_id if d.plan else "",
        generation=d.generation,
        epoch=d.epoch,
        time=o.now,
    )
    below = _prune_below(d, o, cfg)
    # Records under an earlier ``checkpoint_dir`` go with those of this one: once ``keep``
    # good commits here are newer, no launch falls back to them. Their files stay where
    # they are (a committer deletes only under its own directory).
    drop = tuple(sorted(c.step for c in o.commits if c.step < below))
    # A step saved again (the job fell back below a bad-marked commit and trained past it)
    # is new files under a new manifest: the mark was the old files', and kept it would
    # make every later abort skip this commit and fall back below it.
    bad = tuple(s for s in d.bad_checkpoints if s != d.stop_step)
    nxt = move_to(d, Phase.TEARDOWN, o.now, cfg, load_step=d.stop_step, bad_checkpoints=bad)
    # the save's drop_steps: neither the records nor the steps given up on have changed
    # since its Checkpoint was sent (only the leader writes them, none in QUIESCE and
    # CHECKPOINT, and CHECKPOINT to COMMIT at a later step saved gives nothing up:
    # ``drop_steps.given_up``). Computed without the step saved, where the Checkpoint's
    # was without the step asked: when the workers saved a late stop, a step given up
    # earlier that is one of the two is in one list only (never a recorded step, so never
    # one the audit reports). The commit empties the list (``drop_steps.track``)
    asked = drop_steps.for_checkpoint(d, o, cfg, d.stop_step)
    commit = Commit(record, drop, drop_steps=asked)
    return [commit, SetDesired(nxt, f"committed step {d.stop_step}")]
