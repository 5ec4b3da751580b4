"""A committer's pruning below the controller's step: only what was there when its save began.

``Checkpoint.prune_below`` is the oldest recorded step the controller keeps, and the
committer of the save deletes every step directory below it after its own commit
(``gc.decide_prune``). A committer may run late (its persist outlived its world: a slow
mount, a node cut off from the controller but still on the storage) while the job goes on
without it. A later generation normally saves only above ``prune_below`` (it resumes from a
recorded step at or above it), but not always: every record at or above it may have been
marked unreadable since (``controller/suspect_checkpoint.py``), the job fallen back below it
(to an older record, or a fresh start) and saving there. Deleting whole step directories, the
late committer took that fallback run's save: its shards under its writers, or its commit,
recorded since.

So the committer lists, as its save begins (:func:`seen_below`), every step directory below
``prune_below`` with its files, its marker and, in a directory without one, the SHA-256 of
a manifest left there; after its commit it deletes (:func:`apply_seen_prune`) only those
files: the marker only if it still holds the bytes seen and the manifest only if it is the
one seen (each taken away atomically first and put back if not: :func:`take_if`), every
other file by name (shards and parts carry their save's id, temp files a random suffix: a
later save's files never have a name seen), and the directory only if it is then empty. A
step whose marker changed or went since (committed again, or being committed) is left whole.
A directory made after the save began, and files added to one, are left for the next save's
pruning or ``sailor ckpt gc``.

Must never delete a file that was not there when the save began, nor a commit other than the
one seen. Thin I/O; the choice of the steps is ``gc.decide_prune``'s.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from sailor.checkpoint.errors import CorruptCheckpointError
from sailor.checkpoint.format import MANIFEST, MARKER, parse_step_dir, step_dir
from sailor.checkpoint.gc import decide_prune, unjudged
from sailor.checkpoint.storage import Storage
from sailor.schemas.checkpoint import CommitMarker

__all__ = ["SeenStep", "apply_seen_prune", "seen_below", "take_if"]


@dataclass(frozen=True)
class SeenStep:
    """One step directory as a committer saw it when its save began."""

    files: frozenset[str]
    """Paths relative to the storage root."""
    marker: bytes | None
    """The bytes of its commit marker; None if it had none."""
    manifest_sha256: str = ""
    """Without a marker: the SHA-256 of the manifest left there (a commit cut short), if any."""


def seen_below(storage: Storage, below: int) -> dict[int, SeenStep]:
    """Every step directory below ``below`` as it is now (nothing if ``below`` < 1)."""
    out: dict[int, SeenStep] = {}
    if below < 1:
        return out
    for name in storage.listdir(""):
        step = parse_step_dir(name)
        if step is None or step >= below:
            continue
        files = frozenset(storage.walk(name))
        marker: bytes | None = None
        sha = ""
        try:
            if f"{name}/{MARKER}" in files:
                marker = storage.read(f"{name}/{MARKER}")
            elif f"{name}/{MANIFEST}" in files:
                sha = hashlib.sha256(storage.read(f"{name}/{MANIFEST}")).hexdigest()
        except FileNotFoundError:  # deleted between the listing and the read
            files = frozenset(f for f in files if storage.exists(f))
        out[step] = SeenStep(files, marker, sha)
    return out


def apply_seen_prune(
    storage: Storage,
    seen: Mapping[int, SeenStep],
    *,
    below_step: int,
    committed_step: int,
    cancelled: Callable[[], bool] = lambda: False,
) -> list[str]:
    """After committing ``committed_step``: delete what ``seen`` holds of the step
    directories below ``below_step`` (``gc.decide_prune``), as the module says; return the
    directories pruned (ending with '/'; one left whole because its commit changed is not
    named). Stops once ``cancelled`` (a fenced committer deletes nothing more). A committed
    step whose manifest this release cannot judge (``gc.unjudged``: a newer release's, or one
    refused for a shard path) is spared: once the others are deleted, a
    ``CorruptCheckpointError`` (not debris) names it, for the committer to report."""
    doomed = decide_prune(sorted(seen), below_step=below_step, committed_step=committed_step)
    out: list[str] = []
    spared: list[str] = []
    for d in doomed:
        if cancelled():
            break
        step = parse_step_dir(d.rstrip("/"))
        if step is None:
            continue
        why = unjudged(storage, step) if seen[step].marker is not None else ""
        if why:
            spared.append(why)
        elif _prune_step(storage, step, seen[step]):
            out.append(d)
    if spared:
        raise CorruptCheckpointError(
            f"spared {len(spared)} step(s) below step {below_step}: "
            + " | ".join(spared[:3])
            + f" (deleted {len(out)})",
            path=storage.url,
            debris=False,
        )
    return out


def _prune_step(storage: Storage, step: int, seen: SeenStep) -> bool:
    d = step_dir(step)
    sha = seen.manifest_sha256
    if seen.marker is not None:
        try:
            sha = CommitMarker.model_validate_json(seen.marker).manifest_sha256
        except ValueError:
            sha = ""  # unreadable: its manifest is not judged, the rest goes
        if not take_if(storage, f"{d}/{MARKER}", lambda now: now == seen.marker):
            return False  # committed again, or being committed: not the commit seen
    if sha:
        take_if(storage, f"{d}/{MANIFEST}", lambda now: hashlib.sha256(now).hexdigest() == sha)
    for f in sorted(seen.files - {f"{d}/{MARKER}", f"{d}/{MANIFEST}"}):
        storage.delete(f)
    storage.remove_empty(d)
    return True


def take_if(storage: Storage, path: str, ours: Callable[[bytes], bool]) -> bool:
    """Delete the object ``path`` if its bytes are ``ours``, never another: it is moved to
    a unique hidden name beside it first (``Storage.move``: atomic on a file system), then
    judged; one not ``ours`` goes back (unless ``path`` was written again meanwhile: that
    newer object supersedes it). Whether it was deleted; False if absent. On an object
    store the move is a copy then a delete: an object written at ``path`` between the two
    is lost (for a marker: that commit reads as uncommitted, never as another's data)."""
    head, _, name = path.rpartition("/")
    hidden = f"{head}/" * bool(head) + f".{name}.dropped-{uuid.uuid4().hex[:12]}"
    try:
        storage.move(path, hidden)
    except FileNotFoundError:
        return False
    try:
        now = storage.read(hidden)
    except FileNotFoundError:
        return False
    if ours(now):
        storage.delete(hidden)
        return True
    if storage.exists(path):
        storage.delete(hidden)
    else:
        storage.move(hidden, path)
    return False
