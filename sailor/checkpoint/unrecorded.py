"""Commits nobody recorded: which of them a save's committer deletes after its own commit.

The controller keeps its checkpoints by records (etcd ``ckpt/<step>``), and a save's
``prune_below`` deletes only below the oldest record it keeps. A step that committed on disk
while the controller gave up on it (an aborted CHECKPOINT whose committer wrote its marker;
a periodic save abandoned, or superseded, that committed late) is never recorded and never
loaded, yet it stays on disk for as long as it is not below a later save's ``prune_below``:
while the job, relaunched from an older record, is behind it, or for ever once the job stops
there. At 70B each such step is ~1.1 TB. So a save's Checkpoint also names the recorded
steps the controller keeps (``Checkpoint.keep_steps``, wire version 8), and after its own
commit the committer deletes every other committed step directory at or above
``prune_below`` that it saw committed when its save began.

Why the steps committed *when the save began* (:func:`committed_markers`, taken on the
committer's persist thread before it writes), and only those:

- the controller records only the save in flight of its current generation (a
  reconfiguration's stop step, or the one periodic save it asked for); every other commit
  absent from the records when it sent the Checkpoint is never recorded later. A commit
  that exists when this save begins is either this save's own step (never deleted), or
  such an abandoned one: a save of this generation before this one is done (a rank's saves
  run one after the other), and a later generation does not exist while this one's ranks
  are saving together;
- a committer that runs late (its persist outlived its world: a slow mount, a node cut off
  from the controller) holds ``keep_steps`` that may be stale: a later generation may
  since have committed and recorded steps that are not in them. Those were not committed
  when this save began, so they are never candidates;
- an uncommitted step directory is never touched: it may be a save in flight under another
  generation (an abandoned periodic save still writing), to be left alone under its
  writers. Its debris goes with a later save's ``prune_below`` or ``sailor ckpt gc``;
- a candidate is deleted only if its marker is still the one seen when the save began: a
  step being saved again has lost its marker (``writer.commit`` un-commits before
  replacing a manifest) or carries another. Its directory is un-committed first, like every
  deletion (``gc``).

Pure decisions (:func:`decide_unrecorded`) and a thin I/O shell (:func:`committed_markers`,
:func:`apply_unrecorded`). Must never delete the step just committed, a step in
``keep_steps``, a step below ``below_step`` (``gc.apply_prune``'s) or an uncommitted one.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping

from sailor.checkpoint.format import MARKER, parse_step_dir, step_dir
from sailor.checkpoint.storage import Storage

__all__ = ["apply_unrecorded", "committed_markers", "decide_unrecorded"]


def committed_markers(storage: Storage, *, but: int = -1) -> dict[int, bytes]:
    """Step -> the bytes of its commit marker, for every step directory holding one (except
    ``but``: the step being saved)."""
    out: dict[int, bytes] = {}
    for name in storage.listdir(""):
        step = parse_step_dir(name)
        if step is None or step == but:
            continue
        marker = f"{name}/{MARKER}"
        if storage.exists(marker):
            try:
                out[step] = storage.read(marker)
            except FileNotFoundError:  # deleted between the two calls: not committed
                continue
    return out


def decide_unrecorded(
    seen: Collection[int], *, keep_steps: Collection[int], committed_step: int, below_step: int
) -> list[int]:
    """The steps of ``seen`` (committed when the save of ``committed_step`` began) that its
    committer deletes after its commit: neither ``committed_step`` nor in ``keep_steps``,
    and at or above ``below_step`` (below it, ``gc.apply_prune`` deletes them already;
    -1: none)."""
    keep = set(keep_steps)
    return sorted(
        s for s in seen if s != committed_step and s not in keep and s >= max(below_step, 0)
    )


def apply_unrecorded(
    storage: Storage,
    seen: Mapping[int, bytes],
    *,
    keep_steps: Collection[int],
    committed_step: int,
    below_step: int,
    cancelled: Callable[[], bool] = lambda: False,
) -> list[int]:
    """Delete the steps :func:`decide_unrecorded` names whose marker is still the one in
    ``seen``, un-committing each first; return the steps deleted. Stops once ``cancelled``
    (the committer's world was abandoned: a fenced committer deletes nothing more)."""
    gone: list[int] = []
    doomed = decide_unrecorded(
        seen, keep_steps=keep_steps, committed_step=committed_step, below_step=below_step
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
