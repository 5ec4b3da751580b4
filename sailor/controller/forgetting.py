"""When the controller forgets a failure record (``DesiredState.node_health``,
``job_health``): an operator's readmit, a changed training config, a node long away.

The records' other rules (what counts, the exclusion backoff) are
``controller/node_health.py``'s; ``controller/failing_nodes.py`` applies these to a pass.

Pure: no I/O, no clock (the caller passes ``now``), inputs never modified.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from sailor.controller.node_health import JOB, ExclusionPolicy
from sailor.schemas.runtime import DesiredState, NodeHealth

__all__ = ["forget_config", "forget_gone", "readmit"]


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
    config): for when the training config the next launch hands out is not the one they
    failed with. The names forgotten (:data:`JOB` for the job's)."""
    out = {n: r for n, r in health.items() if r.origin != "config"}
    gone = sorted(set(health) - set(out))
    if job.origin == "config":
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
