"""The leader's event intake, mixed into ``Controller`` (``daemon.py``).

Events arrive from JetStream a fetched batch at a time (and preemption notices also through
the agents' status records in etcd): each is validated, checked against its subject (a node
speaks only for itself), deduplicated by event id, recorded (a notice as a guarded etcd write
under the leader's epoch) and audited; the batch's records are made durable with one fsync,
then the batch is acked. An etcd outage is retried in place for ``EVENT_RETRY_S``, then the
event is given back. :func:`urgent_wake` says which wake-ups skip the debounce.

``EventIntake`` holds no state of its own: the ``Controller`` it is mixed into owns every
attribute its methods use (declared below for the type checker). Must never import torch or
the agent.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import structlog
from pydantic import ValidationError

from sailor.controller.audit import AuditLog
from sailor.controller.audit_budget import AuditBudget, budget_source
from sailor.controller.config import ControllerConfig
from sailor.controller.event_stream import Report, StreamWatch, placed, shown, unplaced
from sailor.controller.observed import ObservedCache
from sailor.coordination import (
    Clock,
    Delivery,
    EtcdStore,
    FencedError,
    Keys,
    Leadership,
    NatsEventBus,
    ReplicasExceedClusterError,
    StreamConflictError,
    StreamNotPlacedError,
    StreamStorageError,
    TemporaryError,
    safe_token,
)
from sailor.coordination.sd_notify import SystemdNotifier
from sailor.schemas.events import Event, EventAdapter, NodeJoined, PreemptionNotice
from sailor.schemas.runtime import (
    AgentStatus,
    DesiredState,
    EventStreamState,
    NoticeRecord,
    shorten,
)

__all__ = ["EVENT_RETRY_S", "EventIntake", "urgent_wake"]

_log = structlog.get_logger("sailor.controller")

EVENT_RETRY_S = 10.0
"""How long an event is retried in place (etcd unavailable) before it is given back, s."""

_UNPLACED_PAUSE_S = 0.3
_UNPLACED_MAX_PAUSE_S = 2.0
"""Retries of an unplaced stream back off from 0.3 s to 2 s apart: each is a JetStream API
request through the meta leader, and a server's return is seen within 2 s (the stream was
placed 0.4-1.4 s after the missing member of a loopback cluster started)."""


def urgent_wake(kind: str, node_id: str, desired: DesiredState | None) -> bool:
    """Whether a wake-up about ``node_id`` (an event ``kind``) must skip the debounce.

    The debounce coalesces a burst of joins into one reconfiguration; waiting is worth it
    only while the job still runs. A preemption notice is urgent (its deadline runs), and so
    is a node of the running or the next layout leaving (``node_left``: the event, or its
    registration disappearing with its lease): the job is broken already, so a debounce only
    adds downtime before the abort. A leave of a node no layout uses, a join, a status change
    stay debounced. A burst of leaves still coalesces: what arrives while a pass runs is
    handled by the next one, and a loss during a transition aborts and replans once more.
    """
    if kind == "preemption_notice":
        return True
    if kind != "node_left" or desired is None:
        return False
    return node_id in desired.placement or node_id in desired.next_placement


@dataclass
class _Placement:
    """One term's event stream placement, as the consumer tracks it."""

    watch: StreamWatch = field(default_factory=StreamWatch)
    written: EventStreamState | None = None  # what etcd holds (``event-stream``)
    pause: float = _UNPLACED_PAUSE_S
    carried: bool = False  # a start read or written (unleased record), not deleted since
    cleared: bool = False  # that record deleted since (a placement): nothing to delete


class EventIntake:
    """Event handling of the leader's term: a mixin of ``Controller``, which owns the state."""

    cfg: ControllerConfig
    keys: Keys
    clock: Clock
    audit: AuditLog
    stopping: asyncio.Event
    desired: DesiredState | None
    event_counts: collections.Counter[str]
    on_event: Callable[[str, str, float, float], None] | None
    event_batches: int
    _unseen_notices: dict[str, float]
    _seen: collections.OrderedDict[str, None]
    _audit_budget: AuditBudget
    _fenced_epoch: int
    sd: SystemdNotifier

    if TYPE_CHECKING:

        def wake(self, urgent: bool = False) -> None: ...

        def fail(self, reason: str, **fields: Any) -> None: ...

    async def _notices_from_status(
        self,
        status: Mapping[str, AgentStatus],
        store: EtcdStore,
        lead: Leadership,
        cache: ObservedCache,
    ) -> None:
        """The etcd path of preemption notices: a notice an agent keeps in its status record
        (it does so at once, while NATS may be down) is handled once, as the event it is.

        Fenced like the event: RBAC lets an agent write only its own ``status/<id>``, the
        mirror believes a status only under its node's key, and the notice must name that
        node; then the event's own checks apply (registered node, deadline window) and its
        event id makes the NATS copy, whenever it arrives, a duplicate.
        """
        for node_id, st in sorted(status.items()):
            ev = st.notice
            if ev is None or ev.event_id in self._seen:
                continue
            # The status key vouches for its node as the subject does for a published event
            # (RBAC: an agent writes only its own status): the node's own event subject.
            subject = self.keys.event_subject(ev.kind, node_id)
            if ev.node_id != node_id:
                self._reject_event(
                    ev, subject, self.clock.now(), lead, f"in the status of {node_id}"
                )
                self._seen[ev.event_id] = None
                continue
            data = ev.model_dump_json().encode()
            msg_id = f"status/{node_id}"
            await self._handle_event(data, msg_id, subject, store, lead, cache)
            await self.audit.durable()

    async def _consume(
        self, bus: NatsEventBus, store: EtcdStore, lead: Leadership, cache: ObservedCache
    ) -> None:
        """Fetch a batch, handle each event, fsync the batch's records once, then ack it.

        Before each fetch the stream is ensured: a placement refused for good (replicas
        on a NATS server in no cluster) fails the controller; one refused for now (too few
        servers up and joined, or no room for its ``max_bytes``) is retried, reported and
        shown (``_ensure_stream``)."""
        placement = _Placement()
        while True:
            if not lead.fresh:
                # cut off from etcd: a new leader may consume from the same durable consumer;
                # what this one took it could neither record nor hand on for a while
                await self.clock.sleep(0.3)
                continue
            try:
                ready = await self._ensure_stream(bus, store, lead, placement)
            except ReplicasExceedClusterError as exc:
                self._stream_refused(exc, lead)
                return
            except (StreamConflictError, StreamStorageError) as exc:
                # another job's stream: no retry ends it; no room for its reservation past
                # ``event_stream_deadline_s`` (``_ensure_stream``): an operator's to end
                self.fail(str(exc), epoch=lead.epoch, stream=str(exc.fields.get("stream", "")))
                return
            except FencedError as exc:  # the record status reads: deposed
                self._consumer_fenced(lead, exc)
                return
            if not ready:
                continue
            try:
                batch = await bus.fetch(256, timeout=self.cfg.resync_s)
            except TemporaryError as exc:
                _log.warning("event_fetch_retry", error=str(exc))
                await self.clock.sleep(0.3)
                continue
            self.event_batches += 1 if batch else 0
            handled = []
            for d in batch:
                try:
                    if await self._handle_with_retry(d, store, lead, cache):
                        handled.append(d)
                except FencedError as exc:
                    # deposed: the term ends (the loop sees it), not just this consumer
                    self._consumer_fenced(lead, exc)
                    return
            self._audit_owed(lead)
            await self.audit.durable()
            for d in handled:
                try:
                    await d.ack()
                except TemporaryError as exc:  # redelivered, then handled as a duplicate
                    _log.warning("event_ack_failed", error=str(exc))

    def _audit_event(
        self, kind: str, now: float, lead: Leadership, arrived_on: str, /, **fields: Any
    ) -> None:
        """Write the audit record (``kind``: event, event_rejected, event_duplicate) of an
        event that ``arrived_on`` a subject, within its source's budget
        (``controller/audit_budget.py``): past it, counted instead, and reported as
        ``audit_budget_exceeded`` once, then ``events_unaudited`` with the count
        (``_audit_owed``, once the source is quiet)."""
        source = budget_source(arrived_on)
        take = self._audit_budget.take(source, now)
        if take.began:
            self.audit.write(
                "audit_budget_exceeded",
                now,
                epoch=lead.epoch,
                source=source,
                burst=self._audit_budget.burst,
                rate=self._audit_budget.rate,
            )
        if take.record:
            self.audit.write(kind, now, epoch=lead.epoch, **fields)

    def _audit_owed(self, lead: Leadership) -> None:
        """``events_unaudited`` for each source whose flood ended (quiet for a second)."""
        now = self.clock.now()
        for source, count in self._audit_budget.owed(now):
            self.audit.write("events_unaudited", now, epoch=lead.epoch, source=source, count=count)

    def _consumer_fenced(self, lead: Leadership, exc: FencedError) -> None:
        self.audit.write("fenced", self.clock.now(), sync=True, epoch=lead.epoch, error=str(exc))
        self._fenced_epoch = lead.epoch
        self.wake(urgent=True)

    def _stream_refused(self, exc: ReplicasExceedClusterError, lead: Leadership | None) -> None:
        """Replicas on a NATS server in no cluster: a configuration error, which no retry
        ends. The controller fails (every one with this config will). Only this refusal
        fails it: "no suitable peers" is a shortage a server's return may end, and a
        client cannot count the cluster's configured servers to tell it from a cluster too
        small (``nats_bus.placement_error``). ``lead`` None: told at the start, from the
        server's INFO, before any term (``nats_bus.unclustered_replicas``)."""
        replicas = self.cfg.event_stream_replicas
        size = exc.fields.get("cluster_size")
        self.fail(
            f"event_stream_replicas={replicas} cannot be placed: {exc.args[0]}; set "
            f"event_stream_replicas to at most {size}, or run a NATS cluster",
            epoch=lead.epoch if lead is not None else -1,
            replicas=replicas,
            cluster_size=size,
            answer=str(exc.fields.get("reason", ""))[:300],
        )

    async def _ensure_stream(
        self, bus: NatsEventBus, store: EtcdStore, lead: Leadership, placement: _Placement
    ) -> bool:
        """Ensure the stream; False (after a pause) to try again. A placement refused for
        now is reported once and shown (``event_stream``); its end too. A reservation
        refused (``StreamStorageError``: ``max_file_store`` full) is such a shortage too:
        another job's stream being deleted may end it; raised once it has lasted
        ``event_stream_deadline_s`` (the controller fails, naming both settings). Before,
        it failed at once, and systemd's restart limit soon left the job no controller."""
        try:
            await bus.ensure_stream()
        except (StreamNotPlacedError, StreamStorageError) as exc:
            reason = f"{exc.args[0]}: {exc.fields.get('reason', '')}"
            now, began = self.clock.now(), None
            if placement.watch.placed:  # an episode begins: of this term, or carried on
                # its start may be written, whether or not etcd answers the write: deleted
                # at the next placement in any case (before, a write whose answer was lost
                # kept the term's earlier "cleared", and the start outlived the shortage)
                placement.cleared = False
                began = await self._shortage_began(store, lead, placement, reason, now)
            placement.watch, reports = unplaced(
                placement.watch,
                now,
                reason,
                self.cfg.event_stream_deadline_s,
                began,
            )
            if not reports:
                _log.debug("event_stream_unplaced_retry", reason=reason)
            self._report_stream(reports, placement.watch, lead, reason)
            await self._show_stream(placement, store, lead)
            if isinstance(exc, StreamStorageError) and placement.watch.overdue:
                raise
            await self.clock.sleep(placement.pause)
            placement.pause = min(placement.pause * 2, _UNPLACED_MAX_PAUSE_S)
            return False
        except TemporaryError as exc:
            _log.warning("event_fetch_retry", error=str(exc))
            await self.clock.sleep(0.3)
            return False
        placement.pause = _UNPLACED_PAUSE_S
        if not placement.cleared:
            await self._shortage_over(store, lead, placement)
        began = placement.watch.since  # of the episode that ends here, if one does
        placement.watch, reports = placed(placement.watch, self.clock.now())
        self._report_stream(reports, placement.watch, lead, "", began)
        await self._show_stream(placement, store, lead)
        return True

    async def _shortage_began(
        self, store: EtcdStore, lead: Leadership, placement: _Placement, reason: str, now: float
    ) -> float | None:
        """When the shortage an episode's first failed placement (at ``now``) meets began:
        the start an earlier term kept (``event-stream-shortage``, unleased), or None,
        ``now`` written there as its start for the next term. Read or written once an
        episode (etcd failing: tried again at the next episode's start). A start this
        term wrote (its epoch) or read before is an earlier episode's, which a placement
        of this term ended and whose delete failed or whose write's answer was lost: not
        carried, overwritten. Before, each term counted from its own first failure: under
        leader changes more frequent than ``event_stream_deadline_s`` a shortage was never
        reported overdue."""
        # read or written at an earlier episode of this term, and not deleted since (its
        # delete at the placement failed): whatever the key holds is over, overwritten here
        stale = placement.carried
        key = self.keys.event_stream_shortage
        try:
            kv = None if stale else await store.get(key)
            if kv is not None:
                try:
                    kept = EventStreamState.model_validate_json(kv.value)
                except ValidationError as exc:  # rewritten below: never stops the term
                    _log.warning("event_stream_shortage_unreadable", error=str(exc)[:300])
                else:
                    if kept.epoch != lead.epoch:
                        placement.carried = True
                        return kept.since
                    # this term's own: an earlier episode's, which a placement of this
                    # term ended (an episode begins only once placed) and whose delete
                    # failed: stale, replaced by this episode's start below
            record = EventStreamState(
                placed=False,
                since=now,
                reason=shorten(reason, 1024),
                replicas=self.cfg.event_stream_replicas,
                epoch=lead.epoch,
            )
            await store.put_guarded(
                key, record.model_dump_json().encode(), self.keys.leader, lead.epoch
            )
        except TemporaryError as exc:
            _log.debug("event_stream_shortage_unread", error=str(exc))
            return None
        placement.carried = True
        return None

    async def _shortage_over(
        self, store: EtcdStore, lead: Leadership, placement: _Placement
    ) -> None:
        """The stream placed: delete the kept start of a shortage (``event-stream-shortage``)
        at the term's first placement and after each episode, whichever term wrote it (a
        leader deposed between its placement and this delete left it to the next term's).
        etcd failing: tried again at the next placement; fenced: raises."""
        try:
            await store.delete_guarded(
                self.keys.event_stream_shortage, self.keys.leader, lead.epoch
            )
        except TemporaryError as exc:
            _log.debug("event_stream_shortage_undeleted", error=str(exc))
            return
        placement.cleared, placement.carried = True, False  # a later episode writes its own

    def _report_stream(
        self,
        reports: tuple[Report, ...],
        watch: StreamWatch,
        lead: Leadership,
        reason: str,
        began: float | None = None,
    ) -> None:
        """The audit record, journal line and systemd status of each report (``began``:
        the start of the episode a placement ends)."""
        now = self.clock.now()
        replicas = self.cfg.event_stream_replicas
        for kind in reports:
            since = watch.since if watch.since is not None else now
            if kind == "event_stream_unplaced":
                # ``since`` before now: a shortage an earlier term began (carried over)
                self.audit.write(
                    kind,
                    now,
                    sync=True,
                    epoch=lead.epoch,
                    replicas=replicas,
                    reason=reason,
                    since=since,
                )
                _log.warning(kind, replicas=replicas, reason=reason, since=since)
                self.sd.status(
                    f"leader, epoch {lead.epoch}; event stream not placed: {reason}"[:200]
                )
            elif kind == "event_stream_overdue":
                deadline = self.cfg.event_stream_deadline_s
                self.audit.write(
                    kind, now, sync=True, epoch=lead.epoch, since=since, deadline_s=deadline
                )
                _log.error(kind, replicas=replicas, since=since, deadline_s=deadline)
                self.sd.status(
                    f"leader, epoch {lead.epoch}; event stream OVERDUE, not placed for "
                    f"{now - since:.0f} s: {watch.reason}"[:200]
                )
            else:
                took = round(now - (began if began is not None else now), 1)
                self.audit.write(
                    kind, now, sync=True, epoch=lead.epoch, replicas=replicas, unplaced_s=took
                )
                _log.info(kind, replicas=replicas, unplaced_s=took)
                self.sd.status(f"leader, epoch {lead.epoch}")

    async def _show_stream(self, placement: _Placement, store: EtcdStore, lead: Leadership) -> None:
        """Write the record ``sailor status`` reads if it changed (nothing while no
        placement failed). Guarded, bound to the leader's lease: it goes with the term. Not
        written (etcd unavailable): tried again at the next outcome; fenced: raises."""
        record = shown(placement.watch, self.cfg.event_stream_replicas, lead.epoch)
        if record is None or record == placement.written:
            return
        try:
            await store.put_guarded(
                self.keys.event_stream,
                record.model_dump_json().encode(),
                self.keys.leader,
                lead.epoch,
                lease=lead.lease,
            )
        except TemporaryError as exc:
            _log.debug("event_stream_state_unwritten", error=str(exc))
            return
        placement.written = record

    async def _handle_with_retry(
        self, d: Delivery, store: EtcdStore, lead: Leadership, cache: ObservedCache
    ) -> bool:
        """Handle one event, retrying in place through a short etcd outage; True if handled.

        A notice must not wait for the stream's ack_wait (30 s) to be tried again: its
        deadline may be that long. After ``EVENT_RETRY_S`` the event is given back with a
        short redelivery delay, so one event that keeps failing does not hold up the rest.
        """
        t0 = self.clock.now()
        pause = 0.1
        while True:
            try:
                await self._handle_event(d.data, d.msg_id, d.subject, store, lead, cache)
                return True
            except TemporaryError as exc:
                _log.warning("event_retry", msg_id=d.msg_id, error=str(exc))
                if (
                    self.stopping.is_set()
                    or not lead.held
                    or self.clock.now() - t0 >= EVENT_RETRY_S
                ):
                    break
                await self.clock.sleep(min(max(pause, exc.retry_after or 0.0), 1.0))
                pause *= 2
            except FencedError:
                raise
            except Exception as exc:
                # Not to be retried (an etcd refusal, the audit log failing): on record, then
                # the consumer crashes and takes the controller down (``_task_crashed``).
                with contextlib.suppress(OSError, ValueError):
                    self.audit.write(
                        "event_failed",
                        self.clock.now(),
                        epoch=lead.epoch,
                        msg_id=d.msg_id[:128],
                        subject=d.subject[:256],
                        error=repr(exc)[:300],
                    )
                raise
        try:
            await d.nak(0.5)
        except TemporaryError as exc:  # redelivered after ack_wait instead
            _log.warning("event_nak_failed", error=str(exc))
        return False

    async def _handle_event(
        self,
        data: bytes,
        msg_id: str,
        subject: str,
        store: EtcdStore,
        lead: Leadership,
        cache: ObservedCache,
    ) -> None:
        received = self.clock.now()
        outcome, event_id = await self._apply_event(
            data, msg_id, subject, store, lead, cache, received
        )
        self.event_counts[outcome] += 1
        if self.on_event is not None:
            self.on_event(event_id or msg_id, outcome, received, self.clock.now())

    def _reject_event(
        self, ev: Event, subject: str, now: float, lead: Leadership, reason: str
    ) -> tuple[str, str]:
        """Audit a well-formed event the controller refuses; the outcome to return."""
        self._audit_event(
            "event_rejected",
            now,
            lead,
            subject,
            event_id=ev.event_id,
            event_kind=ev.kind,
            node_id=ev.node_id,
            subject=subject[:256],
            reason=reason,
        )
        return "rejected", ev.event_id

    async def _apply_event(
        self,
        data: bytes,
        msg_id: str,
        subject: str,
        store: EtcdStore,
        lead: Leadership,
        cache: ObservedCache,
        now: float,
    ) -> tuple[str, str]:
        """Validate and record one event; returns (outcome, event id)."""
        try:
            ev = EventAdapter.validate_json(data)
        except ValidationError as exc:
            self._audit_event(
                "event_rejected",
                now,
                lead,
                subject,
                msg_id=msg_id[:128],
                subject=subject[:256],
                reason=str(exc).splitlines()[0][:300],
            )
            return "rejected", ""
        source = self.keys.event_source(subject)
        if source != safe_token(ev.node_id):
            # An agent may publish only on its own node's subjects (its NATS permission), so
            # the subject says who sent this: one node must not speak for another. Checked
            # before the duplicate check, and the id is not remembered: a forgery that reuses
            # a genuine event's id must not make the genuine one a duplicate.
            return self._reject_event(
                ev, subject, now, lead, f"sent on {source!r}'s subject, about {ev.node_id!r}"
            )
        if ev.event_id in self._seen:
            self._audit_event(
                "event_duplicate", now, lead, subject, event_id=ev.event_id, subject=subject
            )
            return "duplicate", ev.event_id
        outcome = await self._apply_new_event(ev, subject, store, lead, cache, now)
        # Seen only once handled: an event that failed (etcd unavailable) is redelivered
        # and must then be applied, not dropped as a duplicate.
        self._seen[ev.event_id] = None
        while len(self._seen) > 200_000:
            self._seen.popitem(last=False)
        return outcome

    async def _apply_new_event(
        self,
        ev: Event,
        subject: str,
        store: EtcdStore,
        lead: Leadership,
        cache: ObservedCache,
        now: float,
    ) -> tuple[str, str]:
        if ev.kind != "node_left":
            # The mirror answers for a node it holds; a node it does not hold may have
            # registered after its last delta, so etcd is asked (forged ids end up here).
            registered = cache.registered(ev.node_id)
            if registered is None:
                registered = await store.get(self.keys.node(ev.node_id)) is not None
            if not registered:
                return self._reject_event(ev, subject, now, lead, "node is not registered")
        if isinstance(ev, PreemptionNotice):
            if not now - 60 <= ev.deadline <= now + self.cfg.max_notice_horizon_s:
                return self._reject_event(
                    ev, subject, now, lead, f"deadline {ev.deadline} outside the accepted window"
                )
            rec = NoticeRecord(
                node_id=ev.node_id, deadline=ev.deadline, event_id=ev.event_id, source=ev.source
            )
            await store.put_guarded(
                self.keys.notice(ev.node_id),
                rec.model_dump_json().encode(),
                self.keys.leader,
                lead.epoch,
            )
            self._unseen_notices[ev.node_id] = self.clock.now()
        if ev.kind != "heartbeat":
            facts = ev.facts if isinstance(ev, NodeJoined) else None
            extra: dict[str, Any] = {"facts": facts.summary()} if facts is not None else {}
            self._audit_event(
                "event",
                now,
                lead,
                subject,
                event_id=ev.event_id,
                event_kind=ev.kind,
                node_id=ev.node_id,
                subject=subject,
                latency_s=round(now - ev.time, 4),
                **extra,
            )
        self.wake(urgent=urgent_wake(ev.kind, ev.node_id, self.desired))
        return "accepted", ev.event_id
