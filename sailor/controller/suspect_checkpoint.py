"""Whether a checkpoint some nodes failed to read is bad, or those nodes' mounts are.

A worker that cannot read the checkpoint its generation loads (the reader's
``CorruptCheckpointError`` or ``NoCheckpointError``, ``failure_text.UNREADABLE_CHECKPOINT``)
fails the launch. Each rank reads only its own stage's files, so a file corrupt in one
stage fails a minority of the nodes, and so does a node whose checkpoint mount broke
(gcsfuse or NFS died: files missing, EIO): counting heads cannot tell them apart. Marking
the step bad at once made one node with a broken mount walk the job back one checkpoint
per launch, down to a fresh start; charging the nodes and keeping the step excluded
healthy nodes one by one while the job never left a corrupt step. So it takes two strikes
from different nodes (``DesiredState.suspect_checkpoint`` remembers the first):

- **First strike.** The nodes F that failed to read step S are not every placed node: S
  is *suspect*, not bad. Each node of F is charged with a ``CheckpointUnreadable`` failure
  that excludes it at once (as a ``retry: false`` record; the exclusion backoff of
  ``node_health.ExclusionPolicy``), so the next layout is planned without F and loads S
  again from other nodes.
- **S was fine.** A generation that loads it from the checkpoint reaches VERIFY (every
  placed node's workers running: they loaded it, :func:`loaded`) or RUNNING: the suspect
  record is cleared; F stays charged (its mount).
- **S is bad.** The next launch from S fails to read it on a node not in F: S is marked
  bad (``bad_checkpoints``: the launch falls back to the newest other commit), the record
  cleared, and F's charge taken back (the file, not F's mounts). When S fails to read
  again only on nodes of F (the layout could not leave them out: no plan without them, or
  their exclusion ended while S was still suspect), S is marked bad too: a job that cannot
  run without F would otherwise wait on S for ever, and two reads of S failed. F stays
  charged then (nothing tells it was the file).
- **Every placed node** failed to read S (a one-node job, a storage outage): S is bad at
  once, nobody is charged (as before: nothing to compare). Reports come in one by one, so
  those of the suspect's own generation that arrive during its TEARDOWN (:func:`late`)
  extend F (charged alike), and once F is every placed node S is marked bad, F taken back
  and the teardown's load step falls back. Read failures of a generation aborted on another
  failure (a peer's error came first) that arrive during its TEARDOWN are its first strike.

Pure: no I/O, no clock (the caller passes ``now``), inputs never modified, no actions
built here. Called by ``aborts.abort`` (:func:`at_abort`), ``teardown.teardown``
(:func:`late`) and ``launch.launching`` (:func:`trained`). Must never import
``controller/decide.py`` or its phase modules (they import this one).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace

from sailor.controller.failure_text import CAUSE_CHARS, error_type, parse_failure
from sailor.controller.node_health import (
    CHECKPOINT_UNREADABLE,
    ExclusionPolicy,
    count_failure,
    describe,
    exclusion_length,
    forgiven,
    take_back,
)
from sailor.schemas.runtime import DesiredState, NodeHealth, SuspectCheckpoint

__all__ = ["Verdict", "at_abort", "late", "loaded", "trained", "unreadable_on"]


@dataclass(frozen=True)
class Verdict:
    """The desired state's fields after a generation's read failures are judged, and what
    the abort's cause (or the teardown's reason) says about it."""

    bad: tuple[int, ...]
    suspect: SuspectCheckpoint
    health: dict[str, NodeHealth]
    cause: str
    notes: list[str] = field(default_factory=list)


def unreadable_on(failures: Mapping[str, str]) -> dict[str, str]:
    """node -> summary, of the ``failures`` (node -> ``AgentStatus.failure``) that are the
    checkpoint reader's errors."""
    out = {}
    for n, text in failures.items():
        cause = parse_failure(text)
        if cause.unreadable_checkpoint:
            out[n] = cause.summary
    return out


def _names(nodes: Collection[str]) -> str:
    return ", ".join(sorted(nodes))


def _how(reads: Mapping[str, str]) -> str:
    """What the reader's errors of ``reads`` (node -> summary) say, for a cause: a step
    not committed on any node (``NoCheckpointError``: its directory or its marker absent
    everywhere, which is more often the storage itself than the files, e.g. a checkpoint
    mount that did not come back and left an empty directory) told apart from its files
    failing their sizes or checksums (``CorruptCheckpointError``); '' when mixed."""
    kinds = {error_type(t) for t in reads.values()}
    if kinds == {"NoCheckpointError"}:
        return " (not committed there on any node, NoCheckpointError: is the storage mounted?)"
    if kinds == {"CorruptCheckpointError"}:
        return " (its files missing, truncated or failing their checksums)"
    return ""


def _charge(
    health: dict[str, NodeHealth],
    reads: Mapping[str, str],
    step: int,
    generation: int,
    now: float,
    policy: ExclusionPolicy,
) -> list[str]:
    """Charge each node of ``reads`` (node -> what it failed to read) in ``health`` with a
    ``CheckpointUnreadable`` failure of ``generation`` that excludes it at once; the notes."""
    notes = []
    for n in sorted(reads):
        rec = health.get(n, NodeHealth())
        summary = f"{CHECKPOINT_UNREADABLE}: step {step}: {reads[n]}"[:CAUSE_CHARS]
        if rec.generation == generation:
            # counted for another failure of this generation already (a missed deadline):
            # not counted twice, excluded all the same; never taken back (its cause)
            times = rec.exclusions + 1
            until = now + exclusion_length(policy, times)
            rec = rec.model_copy(update={"exclusions": times, "excluded_until": until})
        else:
            rec, _ = count_failure(rec, generation, summary, "local", False, now, policy)
        health[n] = rec
        notes.append(describe(n, rec, now, f"failed to read checkpoint {step}, suspect"))
    return notes


def _take_back_all(
    health: dict[str, NodeHealth], suspect: SuspectCheckpoint, now: float
) -> list[str]:
    """Take the suspect's charges back in ``health`` (the file was bad, not their mounts):
    each node's count for the suspect's generation and the exclusion it set. A record
    counted for something else since is left as it is. The notes."""
    back, kept = [], []
    for n in suspect.nodes:
        rec = health.get(n)
        if (
            rec is None
            or rec.generation != suspect.generation
            or error_type(rec.cause) != CHECKPOINT_UNREADABLE
        ):
            kept.append(n)
            continue
        rest = take_back(rec, now)
        if rest is None:
            del health[n]
        else:
            health[n] = rest
        back.append(n)
    notes = [f"taken back from {_names(back)}: the file, not their mounts"] if back else []
    if kept:
        notes.append(f"not taken back from {_names(kept)}: counted for another failure since")
    return notes


def at_abort(
    d: DesiredState,
    failures: Mapping[str, str],
    health: Mapping[str, NodeHealth],
    now: float,
    policy: ExclusionPolicy,
) -> Verdict | None:
    """The verdict on ``d.load_step`` at the abort of a generation that loads it (LAUNCH,
    LOAD or VERIFY; the step not marked bad yet), with ``failures`` (node ->
    ``AgentStatus.failure``) of the placed nodes and ``health`` the records once the
    abort's other failures are counted; None when no node failed to read it (module
    docstring)."""
    reads = unreadable_on(failures)
    if not reads or d.load_step < 0:
        return None
    step, gen, placed = d.load_step, d.generation, set(d.placement)
    out = dict(health)
    sus = d.suspect_checkpoint
    prior = set(sus.nodes) if sus.step == step and sus.generation < gen else set()
    bad = (*d.bad_checkpoints, step)
    if prior:
        others = set(reads) - prior
        if others:
            notes = _take_back_all(out, sus, now)
            cause = (
                f"checkpoint {step} unreadable from {_names(others)} too, after "
                f"{_names(prior)} in generation {sus.generation}: the file, falling back"
            )
        else:
            notes = [f"{_names(prior)} stay charged: nothing tells it was the file"]
            cause = (
                f"checkpoint {step} unreadable again from {_names(reads)} (as in generation "
                f"{sus.generation}; the layout could not leave them out): falling back"
            )
        return Verdict(bad, SuspectCheckpoint(), out, cause, notes)
    if placed <= set(reads):
        cause = f"checkpoint {step} unreadable from every placed node{_how(reads)}, falling back"
        return Verdict(bad, SuspectCheckpoint(), out, cause)
    owed = {n: t for n, t in reads.items() if not forgiven(d, n)}
    if not owed:  # an operator readmitted these nodes' failures of this generation
        cause = f"checkpoint {step} unreadable from {_names(reads)} (forgiven), falling back"
        return Verdict(bad, SuspectCheckpoint(), out, cause)
    notes = _charge(out, owed, step, gen, now, policy)
    suspect = SuspectCheckpoint(step=step, nodes=tuple(sorted(reads)), generation=gen)
    cause = (
        f"checkpoint {step} unreadable from {_names(reads)} only ({len(placed - set(reads))} "
        f"other placed node(s) did not fail to read it): suspect, loaded again without them"
    )
    return Verdict(d.bad_checkpoints, suspect, out, cause, notes)


def late(
    d: DesiredState, failures: Mapping[str, str], now: float, policy: ExclusionPolicy
) -> Verdict | None:
    """In the TEARDOWN after a first strike: the verdict once reports of the suspect's own
    generation that came in after the abort are counted (``failures``: node ->
    ``AgentStatus.failure`` of the placed nodes); None when they add no node that failed to
    read it. Those nodes are charged alike; once every placed node failed to read it, the
    step is bad at once and the charges taken back (the caller falls the load step back).
    None, too, once an operator cleared marks in this TEARDOWN
    (``DesiredState.reads_spent_through``): the reports the marks came from are still
    there, and judged again they marked the cleared step again in the same pass."""
    if d.reads_spent_through >= d.generation:
        return None  # an operator cleared the marks they made (``bad_marks``): spent
    sus = d.suspect_checkpoint
    if sus.step < 0:
        return _late_first(d, failures, now, policy)
    if sus.generation != d.generation:
        return None
    reads = {n: t for n, t in unreadable_on(failures).items() if n not in sus.nodes}
    if not reads:
        return None
    out = dict(d.node_health)
    if set(d.placement) <= set(sus.nodes) | set(reads):
        notes = _take_back_all(out, sus, now)
        cause = (
            f"checkpoint {sus.step} unreadable from every placed node after all "
            f"({_names(reads)} reported late){_how(unreadable_on(failures))}, falling back"
        )
        return Verdict((*d.bad_checkpoints, sus.step), SuspectCheckpoint(), out, cause, notes)
    owed = {n: t for n, t in reads.items() if not forgiven(d, n)}
    if not owed:  # readmitted by an operator
        return None
    notes = _charge(out, owed, sus.step, d.generation, now, policy)
    nodes = tuple(sorted({*sus.nodes, *reads}))
    suspect = sus.model_copy(update={"nodes": nodes})
    cause = f"checkpoint {sus.step} unreadable from {_names(reads)} too (reported late): suspect"
    return Verdict(d.bad_checkpoints, suspect, out, cause, notes)


def loaded(d: DesiredState) -> tuple[SuspectCheckpoint, str]:
    """The suspect record once every placed node of ``d``'s generation has its workers
    running (LOAD -> VERIFY), and a note: a worker reports running after it loaded the
    checkpoint, so the step was read fine, as at :func:`trained`. Not from an in-place
    launch, which reads no checkpoint (its workers keep their state). Without this, a
    generation that read the step and then failed before its first step (a preemption)
    kept it suspect, and a later read failure of the same nodes marked it bad."""
    if d.path == "in_place":
        return d.suspect_checkpoint, ""
    return trained(d)


def _late_first(
    d: DesiredState, failures: Mapping[str, str], now: float, policy: ExclusionPolicy
) -> Verdict | None:
    """In the TEARDOWN of a generation aborted on another failure (a peer's error came
    first): its nodes' read failures reported since are the first strike on the step it
    loaded (:func:`at_abort`), which is ``d.load_step`` while no bad mark lies above it
    (the abort falls back to the newest step not marked bad, so the step the generation
    loaded is the load step unless a bad mark made it fall back: then those reports are
    about the bad step). A generation that trained reads no checkpoint: no reader error."""
    if d.load_step < 0 or any(b >= d.load_step for b in d.bad_checkpoints):
        return None
    verdict = at_abort(d, failures, d.node_health, now, policy)
    if verdict is None:
        return None
    return replace(verdict, cause=f"{verdict.cause} (reported after the abort)")


def trained(d: DesiredState) -> tuple[SuspectCheckpoint, str]:
    """The suspect record once ``d``'s generation trained (VERIFY -> RUNNING), and a note
    ('' when there was none): cleared, the step read fine (the nodes that failed to read it
    stay charged: their mounts)."""
    sus = d.suspect_checkpoint
    if sus.step < 0:
        return sus, ""
    if sus.step == d.load_step:
        why = (
            f"checkpoint {sus.step} read fine without {_names(sus.nodes)}: no longer suspect "
            "(they stay charged)"
        )
    else:
        why = f"trained from step {d.load_step}: checkpoint {sus.step} no longer suspect"
    return SuspectCheckpoint(), why
