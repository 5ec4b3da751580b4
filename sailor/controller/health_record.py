"""A failure record's arithmetic, shared by the nodes' records (``node_health``) and the job's
records of agreed errors (``agreed_health``): the exclusion policy, counting one failure,
whether a record holds, and the sentence a reason gives.

Pure: values in, values out.
"""

from __future__ import annotations

from datetime import UTC, datetime

from pydantic import Field, model_validator

from sailor.controller.failure_text import signature_of
from sailor.schemas._base import Frozen, field_error
from sailor.schemas.runtime import NodeHealth

__all__ = [
    "AGREED_WHY",
    "JOB",
    "ExclusionPolicy",
    "config_hold",
    "count_failure",
    "describe",
    "exclusion_length",
    "held",
    "record_signature",
]

JOB = "the job"
"""How reasons name the job's record (``DesiredState.job_health``)."""


class ExclusionPolicy(Frozen):
    """When a node whose workers fail is left out of the layouts, and for how long."""

    failures: int = Field(
        default=3,
        ge=1,
        description="Consecutive aborts caused by a failure that began on a node (not a "
        "peer's) that exclude it; a failure whose record says retry false excludes at once.",
    )
    exclude_s: float = Field(
        default=600.0,
        gt=0,
        description="Length of a node's first exclusion, s; each further one doubles it.",
    )
    max_exclude_s: float = Field(
        default=3600.0,
        gt=0,
        description="Longest exclusion, s (the doubling's cap); also how long after its "
        "exclusion ended the record of a node that is away is kept.",
    )

    @model_validator(mode="after")
    def _cap_above_first(self) -> ExclusionPolicy:
        if self.max_exclude_s < self.exclude_s:
            raise field_error(
                "max_exclude_s", self.max_exclude_s, f"below exclude_s ({self.exclude_s})"
            )
        return self


def record_signature(rec: NodeHealth) -> str:
    """The signature of a record's last failure (its cause's, for one written without)."""
    return rec.signature or signature_of(rec.cause)


def exclusion_length(policy: ExclusionPolicy, exclusions: int) -> float:
    """The ``exclusions``-th exclusion's length: doubled each time, capped."""
    return min(policy.exclude_s * 2.0 ** min(exclusions - 1, 64), policy.max_exclude_s)


def count_failure(
    rec: NodeHealth,
    generation: int,
    summary: str,
    origin: str,
    retry: bool,
    now: float,
    policy: ExclusionPolicy,
    signature: str = "",
    step: int = -1,
) -> tuple[NodeHealth, str]:
    """``rec`` with one more failure of ``generation`` (reported at ``step``); why it is
    excluded now ('' if not)."""
    count = rec.failures + 1
    update: dict[str, object] = {
        "failures": count,
        "generation": generation,
        "step": max(step, -1),
        "cause": summary,
        "signature": signature or signature_of(summary),
        "origin": origin if origin in ("local", "config") else "unknown",
    }
    why = ""
    if not retry or count >= policy.failures:
        times = rec.exclusions + 1
        update |= {"exclusions": times, "excluded_until": now + exclusion_length(policy, times)}
        why = "retry false" if not retry else f"{count} consecutive failures"
    return rec.model_copy(update=update), why


AGREED_WHY = "the job's: an error every rank raises alike (agreed)"
"""Why an agreed error (``failure_text.AGREED_ERRORS``) is the job's, in reasons."""


def held(job: NodeHealth, now: float) -> bool:
    """Whether the job is excluded at ``now``: no layout is launched. A hold for a
    configuration error does not end by itself (a relaunch with the same config fails
    alike): it lasts until the training config changes (``forget_config``) or an operator's
    ``sailor node readmit --all``."""
    return job.excluded_until > now or config_hold(job)


def config_hold(job: NodeHealth) -> bool:
    return job.origin == "config" and job.failures > 0 and job.exclusions > 0


def describe(node: str, rec: NodeHealth, now: float, why: str = "") -> str:
    """One sentence for a reason or a log: node (or :data:`JOB`), until when, count, cause."""
    until = datetime.fromtimestamp(rec.excluded_until, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    left = max(0.0, rec.excluded_until - now)
    verb = "held" if node.startswith(JOB) else "excluded"
    head = f"{verb} {node} until {until} ({left:.0f} s, exclusion {rec.exclusions}"
    if node == JOB and config_hold(rec):
        head = (
            f"held {node} until the training config changes or `sailor node readmit --all` "
            f"(exclusion {rec.exclusions}"
        )
    return f"{head}; {why or f'{rec.failures} consecutive failures'}): {rec.cause}"
