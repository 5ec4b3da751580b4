"""Retention and garbage collection: decide what to delete (pure), then delete it.

What is debris:
- a step directory without a valid commit marker (a crashed or in-flight save). The
  committer's retention deletes it if a newer step of its job is committed (that save can
  no longer commit usefully); an operator's ``collect`` only once it has not been touched for
  ``grace_s`` (a run that fell back below an unrecorded newer commit saves below it, and
  must not have its save swept away under its writers);
- inside a committed step, files the manifest does not name (a crashed earlier attempt at the
  same step, temp files of an interrupted write).

Retention keeps the newest ``keep`` committed checkpoints; older ones are deleted only after a
newer commit, never before, so there is always a loadable checkpoint. The committers call
these only once that newer commit reads back (``readback.read_back``): a commit on disk is
not yet a loadable one.

Pruning below a step (:func:`decide_prune`; ``prune.apply_seen_prune`` deletes) is retention
decided by someone who knows more than the storage: the controller records which commits a
restart may load (etcd ``ckpt/<step>``), so it names the oldest recorded step to keep and the
committer of the next save deletes every step directory below it after its own commit, as it was
when that save began (``prune.py``: a committer running late must not take a save made there
since). A commit on disk that the controller never recorded (a leader lost between the marker
and the record) cannot push a recorded one out, as counting the newest ``keep`` on disk would.
Such a commit above the prune point is deleted by the next save's committer told which steps the
controller gave up on (``unrecorded``).

A committed step whose manifest this release cannot judge (:func:`unjudged`: a newer release's,
or one refused for a shard path) is listed as such by :func:`scan`: no retention, prune or gc
deletes it, nor counts it among the ``keep`` newest. Each deletes the rest as if it were not
there, then reports it (``CorruptCheckpointError``, ``debris`` False) for an operator: one such
step must not stop every later deletion and fill the disk.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import ValidationError

from sailor.checkpoint.errors import CorruptCheckpointError, NoCheckpointError
from sailor.checkpoint.format import MANIFEST, MARKER, PARTS, parse_step_dir, step_dir
from sailor.checkpoint.reader import invalid_manifest, read_manifest
from sailor.checkpoint.storage import Storage

__all__ = [
    "GcOutcome",
    "StepListing",
    "apply_retention",
    "collect",
    "decide_gc",
    "decide_prune",
    "scan",
    "sweep",
    "unjudged",
]


@dataclass(frozen=True)
class StepListing:
    """What storage holds for one step directory."""

    step: int
    committed: bool
    files: tuple[str, ...]
    """Paths relative to the step directory."""
    referenced: frozenset[str] = frozenset()
    """Files the committed manifest needs (empty if uncommitted)."""
    newest_mtime: float = 0.0
    unjudged: str = ""
    """Why this committed step may not be judged ('' when it may, :func:`unjudged`): never
    deleted, never counted among the newest ``keep``."""


@dataclass(frozen=True)
class GcOutcome:
    """What a gc deleted, and why it spared each committed step it cannot judge."""

    deleted: list[str]
    spared: list[str]


def decide_gc(
    listing: Sequence[StepListing],
    *,
    keep: int | None,
    now: float,
    grace_s: float,
    older_than_newest: bool = True,
) -> list[str]:
    """Paths (relative to the root) to delete. Whole step dirs end with '/'.

    ``older_than_newest``: an uncommitted step below the newest commit is debris at once.
    True for a committer's retention (it knows its own job's saves are done up to its
    commit); False for an operator's ``collect``, which cannot tell an abandoned save from
    one a fallback run is writing below an unrecorded newer commit: grace alone decides."""
    if keep is not None and keep < 1:
        raise ValueError(f"keep={keep}: must be >= 1 (never delete the last checkpoint)")
    committed = sorted((s.step for s in listing if s.committed and not s.unjudged), reverse=True)
    newest = committed[0] if committed else -1
    retained = set(committed if keep is None else committed[:keep])
    out: list[str] = []
    for s in sorted(listing, key=lambda x: x.step):
        d = step_dir(s.step)
        if s.unjudged:
            continue
        if s.committed:
            if s.step not in retained:
                out.append(d + "/")
                continue
            stale = now - s.newest_mtime >= grace_s
            out.extend(f"{d}/{f}" for f in s.files if f not in s.referenced and stale)
        elif (older_than_newest and s.step < newest) or now - s.newest_mtime >= grace_s:
            out.append(d + "/")
    return out


def decide_prune(steps: Sequence[int], *, below_step: int, committed_step: int) -> list[str]:
    """Step directories (ending with '/') to delete after ``committed_step`` committed: every
    one below ``below_step``, committed or not. ``below_step`` may not exceed
    ``committed_step`` (the checkpoint just committed is never pruned)."""
    if below_step > committed_step:
        raise ValueError(
            f"below_step={below_step}: must be <= the step just committed ({committed_step})"
        )
    return [step_dir(s) + "/" for s in sorted(steps) if s < below_step]


def scan(storage: Storage) -> list[StepListing]:
    """List every step directory with its files and commit state. A committed step whose
    manifest this release cannot take (a newer release's: ValidationError) or refuses for a
    shard path (``CorruptCheckpointError.debris`` False) is listed committed with
    ``unjudged`` saying why: taken for debris, it would be deleted."""
    out: list[StepListing] = []
    for name in storage.listdir(""):
        step = parse_step_dir(name)
        if step is None:
            continue
        files = tuple(f[len(name) + 1 :] for f in storage.walk(name))
        mt = max((storage.mtime(f"{name}/{f}") for f in files), default=0.0)
        try:
            m = read_manifest(storage, step)
        except CorruptCheckpointError as exc:
            if not exc.debris:  # refused, not unfinished: judged as a newer release's
                out.append(StepListing(step, True, files, newest_mtime=mt, unjudged=str(exc)))
                continue
            out.append(StepListing(step, False, files, newest_mtime=mt))
            continue
        except NoCheckpointError:
            out.append(StepListing(step, False, files, newest_mtime=mt))
            continue
        except ValidationError as exc:
            why = invalid_manifest(storage, step, exc)
            out.append(StepListing(step, True, files, newest_mtime=mt, unjudged=why))
            continue
        ref = {MANIFEST, MARKER} | {s.path for s in m.shards}
        ref |= {f for f in files if f.startswith(f"{PARTS}/{m.save_id}-")}
        out.append(StepListing(step, True, files, frozenset(ref), mt))
    return out


def sweep(
    storage: Storage, *, keep: int | None = None, grace_s: float = 0.0, dry_run: bool = False
) -> GcOutcome:
    """An operator's gc: delete debris (and committed checkpoints beyond ``keep``); return
    what was deleted and why each step it cannot judge was spared."""
    listing = scan(storage)
    doomed = decide_gc(
        listing, keep=keep, now=time.time(), grace_s=grace_s, older_than_newest=False
    )
    if not dry_run:
        for p in doomed:
            _delete(storage, p)
    return GcOutcome(doomed, [s.unjudged for s in listing if s.unjudged])


def collect(
    storage: Storage, *, keep: int | None = None, grace_s: float = 0.0, dry_run: bool = False
) -> list[str]:
    """Delete debris (and committed checkpoints beyond ``keep``); return what was deleted.
    Raises (:func:`_spared`) after deleting, if it spared a step it cannot judge."""
    res = sweep(storage, keep=keep, grace_s=grace_s, dry_run=dry_run)
    if res.spared:
        raise _spared(storage, res.spared, "", len(res.deleted))
    return res.deleted


def apply_retention(storage: Storage, *, keep: int, committed_step: int) -> list[str]:
    """After committing ``committed_step``: drop old checkpoints and older uncommitted saves;
    return what was deleted. A committed step it cannot judge is spared and not counted
    among the ``keep`` newest: once the others are deleted, a ``CorruptCheckpointError`` (not
    debris) names it, for the committer to report."""
    listing = [s for s in scan(storage) if s.step <= committed_step]
    # grace = infinity: files of a save newer than this commit are never touched here.
    doomed = [
        p for p in decide_gc(listing, keep=keep, now=0.0, grace_s=float("inf")) if p.endswith("/")
    ]
    for p in doomed:
        _delete(storage, p)
    spared = [s.unjudged for s in listing if s.unjudged]
    if spared:
        raise _spared(storage, spared, f" at or below step {committed_step}", len(doomed))
    return doomed


def _spared(storage: Storage, why: list[str], where: str, deleted: int) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"spared {len(why)} step(s){where}: " + " | ".join(why[:3]) + f" (deleted {deleted})",
        path=storage.url,
        debris=False,
    )


def unjudged(storage: Storage, step: int) -> str:
    """Why no retention may delete committed ``step`` ('' when one may): its manifest is a
    newer release's (a field this release cannot take) or refused for a shard path
    (``CorruptCheckpointError.debris`` False): a valid checkpoint of a release that names
    its shards otherwise, or one altered, is left for an operator. Other errors ('': not
    committed, a missing or corrupt file) are debris as before."""
    try:
        read_manifest(storage, step)
    except CorruptCheckpointError as exc:
        return "" if exc.debris else str(exc)
    except NoCheckpointError:
        return ""
    except ValidationError as exc:
        return invalid_manifest(storage, step, exc)
    return ""


def _delete(storage: Storage, path: str) -> None:
    if path.endswith("/"):
        # Un-commit first: a crash halfway through deleting a step must not leave a marker
        # in front of missing shards.
        storage.delete(f"{path}{MARKER}")
    storage.delete(path.rstrip("/"))
