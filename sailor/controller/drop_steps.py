"""The saves the controller gave up on, which the next saves' committers delete.

A save the controller gives up on may still commit on disk: the committer of an aborted
CHECKPOINT wrote its marker before the phase's deadline passed on another node, a periodic
save abandoned at its deadline or superseded by a reconfiguration committed late. No leader
records it, no launch loads it, and while the job is behind it (relaunched from an older
record) or stops there, no ``prune_below`` passes it: ~1.1 TB a step at 70B, for good. So
the controller remembers the steps of the saves it gave up on, in its desired state
(``DesiredState.drop_steps``: a new leader reads them, as it reads the phase), and every
Checkpoint names them (``Checkpoint.drop_steps``); after its own commit the committer
deletes those of them that were committed when its save began, their marker unchanged
(``checkpoint/unrecorded.py``). Only those: a commit the controller does not know (made
after the etcd snapshot a cluster was restored from, or another job's in the same directory)
is never deleted for being unknown.

The rules (:func:`track`, applied to a pass's actions):

- given up, and added: the stop step of a reconfiguration left in QUIESCE, CHECKPOINT or
  COMMIT for anything but its commit (an abort, a deadline passed, a new leader's abort of
  the phase it found; not the move to COMMIT at the later step the workers saved when
  they learned of the stop late: the same save, the step asked never saved), and the
  periodic save in flight of a RUNNING phase that ends it without a commit (abandoned at
  its deadline, failed, asked under another leader's directory, superseded), with the
  steps its nodes reported durable at or after it (the workers save at the first boundary
  at or after the step asked: a late request is saved later). A periodic save asked
  under another ``checkpoint_dir`` than this leader's is not added: its files are not
  where this leader's saves delete;
- never listed: a recorded step (any directory's records; a step given up and saved again
  since is recorded then and leaves the list), nor the step being saved
  (:func:`for_checkpoint`), nor, for a periodic save, any step at or above the one asked
  (``periodic._drop_steps``: a late request is saved at a later boundary, a step the save
  may land on and record);
- removed: every step, at the next commit. Nothing is added while a save is in flight (a
  save is given up only by the transition that ends it), so the save that commits carried
  every step of the list: its committer deleted each that was committed when it began,
  and a step that was not is not deleted later either. That is what can still leak: a
  given-up save whose committer commits only after the next save began (a committer that
  ran late), or a save agreed on an older request's list; plain retention deletes those
  once a later ``prune_below`` passes them;
- bounded: at most ``MAX_DROP_STEPS``, the oldest forgotten first (left on disk: a leak,
  never a wrong deletion). A job that gives up 64 saves without one commit is failing at
  every save.

Pure: no I/O, no clock, no module-level state. Must never add a recorded step or one of
another directory.
"""

from __future__ import annotations

from collections.abc import Iterable

from sailor.controller.decision_types import Action, Commit, DecideConfig, Observed, SetDesired
from sailor.schemas.runtime import MAX_DROP_STEPS, DesiredState, Phase

__all__ = ["for_checkpoint", "given_up", "track"]

_SAVING = (Phase.QUIESCE, Phase.CHECKPOINT, Phase.COMMIT)
"""The phases of a reconfiguration's save of its stop step (its Checkpoint goes out from
QUIESCE on)."""


def for_checkpoint(
    d: DesiredState, o: Observed, cfg: DecideConfig, step: int
) -> tuple[int, ...] | None:
    """The ``Checkpoint.drop_steps`` of a save of ``step``: the steps given up on, without
    any recorded step or ``step``; None with ``keep_checkpoints`` null (the operator keeps
    every checkpoint: nothing is deleted for having been given up either)."""
    if cfg.keep_checkpoints is None:
        return None
    recorded = {c.step for c in o.commits}
    return tuple(sorted(s for s in d.drop_steps if s not in recorded and s != step))


def given_up(
    prev: DesiredState, new: DesiredState, o: Observed, cfg: DecideConfig, committed: bool
) -> list[int]:
    """The steps of the saves ``prev`` had in flight that ``new`` gives up on (``committed``:
    the pass recorded a commit before ``new``, which ends the save in flight as done)."""
    if committed:
        return []
    out: list[int] = []
    if prev.phase in _SAVING and prev.stop_step >= 0:
        # a later stop step is the same save: CHECKPOINT moves to COMMIT at the step the
        # workers saved, later than the one asked when they learned of the stop late
        # (``checkpointing.quiesce_like``); the step asked was never saved
        same = (
            new.phase in _SAVING
            and new.stop_step >= prev.stop_step
            and new.generation == prev.generation
        )
        if not same:
            out.append(prev.stop_step)
    p = prev.periodic
    if prev.phase is Phase.RUNNING and p.step >= 0 and p.directory == cfg.checkpoint_dir:
        q = new.periodic
        same = new.phase is Phase.RUNNING and new.generation == prev.generation and q.step == p.step
        if not same:
            out.append(p.step)
            for n in sorted(prev.placement):
                st = o.status.get(n)
                if st is not None and st.generation == prev.generation and st.saved_step > p.step:
                    out.append(st.saved_step)
    return out


def _bounded(steps: Iterable[int], recorded: set[int]) -> tuple[int, ...]:
    """``steps`` once each in their order, without recorded ones, the newest
    ``MAX_DROP_STEPS``."""
    out: list[int] = []
    for s in steps:
        if s not in recorded and s not in out:
            out.append(s)
    return tuple(out[-MAX_DROP_STEPS:])


def track(d: DesiredState, o: Observed, cfg: DecideConfig, actions: list[Action]) -> list[Action]:
    """``actions`` (a pass's, decided from ``d``) with each desired state written holding
    the steps given up on (``DesiredState.drop_steps``): a commit empties the list (its save
    carried it), a transition that gives up a save in flight adds its steps
    (:func:`given_up`), recorded steps never stay. The states of the pass are built one on
    the other: each is compared with the one before it as decided."""
    recorded = {c.step for c in o.commits}
    drops = d.drop_steps
    prev = d
    committed = False
    out: list[Action] = []
    for a in actions:
        if isinstance(a, Commit):
            recorded.add(a.record.step)
            committed, drops = True, ()
        elif isinstance(a, SetDesired):
            gone = given_up(prev, a.state, o, cfg, committed)
            prev, committed = a.state, False
            drops = _bounded((*drops, *gone), recorded)
            if drops != a.state.drop_steps:
                state = a.state.model_copy(update={"drop_steps": drops})
                a = SetDesired(state, a.reason, a.load_directory)
        out.append(a)
    return out
