"""Saves the controller gave up on: which of them a save's committer deletes after its commit.

The controller keeps its checkpoints by records (etcd ``ckpt/<step>``), and a save's
``prune_below`` deletes only below the oldest record it keeps. A step that committed on disk
while the controller gave up on it (an aborted CHECKPOINT whose committer wrote its marker;
a periodic save abandoned, or superseded, that committed late) is never recorded and never
loaded, yet it stays on disk for as long as it is not below a later save's ``prune_below``:
while the job, relaunched from an older record, is behind it, or for ever once the job stops
there. At 70B each such step is ~1.1 TB. So the controller remembers the steps of the saves
it gave up on (``DesiredState.drop_steps``) and a save's Checkpoint names them
(``Checkpoint.drop_steps``, wire version 8); after its own commit the committer deletes
those of them it saw committed when its save began, at or above ``prune_below``.

A drop-list, not a keep-list: the committer deletes only what the controller says is its own
garbage. A commit the controller does not know (made after the etcd snapshot a cluster was
restored from, or another job's, pointed at the same directory by mistake) is never a
candidate unless its step is one the controller gave up on.

Why the steps committed *when the save began* (:func:`committed_markers`, taken on the
committer's persist thread before it writes), and only those:

- a committer that runs late (its persist outlived its world: a slow mount, a node cut off
  from the controller) holds a ``drop_steps`` that may be stale: a later generation may
  since have saved one of its steps again, and recorded it. That commit was not there when
  this save began, so it is never a candidate;
- an uncommitted step directory is never touched: it may be a save in flight under another
  generation (an abandoned periodic save still writing), to be left alone under its
  writers. Its debris goes with a later save's ``prune_below`` or ``sailor ckpt gc``;
- a candidate is deleted only if its marker is still the one seen when the save began: a
  step being saved again has lost its marker (``writer.commit`` un-commits before
  replacing a manifest) or carries another. Its directory is un-committed first, like every
  deletion (``gc``).

Pure decisions (:func:`decide_unrecorded`) and a thin I/O shell (:func:`committed_markers`,
:func:`apply_unrecorded`). Must never delete the step just committed, a step not in
``drop_steps``, a step below ``below_step`` (``gc.apply_prune``'s) or an uncommitted one.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping

from sailor.checkpoint.format import MARKER, parse_step_dir, step_dir
from sailor.checkpoint.storage import Storage

__all__ = ["apply_unrecorded", "committed_markers", "decide_unrecorded"]


def committed_markers(
    storage: Storage, *, but: int = -1, only: Collection[int] | None = None
) -> dict[int, bytes]:
    """Step -> the bytes of its commit marker, for every step directory holding one (except
    ``but``: the step being saved; of the steps in ``only`` when given: a save's
    ``drop_steps``, so a directory of many steps costs one listing and a read per step
    listed)."""
    out: dict[int, bytes] = {}
    for name in storage.listdir(""):
        step = parse_step_dir(name)
        if step is None or step == but or (only is not None and step not in only):
            continue
        marker = f"{name}/{MARKER}"
        if storage.exists(marker):
            try:
                out[step] = storage.read(marker)
            except FileNotFoundError:  # deleted between the two calls: not committed
                continue
    return out


def decide_unrecorded(
    seen: Collection[int], *, drop_steps: Collection[int], committed_step: int, below_step: int
) -> list[int]:
    """The steps of ``seen`` (committed when the save of ``committed_step`` began) that its
    committer deletes after its commit: those in ``drop_steps`` (saves the controller gave
    up on), other than ``committed_step`` and at or above ``below_step`` (below it,
    ``gc.apply_prune`` deletes them already; -1: none)."""
    drop = set(drop_steps)
    return sorted(s for s in seen if s in drop and s != committed_step and s >= max(below_step, 0))


def apply_unrecorded(
    storage: Storage,
    seen: Mapping[int, bytes],
    *,
    drop_steps: Collection[int],
    committed_step: int,
    below_step: int,
    cancelled: Callable[[], bool] = lambda: False,
) -> list[int]:
    """Delete the steps :func:`decide_unrecorded` names whose marker is still the one in
    ``seen``, un-committing each first; return the steps deleted. Stops once ``cancelled``
    (the committer's world was abandoned: a fenced committer deletes nothing more)."""
    gone: list[int] = []
    doomed = decide_unrecorded(
        seen, drop_steps=drop_steps, committed_step=committed_step, below_step=below_step
    )
    for step in doomed:
        if cancelled():
            break
        marker = f"{step_dir(step)}/{MARKER}"
        try:
            now = storage.read(marker)
        except FileNotFoundError:  # un-committed meanwhile: saved again, or deleted
            continue
        if now != seen[step]:  # committed again meanwhile: another save's
            continue
        storage.delete(marker)
        storage.delete(step_dir(step))
        gone.append(step)
    return gone
