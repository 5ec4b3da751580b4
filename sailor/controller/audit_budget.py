"""How many audit records the events of one source may cause: a token bucket per node.

Every event the leader takes is audited (``event``, ``event_rejected``,
``event_duplicate``), and an agent chooses how many it publishes on its own subjects: one
compromised node published 5,000 junk events in 0.04 s and the leader audited all of them
in about a second (~220 bytes each), so at that rate the rotated audit log (5 files of
``audit_max_bytes``, 64 MiB by default) lost every record of the run, preemptions and
launches with it, within minutes. Each source (the ``<source>`` token of its event
subjects, which its NATS permission makes its own) gets ``burst`` records, refilled at
``rate`` a second; past that its events are still handled, only not recorded one by one:
the first unrecorded one writes ``audit_budget_exceeded``, and once the source has been
quiet for ``QUIET_S``, ``events_unaudited`` says how many went unrecorded (the episode
ends there; the budget earned meanwhile is the next burst's), so the count of events stays
exact while the controller leads (a count of an episode its term ended in is lost). A
node's legitimate events (a join, a leave, a failure, a notice: a few a minute; heartbeats
are not audited) never come near ``burst``; a burst of 1,000 nodes joining is 1,000
sources.

Pure: the caller passes the time; no I/O. Must never import torch or the agent.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AUDIT_BURST", "AUDIT_RATE", "QUIET_S", "AuditBudget", "Take", "budget_source"]

AUDIT_BURST = 1000
"""Records one source may cause at once (the chaos fuzz sends 200 + 200 from one node)."""
AUDIT_RATE = 10.0
"""Records a second one source earns back: a flooding node then grows the log by ~2 KB/s."""
QUIET_S = 1.0
"""A source's episode over budget ends once it has sent nothing for this long, s."""
_MAX_SOURCES = 10_000
"""Sources remembered at most (without ``security:`` anyone may publish on any source)."""


def budget_source(subject: str) -> str:
    """The budget's key for an event subject: its ``<source>`` token
    (``sailor.<job>.events.<source>.<kind>``; the subject itself if it has none)."""
    parts = subject.split(".")
    return parts[3] if len(parts) > 4 else subject


@dataclass
class _Bucket:
    tokens: float
    at: float  # of the last refill
    suppressed: int = 0  # events unrecorded in this episode over budget (0: none)
    last: float = 0.0  # the source's last event


@dataclass(frozen=True, slots=True)
class Take:
    """What to write for one event: ``record`` (its own record or not), ``began`` (the first
    unrecorded one of an episode: write ``audit_budget_exceeded``)."""

    record: bool
    began: bool = False


class AuditBudget:
    """Token buckets of audit records, one per event source."""

    def __init__(self, burst: int = AUDIT_BURST, rate: float = AUDIT_RATE) -> None:
        if burst < 1 or rate <= 0:
            raise ValueError(f"burst={burst}, rate={rate}: both must be positive")
        self.burst = burst
        self.rate = rate
        self._buckets: dict[str, _Bucket] = {}

    def _bucket(self, source: str, now: float) -> _Bucket:
        b = self._buckets.get(source)
        if b is None:
            if len(self._buckets) >= _MAX_SOURCES:
                self._forget_full(now)
            b = self._buckets[source] = _Bucket(tokens=float(self.burst), at=now)
        else:
            b.tokens = min(float(self.burst), b.tokens + max(0.0, now - b.at) * self.rate)
            b.at = now
        return b

    def _forget_full(self, now: float) -> None:
        """Drop the sources back at a full budget with nothing owed (a fresh bucket is the
        same); if none is, the oldest (its count, if any, is lost: only without
        ``security:``, where anyone may publish as any source)."""
        for key in list(self._buckets):
            b = self._buckets[key]
            if b.suppressed == 0 and b.tokens + (now - b.at) * self.rate >= self.burst:
                del self._buckets[key]
        if len(self._buckets) >= _MAX_SOURCES:
            del self._buckets[next(iter(self._buckets))]

    def take(self, source: str, now: float) -> Take:
        """One event of ``source`` at ``now``: whether to record it, and what to report.
        Within an episode over budget every event is counted, whatever was earned since."""
        b = self._bucket(source, now)
        b.last = now
        if b.suppressed == 0 and b.tokens >= 1.0:
            b.tokens -= 1.0
            return Take(record=True)
        b.suppressed += 1
        return Take(record=False, began=b.suppressed == 1)

    def owed(self, now: float) -> list[tuple[str, int]]:
        """The sources whose episode over budget ended (quiet for ``QUIET_S``), each with
        its count of unrecorded events, now reset: for ``events_unaudited`` records."""
        out = []
        for source in sorted(self._buckets):
            b = self._buckets[source]
            if b.suppressed and now - b.last >= QUIET_S:
                out.append((source, b.suppressed))
                b.suppressed = 0
        return out
