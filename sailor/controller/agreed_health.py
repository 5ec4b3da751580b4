"""The job's records of the errors every rank raises alike (``DesiredState.agreed_health``).

An agreed error (``failure_text.AGREED_ERRORS``: non-finite gradients too many steps in a
row, a label out of range, a non-finite checkpoint) is the job's, however many nodes report
it, and is counted in a record of its own per error type, by the node-health policy
(``controller/node_health.py``: ``count_failure``), with the step it was reported at: the
policy's count of the same agreed error without a generation that trains past its step
holds the job, whatever hangs or stalls came between (those count in ``job_health``). A
record whose exclusion runs holds the job as ``job_health`` does (:func:`holds`). Their
reset once a generation trains past the step: ``controller/forgetting.py``.

Pure: no I/O, no clock (the caller passes ``now``), inputs never modified. Must never
import the agent, torch or ``megatron_patch``.
"""

from __future__ import annotations

from collections.abc import Mapping

from sailor.controller.failure_text import AGREED_ERRORS, FailureCause
from sailor.controller.health_record import (
    AGREED_WHY,
    JOB,
    ExclusionPolicy,
    count_failure,
    describe,
    held,
)
from sailor.schemas.runtime import DesiredState, NodeHealth

__all__ = ["agreed_name", "charge_agreed", "holds"]


def agreed_name(kind: str) -> str:
    """How reasons name the job's record of the agreed error ``kind``."""
    return f"{JOB} ({kind})"


def charge_agreed(
    d: DesiredState,
    evidence: Mapping[str, tuple[str, str, str]],
    kind: Mapping[str, str],
    seen: Mapping[str, FailureCause],
    now: float,
    policy: ExclusionPolicy,
    step: int,
    notes: list[str],
) -> dict[str, NodeHealth] | None:
    """``d.agreed_health`` with ``d``'s generation counted (once) in the record of each
    agreed error its nodes reported (at ``step``), a sentence per count added to ``notes``;
    None when nothing was counted. Apart from ``job_health``: a hang or a stall between two
    non-finite failures neither adds to nor resets this count."""
    gen, out = d.generation, dict(d.agreed_health)
    for k in sorted({kind[n] for n in evidence if kind[n] in AGREED_ERRORS}):
        rec = out.get(k, NodeHealth())
        if rec.generation == gen:
            continue
        nodes = sorted(n for n in evidence if kind[n] == k)
        shown = [seen[n] for n in nodes if n in seen]
        # its first report now, else (counted before, idle now) what the evidence kept
        summary, sig, origin = evidence[nodes[0]]
        retry = shown[0].retry if shown else True
        if shown:
            summary, sig, origin = shown[0].summary, shown[0].signature, shown[0].origin
        out[k], excl = count_failure(rec, gen, summary, origin, retry, now, policy, sig, step)
        what = f"{len(nodes)} placed node(s) reported it ({', '.join(nodes)})"
        if excl:
            notes.append(describe(agreed_name(k), out[k], now, f"{excl}; {what}"))
        else:
            notes.append(
                f"counted against {agreed_name(k)} ({out[k].failures} in a row without "
                f"training past step {out[k].step}): {AGREED_WHY}, {what}: {summary}"
            )
    return out if out != d.agreed_health else None


def holds(
    job: NodeHealth, agreed: Mapping[str, NodeHealth], now: float
) -> list[tuple[str, NodeHealth]]:
    """The records that hold the job at ``now`` (no layout is launched), each with its name
    (:data:`JOB`, :func:`agreed_name`): ``job_health`` (:func:`held`), and each record of an
    agreed error whose exclusion runs."""
    out = [(JOB, job)] if held(job, now) else []
    return out + [(agreed_name(k), r) for k, r in sorted(agreed.items()) if r.excluded_until > now]
