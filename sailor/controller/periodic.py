"""The controller's periodic checkpoint of a RUNNING job, in a ``decide`` pass.

Commits are otherwise recorded only at reconfigurations (and preemption notices): a job that
ran for days with no join, leave or notice and then lost a node without notice (a GPU fault,
a kernel panic) relaunched from the commit of days before. Every ``checkpoint_every_s``
(``DecideConfig``; the controller config's ``checkpoint_every_s``, an hour by default) the
RUNNING job is asked to save through the protocol of a reconfiguration's checkpoint, without
the stop:

- requested (:func:`periodic`): a ``Checkpoint`` of step S to every node of the layout, with
  the retention's ``prune_below`` and the saves the controller gave up on (``drop_steps``: the
  committer deletes those it finds committed, ``controller/drop_steps.py``); S is ahead of
  every node's reported step by the steps the iteration time makes of ``_REQUEST_LEAD_S`` (at
  least ``stop_ahead_steps``), so the request reaches every node before its ranks get there.
  The workers agree on the save step at each iteration boundary
  (``megatron_patch/control.py``: a MAX all-reduce of the requested step), so a request that
  reaches one node late still has every rank save the same step, the first boundary at or
  after S that some rank knew of it; the step they report is the step committed. They save and
  train on (no stop step is asked);
- committed (:func:`committed`): once every node reports it durable (``saved_step``), a
  ``CommitRecord`` as at a reconfiguration, under the directory the save was asked to
  (``PeriodicCheckpoint.directory``, whichever leader records it), the records below the
  retention's step (``keep_checkpoints``) dropped, an earlier directory's too; the save's
  own ``prune_below`` is also at most the oldest recorded step, since an abandoned save
  may still commit and prune (so one checkpoint more than a reconfiguration's retention
  stays on disk, deleted by the next save). A crash
  relaunch loads it (``Observed.resumable``), like any commit. Checked first in a RUNNING
  pass: a save every node reported durable before one of them was lost is recorded before
  the abort chooses the step to load;
- abandoned: a save not durable on every node by its deadline (the iterations to S, then
  the CHECKPOINT phase's deadline of the plan) is audited and never recorded; the next is due
  ``checkpoint_every_s`` after it was asked for. So is one asked under another directory
  than this leader's ``checkpoint_dir`` (a standby of another config took over mid-save):
  re-sent under this one the workers would skip it (they took that step once) and the
  commit would name a directory it was never saved to. It does not abort the job: a
  periodic save is no reconfiguration;
- failed (:func:`_failed`): the Checkpoint says ``periodic``, so the workers take the save
  as optional: one that fails on some rank (a storage error, a committer's timeout) is
  agreed by every rank and reported, and they train on (``megatron_patch/boundary.py``).
  A node of the layout that reports it (``AgentStatus.save_failed_step`` at or after S, this
  generation) ends the save at once, abandoned with what failed, rather than at its
  deadline. A refusal of non-finite weights still fails the workers (the weights are bad);
- superseded (:func:`superseded`): a reconfiguration (a join, a notice, an abort) takes
  precedence. Leaving RUNNING drops the save in flight (``move_to`` resets
  ``DesiredState.periodic``) and it is audited as abandoned; the reconfiguration's own
  Checkpoint overwrites the agents' request (a worker holding at the stop step saves that
  step, whichever save step it was asked for), and a commit its workers may still make is
  never recorded (its ``prune_below`` deletes only what a recorded commit already put below
  the kept ones).

The worker's own ``TrainingConfig.checkpoint.every_steps`` saves are another thing: made
for runs without a controller, into their own directory, neither recorded nor loaded by it.

Each step is audited (``PeriodicOutcome``: requested, committed, abandoned). What a pass
must remember (the step in flight, its deadline, when it was asked for) is in the desired
state (``DesiredState.periodic``, wire version 7); the time comes in as ``Observed.now``.

Pure: no I/O, no clock, no module-level state.
"""

from __future__ import annotations

import math
from dataclasses import replace

from sailor.controller import drop_steps
from sailor.controller.checkpointing import prune_below
from sailor.controller.decision_types import (
    Action,
    Commit,
    DecideConfig,
    Observed,
    PeriodicOutcome,
    Send,
    SetDesired,
    build_command,
    command_id_for,
    phase_deadline,
    plan_nodes_at,
)
from sailor.controller.plan_deadlines import iteration_time
from sailor.schemas.commands import Checkpoint
from sailor.schemas.runtime import CommitRecord, DesiredState, PeriodicCheckpoint, Phase

__all__ = ["committed", "iteration_estimate", "periodic", "superseded"]

_REQUEST_LEAD_S = 2.0
"""Seconds between the steps a pass reads and the request's arrival at every node's ranks: an
agent writes its status at most every ``status_interval_s`` (0.2 s), a status change wakes the
leader after its ``debounce_s`` (0.3 s), then a pass, the commands' fan-out (on a LAN a few ms
per node, in parallel) and the control file read at the next iteration boundary. A guess with
a margin, not a measurement: a request late on some node costs only a save a few steps later
(the workers agree on it), and the toy trainer, which saves only at the exact step, gives it
up and reports it (``save_failed``): the save is abandoned at once and asked again."""

_PACE_MIN_STEPS = 2
"""Steps since RUNNING began before their pace stands for the iteration time."""


def iteration_estimate(d: DesiredState, o: Observed, cfg: DecideConfig) -> tuple[float | None, str]:
    """Seconds per iteration of the running plan and the basis: the one the cluster
    measured for this plan (online calibration), else the pace since RUNNING began (the
    slowest node's steps past the first after the load, over the time since: a step done
    before the phase's start counted as since makes it shorter, and S further ahead), else
    the plan's prediction; (None, '') when none."""
    it, basis = iteration_time(d.plan, cfg.measured) if d.plan is not None else (None, "")
    if basis.startswith("measured"):
        return it, basis
    steps = [s.step for n in d.placement if (s := o.status.get(n)) is not None]
    done = min(steps, default=-1) - (max(d.load_step, 0) + 1)
    elapsed = o.now - d.phase_since
    if len(steps) == len(d.placement) and done >= _PACE_MIN_STEPS and elapsed > 0:
        return elapsed / done, f"pace: {done} steps in {elapsed:.1f} s"
    return it, basis


def _step_ahead(d: DesiredState, o: Observed, cfg: DecideConfig) -> tuple[int, float, str]:
    """``(S, seconds allowed to reach it, why)``: S past every node's reported step by the
    iterations of ``_REQUEST_LEAD_S``, at least ``stop_ahead_steps``."""
    top = max(o.status[n].step for n in d.placement)
    it, basis = iteration_estimate(d, o, cfg)
    ahead = cfg.stop_ahead_steps
    reach = phase_deadline(d, Phase.QUIESCE, cfg).seconds
    if it is None:
        return top + ahead, reach, "no iteration time: stop_ahead_steps ahead"
    ahead = max(ahead, math.ceil(_REQUEST_LEAD_S / it))
    # a node may be a step behind the highest report: as QUIESCE is sized
    reach = max(reach, cfg.deadlines.derive.safety * (ahead + 1) * it)
    return top + ahead, reach, f"{ahead} steps of {it:.3g} s ({basis}) ahead of step {top}"


def _sends(d: DesiredState, o: Observed, cfg: DecideConfig) -> list[Action]:
    """The Checkpoint of the save in flight to every node of the layout that has not acked
    it (its own command id kind: never a reconfiguration's checkpoint of the same step)."""
    p = d.periodic
    # Below the oldest recorded commit too: an abandoned save may still commit, and then
    # prune, after the leader gave up on it; no record may point at files it deleted. The
    # commit drops the records below the retention's step (``committed``), and the next
    # save deletes their files: one checkpoint more on disk than a reconfiguration keeps.
    recorded = [c.step for c in o.commits if c.directory == cfg.checkpoint_dir]
    below = min(_prune_below(d, o, cfg), min(recorded, default=-1), p.step)
    out: list[Action] = []
    for n in sorted(d.placement):
        cid = command_id_for(d, "pckpt", n, p.step)
        if cid in o.acked:
            continue
        cmd = build_command(
            Checkpoint,
            command_id=cid,
            epoch=d.epoch,
            plan_id=d.plan.plan_id if d.plan else "",
            node_id=n,
            deadline=p.deadline,
            step=p.step,
            directory=p.directory,
            prune_below=below,
            periodic=True,
            drop_steps=_drop_steps(d, o, cfg, p.step),
        )
        out.append(Send(cmd))
    return out


def _drop_steps(
    d: DesiredState, o: Observed, cfg: DecideConfig, step: int
) -> tuple[int, ...] | None:
    """The ``drop_steps`` of the periodic save of ``step``: the steps given up on
    (``drop_steps.for_checkpoint``) below ``step``. The workers save at the first boundary
    at or after it that some rank knew of the request (a late request is saved later), so
    any step at or above it is one the save may land on and then record: never named,
    whatever the committer does with its own step (it never deletes it), so no save is ever
    asked to drop the step it records (``sailor audit``). Such a given-up step goes with
    the first save past it (or a later ``prune_below``)."""
    asked = drop_steps.for_checkpoint(d, o, cfg, step)
    return None if asked is None else tuple(s for s in asked if s < step)


def _prune_below(d: DesiredState, o: Observed, cfg: DecideConfig) -> int:
    return prune_below(o.commits, cfg.checkpoint_dir, cfg.keep_checkpoints, d.bad_checkpoints)


def committed(
    d: DesiredState, o: Observed, cfg: DecideConfig
) -> tuple[list[Action], DesiredState, Observed] | None:
    """The save in flight, once every node of the layout reports it durable: its commit
    record (the step the workers saved: at or after the one asked, the same on every rank),
    the records of the steps its committer deleted dropped, and ``d`` and ``o`` as they are
    once it is recorded (a later abort in the same pass loads it). None otherwise."""
    p = d.periodic
    if d.phase is not Phase.RUNNING or p.step < 0:
        return None
    if not plan_nodes_at(d, o, lambda s: s.saved_step >= p.step):
        return None
    saved = min(o.status[n].saved_step for n in d.placement)
    # the directory the save was asked to: a leader whose ``checkpoint_dir`` differs (a
    # standby of another config that took over mid-save) records where the files are
    record = CommitRecord(
        step=saved,
        directory=p.directory,
        plan_id=d.plan.plan_id if d.plan else "",
        generation=d.generation,
        epoch=d.epoch,
        time=o.now,
        periodic=True,
    )
    # the records below the retention's step go (their files the next save deletes,
    # ``_sends``): only the leader writes records, and none changed since the request.
    # Those of an earlier directory with them, as at a reconfiguration's commit
    # (``checkpointing.committing``): once ``keep`` good commits here are newer no launch
    # falls back to them (their files stay where they are)
    keep = prune_below(o.commits, p.directory, cfg.keep_checkpoints, d.bad_checkpoints)
    below = min(keep, saved)
    drop = tuple(sorted(c.step for c in o.commits if c.step < below))
    # a step saved again is new files: its bad mark was the old ones' (as ``committing``)
    bad = tuple(s for s in d.bad_checkpoints if s != saved)
    nxt = d.model_copy(
        update={"periodic": PeriodicCheckpoint(requested=p.requested), "bad_checkpoints": bad}
    )
    why = f"periodic checkpoint of step {saved} committed"
    actions: list[Action] = [
        # the request's drop_steps: neither the records nor the steps given up on change
        # while it is in flight (a reconfiguration drops it; a new leader re-sends it with
        # the same); the commit empties the list (``drop_steps.track``)
        Commit(record, drop, periodic=True, drop_steps=_commit_drop_steps(d, o, cfg, saved)),
        PeriodicOutcome("committed", saved, d.generation, f"asked for step {p.step}"),
        SetDesired(nxt, why),
    ]
    gone = {*drop, saved}
    commits = (*(c for c in o.commits if c.step not in gone), record)
    return actions, nxt, replace(o, commits=tuple(sorted(commits, key=lambda c: c.step)))


def _commit_drop_steps(
    d: DesiredState, o: Observed, cfg: DecideConfig, saved: int
) -> tuple[int, ...] | None:
    """The ``drop_steps`` the Commit of the save in flight audits: the list its Checkpoint
    was sent (``_drop_steps`` of the step asked), without the step saved."""
    sent = _drop_steps(d, o, cfg, d.periodic.step)
    return None if sent is None else tuple(s for s in sent if s != saved)


def periodic(d: DesiredState, o: Observed, cfg: DecideConfig) -> list[Action]:
    """A RUNNING pass with nothing else to do: the save in flight sent (until acked) or
    abandoned past its deadline; else a new one once due (``checkpoint_every_s`` after the
    phase began or the last was asked for) and every node of the layout reports a step of
    this generation."""
    p = d.periodic
    if p.step >= 0:
        failed = _failed(d, o, p.step)
        if p.directory != cfg.checkpoint_dir:
            # asked by a leader of another config: sent here, the workers would skip it
            # (they took step S once, ``Boundary.saved_requests``) and this leader would
            # record S under a directory it was never saved to
            late = (
                f"asked under {p.directory}, this leader's checkpoint_dir is {cfg.checkpoint_dir}"
            )
        elif o.now <= p.deadline and not failed:
            return _sends(d, o, cfg)
        elif failed:
            late = failed
        else:
            late = f"not durable on every node by its deadline ({_not_saved(d, o, p.step)})"
        why = f"{late}; asked again next interval"
        nxt = d.model_copy(update={"periodic": PeriodicCheckpoint(requested=p.requested)})
        return [
            PeriodicOutcome("abandoned", p.step, d.generation, why[:1024]),
            SetDesired(nxt, f"periodic checkpoint of step {p.step} abandoned: {late}"[:1024]),
        ]
    every = cfg.checkpoint_every_s
    if every <= 0 or o.now < max(d.phase_since, p.requested) + every:
        return []
    if not d.placement or not plan_nodes_at(d, o, lambda s: s.step >= 0):
        return []
    step, reach, how = _step_ahead(d, o, cfg)
    save = phase_deadline(d, Phase.CHECKPOINT, cfg).seconds
    deadline = o.now + reach + save
    ask = PeriodicCheckpoint(
        step=step, requested=o.now, deadline=deadline, directory=cfg.checkpoint_dir
    )
    nxt = d.model_copy(update={"periodic": ask})
    why = f"{how}; abandoned unless durable within {deadline - o.now:.0f} s"
    return [
        PeriodicOutcome("requested", step, d.generation, why),
        SetDesired(nxt, f"periodic checkpoint of step {step} asked for"),
        *_sends(nxt, o, cfg),
    ]


def _failed(d: DesiredState, o: Observed, step: int) -> str:
    """What failed in the save of ``step``, as the first node of the layout that reports it
    failed says (a ``save_failed_step`` at or after it, this generation: the workers save at
    the first boundary at or after S); '' if none does."""
    for n in sorted(d.placement):
        st = o.status.get(n)
        if st is not None and st.generation == d.generation and st.save_failed_step >= step:
            where = f"step {st.save_failed_step}"
            return f"the save failed ({n} reports, {where}): {st.save_failure or 'no cause given'}"
    return ""


def _not_saved(d: DesiredState, o: Observed, step: int) -> str:
    """The nodes that have not reported ``step`` durable, with what they report."""
    out = []
    for n in sorted(d.placement):
        st = o.status.get(n)
        if st is None or st.generation != d.generation:
            out.append(f"{n}: no status of generation {d.generation}")
        elif st.saved_step < step:
            out.append(f"{n}: at step {st.step}, saved {st.saved_step}")
    shown = ", ".join(out[:3])
    return shown + (f" (and {len(out) - 3} more)" if len(out) > 3 else "")


def superseded(d: DesiredState, actions: list[Action]) -> list[Action]:
    """The audit of a save in flight that a pass leaving RUNNING drops (a reconfiguration
    takes precedence: ``move_to`` resets ``DesiredState.periodic``); [] otherwise."""
    p = d.periodic
    if d.phase is not Phase.RUNNING or p.step < 0:
        return []
    for a in actions:
        if isinstance(a, SetDesired) and a.state.phase is not Phase.RUNNING:
            why = f"superseded: {a.reason}"[:1024]
            return [PeriodicOutcome("abandoned", p.step, d.generation, why)]
    return []
