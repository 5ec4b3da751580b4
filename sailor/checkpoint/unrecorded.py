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
- a candidate's deletion takes nothing but the commit seen (``drop_commit``): a late
  committer's candidate may be being saved again right then by a later generation, which
  takes the old marker away only when it commits (``writer.commit``), so during that
  save's persist the old marker is unchanged. Deleting the whole step directory deleted
  that save's shards under its writers (its commit failed) or, had it committed in
  between, its commit (recorded by the controller, then gone). So the marker is taken
  away atomically and compared with the one seen, the manifest goes only if it is the one
  that marker names, the shards and parts only of that marker's save id, the directory
  only once empty.

Pure decisions (:func:`decide_unrecorded`) and a thin I/O shell (:func:`committed_markers`,
:func:`apply_unrecorded`). Must never delete the step just committed, a step not in
``drop_steps``, a step below ``below_step`` (``prune.apply_seen_prune``'s) or an uncommitted one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection, Mapping

from sailor.checkpoint.format import MANIFEST, MARKER, parse_step_dir, step_dir
from sailor.checkpoint.prune import take_if
from sailor.checkpoint.storage import Storage
from sailor.checkpoint.writer import discard_save
from sailor.schemas.checkpoint import CommitMarker

__all__ = ["apply_unrecorded", "committed_markers", "decide_unrecorded", "drop_commit"]


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
    ``prune.apply_seen_prune`` deletes them already; -1: none)."""
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
    """Delete the commits :func:`decide_unrecorded` names, each the one in ``seen`` and
    nothing else of its step (:func:`drop_commit`); return the steps whose commit was
    deleted. Stops once ``cancelled`` (the committer's world was abandoned: a fenced
    committer deletes nothing more)."""
    gone: list[int] = []
    doomed = decide_unrecorded(
        seen, drop_steps=drop_steps, committed_step=committed_step, below_step=below_step
    )
    for step in doomed:
        if cancelled():
            break
        if drop_commit(storage, step, seen[step]):
            gone.append(step)
    return gone


def drop_commit(storage: Storage, step: int, marker: bytes) -> bool:
    """Delete the commit of ``step`` whose marker held ``marker``, and only it; whether it
    was there to delete. The step may be being saved again meanwhile, by another
    generation (whose ``writer.commit`` takes the old marker away only when it commits), so
    nothing of that save is touched:

    1. the marker is taken away atomically (``prune.take_if``: moved to a unique hidden
       name) and its bytes compared with ``marker``: another commit's goes back, and
       nothing else is done;
    2. the manifest goes only if it is the one that marker names (its SHA-256), taken away
       the same way first (a save of the step that wrote its own since gets it back);
    3. the shards and parts of that marker's save id go (``writer.discard_save``), never
       another save's;
    4. the step's directories go only if they are then empty (``Storage.remove_empty``).

    On an object store a move is a copy then a delete: a save of the step that commits
    between the two loses its marker (it reads back as uncommitted, not as another's
    data). A marker that is not a readable ``CommitMarker`` is not judged: nothing goes."""
    try:
        seen = CommitMarker.model_validate_json(marker)
    except ValueError:
        return False
    d = step_dir(step)
    if not take_if(storage, f"{d}/{MARKER}", lambda now: now == marker):
        return False
    take_if(
        storage,
        f"{d}/{MANIFEST}",
        lambda now: hashlib.sha256(now).hexdigest() == seen.manifest_sha256,
    )
    discard_save(storage, step, seen.save_id)
    storage.remove_empty(d)
    return True
