"""An operator's clearing of bad checkpoint marks (``sailor checkpoint clear-bad``) in a
``decide`` pass.

A launch that could not load a committed step marks it bad (``DesiredState.
bad_checkpoints``: every placed node, or two launches from different nodes, failed to read
it) or, after a first strike, suspect (``suspect_checkpoint``; the rule:
``controller/suspect_checkpoint.py``). A mark is never lifted by the controller itself: the
storage may have failed (a mount, a bucket's permission) rather than the files, and it
cannot tell. Once an operator has repaired it, the request clears the marks of the steps it
names (or every mark), and the leader applies it here, as it writes every desired state.

What a cleared step newer than the job's start does: nothing is aborted for it. A running
generation goes on from the step it loaded; a generation coming up (LAUNCH, LOAD, VERIFY)
goes on loading what it loads. The next launch that picks the newest readable commit may
load it: one after an abort (its TEARDOWN, if the clear comes during it, takes the newest
readable commit again now), or from IDLE. A planned reconfiguration's launch loads the step
its own checkpoint saved (the job's current state; in place, what the workers hold), as
before. Retention (``checkpointing.prune_below``) counts a cleared step as any good commit.

Re-pointing (``ClearBadRequest.repoint``, ``sailor checkpoint clear-bad --repoint``). A
commit is recorded with the directory it was saved under, and a launch loads it from there
(``launch.load_directory``). An operator who moved the checkpoint storage (copied /old to
/new, set ``checkpoint_dir: /new``, removed /old) leaves every record naming /old: each
launch fails to read it, every step is marked bad and the job is held
(``launch.unloadable``), and clearing the marks only loops. The leader cannot tell moved
files from a new, empty directory (it reads no storage), so the operator says which: the
request re-points the records it names (every one with ``all``) that name another directory
to the leader's ``checkpoint_dir``, in the transaction that deletes it, and clears their
marks (they were the old path's). Files not actually there fail the next launch as any
unreadable commit does, and mark it again.

Pure: no I/O, no clock, inputs never modified, no actions built here (``decide.py`` turns
what this returns into actions).
"""

from __future__ import annotations

from dataclasses import dataclass

from sailor.controller.decision_types import Observed
from sailor.schemas.runtime import (
    CommitRecord,
    DesiredState,
    Phase,
    SuspectCheckpoint,
)

__all__ = ["Cleared", "apply_clear_bad", "marked", "unknown_steps"]


def marked(d: DesiredState) -> tuple[int, ...]:
    """The steps ``d`` marks: bad, or suspect (sorted)."""
    suspect = (d.suspect_checkpoint.step,) if d.suspect_checkpoint.step >= 0 else ()
    return tuple(sorted({*d.bad_checkpoints, *suspect}))


def unknown_steps(d: DesiredState, steps: tuple[int, ...]) -> tuple[int, ...]:
    """The ``steps`` ``d`` marks neither bad nor suspect: nothing to clear."""
    known = set(marked(d))
    return tuple(s for s in steps if s not in known)


@dataclass(frozen=True)
class Cleared:
    """A request's outcome: the steps whose marks went, and what to say of it;
    ``repointed``: the commit records it re-points (``ClearBadRequest.repoint``), and
    ``repointed_from`` the directory each named before."""

    steps: tuple[int, ...]
    reason: str
    repointed: tuple[CommitRecord, ...] = ()
    repointed_from: tuple[str, ...] = ()


def _repoint(
    commits: dict[int, CommitRecord], steps: tuple[int, ...], every: bool, directory: str
) -> tuple[tuple[CommitRecord, ...], tuple[str, ...]]:
    """The records of ``steps`` (``every``: all) that name another directory than
    ``directory``, naming it, and the directory each named before; ``commits`` (step ->
    record) updated in place."""
    moved, was = [], []
    for step in sorted(commits) if every else steps:
        c = commits.get(step)
        if c is not None and c.directory != directory:
            commits[step] = c.model_copy(update={"directory": directory})
            moved.append(commits[step])
            was.append(c.directory)
    return tuple(moved), tuple(was)


def apply_clear_bad(
    d: DesiredState, o: Observed, checkpoint_dir: str
) -> tuple[tuple[DesiredState, str] | None, dict[str, Cleared]]:
    """``d`` after the operators' requests (``o.clear_bad``, by request id, oldest id
    first) and why, or None when they named no mark there is (the caller deletes them
    either way); and per request what it cleared, and the records it re-points to
    ``checkpoint_dir`` (``repoint``: their marks go too). In an aborted TEARDOWN the next launch's
    checkpoint is taken again: the newest recorded commit no mark is left on
    (``Observed.resumable``), and, when the clear answered them (it cleared the step they
    are about, or moved the load step), the aborted generation's read failures are spent
    (``DesiredState.reads_spent_through``): they mark nothing again."""
    requests = o.clear_bad
    bad, suspect = d.bad_checkpoints, d.suspect_checkpoint
    outcome: dict[str, Cleared] = {}
    whom: list[str] = []
    gone: set[int] = set()
    commits = {c.step: c for c in o.commits}
    for rid in sorted(requests):
        req = requests[rid]
        held = set(bad) | ({suspect.step} if suspect.step >= 0 else set())
        asked = held if req.all else set(req.steps)
        moved, was = (
            _repoint(commits, req.steps, req.all, checkpoint_dir) if req.repoint else ((), ())
        )
        steps = tuple(sorted(asked & held))
        bad = tuple(s for s in bad if s not in steps)
        if suspect.step in steps:
            suspect = SuspectCheckpoint()
        said = [f"cleared the marks of step {', '.join(map(str, steps))}"] if steps else []
        if moved:
            names = ", ".join(str(c.step) for c in moved)
            source = ", ".join(sorted(set(was)))
            said.append(f"re-pointed the records of step {names} from {source} to {checkpoint_dir}")
        missing = sorted(set(req.steps) - held - {c.step for c in moved})
        if missing:
            elsewhere = f" nor a record elsewhere than {checkpoint_dir}" if req.repoint else ""
            said.append(f"no bad or suspect mark{elsewhere} on step {', '.join(map(str, missing))}")
        if req.all and not steps and not moved:
            more = f" nor record elsewhere than {checkpoint_dir}" if req.repoint else ""
            said.append(f"no bad or suspect mark{more} to clear")
        outcome[rid] = Cleared(steps, "; ".join(said), moved, was)
        gone |= set(steps)
        whom.append(rid + (f" by {req.who}" if req.who else ""))
    if not gone:
        return None, outcome
    update: dict[str, object] = {"bad_checkpoints": bad, "suspect_checkpoint": suspect}
    why = (
        f"cleared the bad checkpoint marks of step {', '.join(map(str, sorted(gone)))} "
        f"(operator request {', '.join(whom)})"
    )
    if d.phase is Phase.TEARDOWN and d.aborted:
        last = o.resumable(bad)
        load = last.step if last else -1
        # the aborted generation's read failures, judged at the abort, are still in the
        # statuses: judged again (``suspect_checkpoint.late``) they marked the step again in
        # this very pass, or charged the suspect's nodes twice. Spent only when the clear
        # answered them: it cleared the step they are about (the one the generation loads,
        # or the suspect's), or the one the abort fell back from (the load step moves). A
        # clear of another step (an old mark) leaves them to be judged: a node that
        # reports failing to read the loaded step after the clear is a new failure
        read = {d.load_step, d.suspect_checkpoint.step} - {-1}
        if gone & read or load != d.load_step:
            update["reads_spent_through"] = d.generation
        if load != d.load_step:
            update["load_step"] = load
            why += f": the next launch loads step {load}"
    return (d.model_copy(update=update), why), outcome
