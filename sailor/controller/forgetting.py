"""When the controller resets or forgets a failure record (``DesiredState.node_health``,
``job_health``): a generation that trained, an operator's readmit, a changed training
config, a node long away.

The records' other rules (what counts, the exclusion backoff) are
``controller/node_health.py``'s; ``controller/failing_nodes.py`` applies these to a pass.

Pure: no I/O, no clock (the caller passes ``now``), inputs never modified.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from sailor.controller.failure_text import AGREED_ERRORS, error_type
from sailor.controller.node_health import JOB, ExclusionPolicy
from sailor.schemas.runtime import DesiredState, NodeHealth

__all__ = [
    "forget_config",
    "forget_gone",
    "readmit",
    "trained",
    "trained_agreed",
    "trained_past",
    "trained_past_agreed",
]


def _reset(rec: NodeHealth) -> NodeHealth | None:
    """``rec`` after a generation trained: no streak; None if nothing else is left."""
    if rec.failures == 0:
        return rec
    if rec.exclusions == 0:
        return None
    return rec.model_copy(update={"failures": 0})


def _short_of_agreed(job: NodeHealth, step: int) -> bool:
    """The job's last failure is one every rank agreed on (``AGREED_ERRORS``: non-finite
    gradients too many steps in a row) and ``step`` is not past the step it was reported
    at. Its skipped steps advance the step: reset at the first step past the checkpoint,
    the count never reached the policy's and the job was relaunched at full rate forever.
    Only a record written before agreed errors had their own (``agreed_health``) has one."""
    agreed = job.failures > 0 and error_type(job.cause) in AGREED_ERRORS
    return agreed and 0 <= step <= job.step


def trained(
    health: Mapping[str, NodeHealth], job: NodeHealth, nodes: Iterable[str], step: int = -1
) -> tuple[dict[str, NodeHealth], NodeHealth]:
    """The records after a generation trained on ``nodes`` (every one past ``step``, the
    lowest they reported): their consecutive count is 0, and the job's unless its last
    failure was an agreed one at ``step`` or later (:func:`trained_past` resets it); a
    record that has nothing else to remember (never excluded) goes."""
    out = dict(health)
    for node in nodes:
        rec = out.get(node)
        if rec is None:
            continue
        kept = _reset(rec)
        if kept is None:
            del out[node]
        else:
            out[node] = kept
    if _short_of_agreed(job, step):
        return out, job
    return out, _reset(job) or NodeHealth()


def trained_agreed(agreed: Mapping[str, NodeHealth], step: int) -> dict[str, NodeHealth]:
    """The job's records of agreed errors (``DesiredState.agreed_health``) after a
    generation trained, every placed node past ``step`` (the lowest they reported; -1: not
    known): each whose step it is past (or that has none) reset, the others kept. Its
    skipped steps advance a generation that meets the same non-finite gradients past the
    checkpoint: its RUNNING is no sign the error is gone, getting past its step is."""
    out: dict[str, NodeHealth] = {}
    for kind, rec in agreed.items():
        kept = rec if _short_of(rec, step) else _reset(rec)
        if kept is not None:
            out[kind] = kept
    return out


def trained_past_agreed(
    agreed: Mapping[str, NodeHealth], step: int
) -> dict[str, NodeHealth] | None:
    """The job's records of agreed errors once a running generation's placed nodes all
    reported ``step``: those it is past reset; None: nothing to change (``step`` -1: a
    status with no step)."""
    if step < 0:
        return None
    out = trained_agreed(agreed, step)
    return out if out != agreed else None


def _short_of(rec: NodeHealth, step: int) -> bool:
    """``rec`` counts a failure and ``step`` is not past the step it was reported at."""
    return rec.failures > 0 and 0 <= step <= rec.step


def trained_past(job: NodeHealth, step: int) -> NodeHealth | None:
    """The job's record once a running generation's placed nodes all reported ``step``:
    reset when :func:`trained` kept its count for an agreed failure and ``step`` is past
    it; None: nothing to change."""
    if job.failures == 0 or error_type(job.cause) not in AGREED_ERRORS:
        return None
    if step < 0 or _short_of_agreed(job, step):  # -1: a status with no step (no workers)
        return None
    return _reset(job) or NodeHealth()


def forget_gone(
    d: DesiredState, registered: Mapping[str, object], now: float, policy: ExclusionPolicy
) -> dict[str, NodeHealth]:
    """``d.node_health`` without the records of nodes that are away and whose record has
    nothing left to say: an exclusion that ended ``max_exclude_s`` ago (a node back
    within that keeps its backoff), or, never excluded, a streak last counted
    ``policy.failures`` generations ago. A lease flap or an agent restart keeps it all;
    spot VMs that never come back (a new VM has a new id) do not pile up."""
    return {n: r for n, r in d.node_health.items() if n in registered or _recent(d, r, now, policy)}


def _recent(d: DesiredState, r: NodeHealth, now: float, policy: ExclusionPolicy) -> bool:
    """Whether a record of a node that is away still has something to say."""
    if r.exclusions > 0:
        return now < r.excluded_until + policy.max_exclude_s
    return d.generation - r.generation < policy.failures


def forget_config(
    health: Mapping[str, NodeHealth], job: NodeHealth
) -> tuple[dict[str, NodeHealth], NodeHealth, list[str]]:
    """The records without those whose last failure was a configuration error (origin
    config), and the job's when its last failure was one every rank agreed on
    (``AGREED_ERRORS``: non-finite gradients, whose message says to lower the learning
    rate): for when the training config the next launch hands out is not the one they
    failed with. The names forgotten (:data:`JOB` for the job's)."""
    out = {n: r for n, r in health.items() if r.origin != "config"}
    gone = sorted(set(health) - set(out))
    if job.origin == "config" or error_type(job.cause) in AGREED_ERRORS:
        job, gone = NodeHealth(), [*gone, JOB]
    return out, job, gone


def readmit(
    health: Mapping[str, NodeHealth], job: NodeHealth, nodes: Iterable[str], everything: bool
) -> tuple[dict[str, NodeHealth], NodeHealth, list[str]]:
    """The records without those an operator asked to forget (``nodes``; ``everything``:
    every node's and the job's). The names forgotten (:data:`JOB` for the job's)."""
    if everything:
        had_job = job != NodeHealth()
        return {}, NodeHealth(), sorted(health) + ([JOB] if had_job else [])
    names = set(nodes)
    out = {n: r for n, r in health.items() if n not in names}
    return out, job, sorted(set(health) - set(out))
