"""Which nodes a layout may use: a node whose workers keep failing is left out for a while.

Without it a rank that cannot run on a node (a GPU fallen off the bus, a CUDA error at every
launch, a configuration the worker refuses) made the controller abort and relaunch on that
very node forever: ``decide`` is level-triggered and had no memory of who failed. The memory
is the desired state's ``node_health`` (``sailor.schemas.runtime.NodeHealth``), so a new
leader inherits it and a replay of the audit log reproduces it. The rules:

- A failure counts against a node when it began there: the worker's error record
  (``sailor.megatron_patch.errors.failure_record``, the first 2000 characters of its JSON in
  ``AgentStatus.failure``) says ``origin`` local or config, or the text is no record at all
  (the supervisor's ``rank N exit C: ...``, a toy worker's record without an origin). A
  ``peer`` failure does not: when one rank dies its peers on other nodes fail too, and they
  are not at fault. Each generation counts at most once per node.
- A node is excluded at once when its record says ``retry: false`` (a configuration error,
  which a relaunch cannot mend), or at ``ExclusionPolicy.failures`` consecutive counted
  failures. The first exclusion lasts ``exclude_s``, each further one of the same node twice
  the previous, up to ``max_exclude_s``: a backoff, so a node that was repaired (or a
  transient fault) comes back without an operator.
- The consecutive count resets when a generation placed on the node trains (VERIFY ->
  RUNNING: every node reported a step past the generation's start). Until then a node whose
  exclusion ran out is on probation: its next failure excludes it again, for twice as long.
  The exclusion count (the backoff) stays until the node deregisters; then the whole record
  goes (a node that registers again under the same id starts afresh, as a new VM does).

Pure: no I/O, no clock (the caller passes ``now``), inputs never modified. Must never import
the agent, torch or ``megatron_patch`` (the record's keys are read by name).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import cached_property
from typing import Literal

from pydantic import Field, model_validator

from sailor.schemas._base import Frozen, field_error
from sailor.schemas.runtime import NodeHealth

__all__ = [
    "ExclusionPolicy",
    "FailureCause",
    "charge",
    "describe",
    "excluded",
    "forget_gone",
    "parse_failure",
    "trained",
]

Origin = Literal["local", "peer", "config", "unknown"]

CAUSE_CHARS = 200
"""Characters of a failure kept in a node's record and quoted in a reason."""


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
        default=3600.0, gt=0, description="Longest exclusion, s (the doubling's cap)."
    )

    @model_validator(mode="after")
    def _cap_above_first(self) -> ExclusionPolicy:
        if self.max_exclude_s < self.exclude_s:
            raise field_error(
                "max_exclude_s", self.max_exclude_s, f"below exclude_s ({self.exclude_s})"
            )
        return self


@dataclass(frozen=True)
class FailureCause:
    """What a failure text says about where the failure began and whether to retry."""

    origin: Origin
    retry: bool
    text: str

    @property
    def own(self) -> bool:
        """The failure began on the node that reported it (anything but a peer's)."""
        return self.origin != "peer"

    @cached_property
    def summary(self) -> str:
        """``error_type: message`` of a record, else the text itself; at most
        ``CAUSE_CHARS`` (worked out only when asked: a peer's is never quoted)."""
        try:
            data = json.loads(self.text)
        except ValueError:
            data = None
        if isinstance(data, dict):
            kind = str(data.get("error_type") or data.get("error") or "")
            message = str(data.get("message", ""))
        else:  # cut off, or no record at all
            kind_m, message_m = _ERROR_TYPE.search(self.text), _MESSAGE.search(self.text)
            kind = kind_m.group(1) if kind_m else ""
            message = message_m.group(1) if message_m else ""
        if kind or message:
            return (f"{kind}: {message}" if kind else message)[:CAUSE_CHARS]
        return self.text[:CAUSE_CHARS]


# Keys of a record as JSON writes them: a quote inside a string value is escaped (\"), so
# these match the record's own keys only, in a whole record and in one cut off alike.
_ORIGIN = re.compile(r'"origin"\s*:\s*"(local|peer|config)"')
_RETRY = re.compile(r'"retry"\s*:\s*(true|false)')
_ERROR_TYPE = re.compile(r'"(?:error_type|error)"\s*:\s*"((?:[^"\\]|\\.)*)')
_MESSAGE = re.compile(r'"message"\s*:\s*"((?:[^"\\]|\\.)*)')


def parse_failure(text: str) -> FailureCause:
    """The origin and retry policy of ``AgentStatus.failure``.

    A worker's record is JSON, but the agent keeps only its first 2000 characters, so a long
    traceback cuts it off: the keys are read from the text, whole or not (``failure_record``
    writes ``origin`` and ``retry`` right after ``rank`` and ``step``), without parsing it
    (at an abort of 512 nodes most report a peer's failure, every teardown pass). No record,
    or one without an origin: ``unknown``, retry unless it says ``false``.
    """
    text = text.strip()
    if not text.startswith("{"):
        return FailureCause("unknown", True, text)
    o, r = _ORIGIN.search(text), _RETRY.search(text)
    origin: Origin = o.group(1) if o else "unknown"  # type: ignore[assignment]
    return FailureCause(origin, not (r and r.group(1) == "false"), text)


def _length(policy: ExclusionPolicy, exclusions: int) -> float:
    """The ``exclusions``-th exclusion's length: doubled each time, capped."""
    return min(policy.exclude_s * 2.0 ** min(exclusions - 1, 64), policy.max_exclude_s)


def charge(
    health: Mapping[str, NodeHealth],
    failures: Mapping[str, str],
    generation: int,
    now: float,
    policy: ExclusionPolicy,
) -> tuple[dict[str, NodeHealth], list[str]]:
    """``health`` with the failures of ``generation`` (node -> ``AgentStatus.failure``)
    counted, and one sentence per node this excluded (``describe``).

    A node already counted for ``generation`` is not counted again (the abort and the
    teardown after it both see the same failed status); a peer's failure is not counted.
    """
    out = dict(health)
    notes: list[str] = []
    for node in sorted(failures):
        rec = out.get(node, NodeHealth())
        if rec.generation == generation:
            continue
        cause = parse_failure(failures[node])
        if not cause.own:
            continue
        count = rec.failures + 1
        update: dict[str, object] = {
            "failures": count,
            "generation": generation,
            "cause": cause.summary,
        }
        if not cause.retry or count >= policy.failures:
            times = rec.exclusions + 1
            update |= {"exclusions": times, "excluded_until": now + _length(policy, times)}
        out[node] = rec.model_copy(update=update)
        if "excluded_until" in update:
            why = "retry false" if not cause.retry else f"{count} consecutive failures"
            notes.append(describe(node, out[node], now, why))
    return out, notes


def trained(health: Mapping[str, NodeHealth], nodes: Iterable[str]) -> dict[str, NodeHealth]:
    """``health`` after a generation trained on ``nodes``: their consecutive count is 0; a
    record that has nothing else to remember (never excluded) goes."""
    out = dict(health)
    for node in nodes:
        rec = out.get(node)
        if rec is None or rec.failures == 0:
            continue
        if rec.exclusions == 0:
            del out[node]
        else:
            out[node] = rec.model_copy(update={"failures": 0})
    return out


def excluded(health: Mapping[str, NodeHealth], now: float) -> frozenset[str]:
    """The nodes no layout may use at ``now``."""
    return frozenset(n for n, r in health.items() if r.excluded_until > now)


def forget_gone(
    health: Mapping[str, NodeHealth], registered: Mapping[str, object]
) -> dict[str, NodeHealth]:
    """``health`` without the records of nodes no longer registered."""
    return {n: r for n, r in health.items() if n in registered}


def describe(node: str, rec: NodeHealth, now: float, why: str = "") -> str:
    """One sentence for a reason or a log: node, until when, count, cause."""
    until = datetime.fromtimestamp(rec.excluded_until, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    left = max(0.0, rec.excluded_until - now)
    head = f"excluded {node} until {until} ({left:.0f} s, exclusion {rec.exclusions}"
    return f"{head}; {why or f'{rec.failures} consecutive failures'}): {rec.cause}"
