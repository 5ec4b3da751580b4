"""The leader's watch over its event stream's placement: what to report, and when. Pure.

JetStream refuses to place the event stream while fewer NATS servers are up (or joined)
than ``event_stream_replicas`` asks for; the leader then takes no event from NATS and
retries (``event_intake``). It still leads: joins and leaves arrive as registrations in
etcd, preemption notices as the agents' status records; what it lacks are the events'
early wake-ups and their audit records. An episode of failed placements is reported once
at its start, once when it has lasted ``event_stream_deadline_s`` (overdue) and once at
its end, not at every retry; the record ``sailor status`` shows follows every change. A
shortage outlives the term it began in: its start is kept in etcd (unleased,
``event-stream-shortage``) until a placement, and a new leader's episode counts from it.

No I/O and no clock: the shell passes ``now`` and writes what these functions return.
Must never import torch or the agent.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from sailor.schemas.runtime import EventStreamState, shorten

__all__ = ["Report", "StreamWatch", "placed", "shown", "unplaced"]

Report = Literal["event_stream_unplaced", "event_stream_overdue", "event_stream_placed"]
"""What an outcome reports once (each an audit record kind): an episode began, passed its
deadline, ended."""


@dataclass(frozen=True)
class StreamWatch:
    """One term's view of its event stream's placement.

    ``since`` is None while no placement failed (the term's normal course: nothing is
    written); otherwise the first failure of the current episode, or, once ``placed``,
    the time it ended (``placed`` True then, kept for ``sailor status``)."""

    since: float | None = None
    placed: bool = True
    reason: str = ""
    overdue: bool = False


def unplaced(
    watch: StreamWatch, now: float, reason: str, deadline_s: float, began: float | None = None
) -> tuple[StreamWatch, tuple[Report, ...]]:
    """A placement failed at ``now`` (``reason``: JetStream's answer): the next watch, and
    the reports due (the episode's start, its deadline passing). ``began``: when the
    shortage began under an earlier term (``event-stream-shortage``), for an episode this
    failure begins in this one: its deadline counts from there (at most ``now``)."""
    reports: tuple[Report, ...] = ()
    if watch.placed:
        since = now if began is None else min(began, now)
        watch = StreamWatch(since=since, placed=False, reason=reason)
        reports = ("event_stream_unplaced",)
    else:
        watch = replace(watch, reason=reason)  # the latest answer shows; reported once
    since = now if watch.since is None else watch.since  # set: the episode's first failure
    if not watch.overdue and now - since >= deadline_s:
        watch = replace(watch, overdue=True)
        reports = (*reports, "event_stream_overdue")
    return watch, reports


def placed(watch: StreamWatch, now: float) -> tuple[StreamWatch, tuple[Report, ...]]:
    """The stream is placed at ``now``: the next watch, and the episode's end if one was
    open."""
    if watch.placed:
        return watch, ()
    return StreamWatch(since=now, placed=True), ("event_stream_placed",)


def shown(watch: StreamWatch, replicas: int, epoch: int) -> EventStreamState | None:
    """The record ``sailor status`` reads for ``watch``; None while nothing failed."""
    if watch.since is None:
        return None
    return EventStreamState(
        placed=watch.placed,
        since=watch.since,
        reason=shorten(watch.reason, 1024),
        replicas=replicas,
        overdue=watch.overdue,
        epoch=epoch,
    )
