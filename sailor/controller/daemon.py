"""``sailor controller``: the asyncio daemon around ``decide``.

One process per controller; several may run, one leads. The leader's loop: wake on an event
(JetStream), on a change in etcd (a watch delta of the observed prefixes) or every
``resync_s``; debounce outside wake-ups (joins, leaves of idle nodes, status changes) once,
by ``debounce_s``, but not an urgent one (:func:`urgent_wake`: a preemption notice, a node of
the layout leaving or losing its lease) nor the loop's own follow-ups (a pass that changed
the desired state, a finished plan, a fully answered command fan-out); take the
observed state from the watch-kept mirrors (``observed.py``: no etcd read per pass, records
re-validated only when they changed); ``decide``; apply; make the pass's audit records
durable (one fsync). Events are handled a fetched batch at a time: validated and recorded,
one fsync for the batch, then acked. A poll every ``poll_s`` checks the mirrors against
etcd. If the lease is lost or a guarded write is fenced (by the loop or by the event
consumer), the term ends and the controller campaigns again as a standby.

The job's training config (``ControllerConfig.training``) is read, validated and anchored
when the ``Controller`` is built (``training.py``): an invalid one raises there, before any
connection or task; each launch hands it to the workers through the desired state.

Operators' readmit requests (``readmit/``, ``sailor node readmit``) are mirrored like the
observed prefixes and handed to ``decide``, which forgets the records they name; the
executor deletes each once the desired state without them is written.

Online calibration (``online_calibration.py``): each pass hands ``decide`` the calibrator's
verdict (if one says to reconfigure) and may start a fit of the agents' step timings; a new
leader reads the kept calibration back from etcd before its first pass.

Nothing fails in silence: a crash of any task of the term (the event consumer, the etcd
check, a command, a replan) or a desired state it cannot read on takeover takes the
controller down — a ``failed`` audit record, leadership resigned, ``run`` raises
``DaemonFailedError`` and the process exits non-zero (systemd restarts it). A controller
never leads from a blank state over one it could not read: generations stay monotone across
leaders. Must never import torch or the agent.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import gc
import signal
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from typing import Any

import structlog
from pydantic import ValidationError

from sailor.controller.audit import AuditLog
from sailor.controller.config import ControllerConfig
from sailor.controller.decide import decide, unusable
from sailor.controller.decision_types import DecideConfig, Observed
from sailor.controller.executor import Executor
from sailor.controller.observed import ObservedCache
from sailor.controller.online_calibration import Calibrator
from sailor.controller.planning import Planner, ProcessPlanner, planner_from_config
from sailor.controller.training import check_checkpoint_dirs, load_training
from sailor.coordination import (
    Clock,
    DaemonFailedError,
    Delivery,
    EtcdStore,
    FencedError,
    Keys,
    Leadership,
    NatsCommands,
    NatsEventBus,
    PrefixMirror,
    SystemClock,
    TaskSet,
    TemporaryError,
    campaign,
    close_nats,
    connect_etcd,
    connect_nats,
    safe_token,
)
from sailor.coordination.sd_notify import SystemdNotifier
from sailor.schemas.events import Event, EventAdapter, NodeJoined, PreemptionNotice
from sailor.schemas.runtime import AgentStatus, DesiredState, NoticeRecord, ReadmitRequest
from sailor.schemas.training import TrainingConfig

__all__ = ["Controller", "freeze_startup_heap", "run_controller", "urgent_wake"]

_log = structlog.get_logger("sailor.controller")

EVENT_RETRY_S = 10.0
"""How long an event is retried in place (etcd unavailable) before it is given back, s."""


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


class Controller:
    """One controller process (leader or standby)."""

    def __init__(
        self, config: ControllerConfig, planner: Planner | None = None, clock: Clock | None = None
    ) -> None:
        self.cfg = config
        # read and validated before anything starts: an invalid file stops the controller
        self.training: TrainingConfig | None = None
        if config.training is not None:
            self.training = load_training(config.training)
            check_checkpoint_dirs(config.training, config.checkpoint_dir, self.training)
        self.keys = Keys(job=config.job)
        self.clock = clock or SystemClock()
        if planner is None and config.planner == "sailor" and config.planner_process:
            planner = ProcessPlanner(config)
        self.planner = planner or planner_from_config(config)
        self.decide_cfg = DecideConfig(
            deadlines=config.deadlines,
            checkpoint_dir=config.checkpoint_dir,
            keep_checkpoints=config.keep_checkpoints,
            notice_margin_s=config.notice_margin_s,
            stop_ahead_steps=config.stop_ahead_steps,
            in_place=config.in_place,
            base_port=config.base_port,
            training=self.training,
            exclusion=config.exclusion,
        )
        self.audit = AuditLog(config.audit_log, max_bytes=config.audit_max_bytes)
        # reads the cost model's inputs now, like the training config: a broken file stops it
        self.calibrator = Calibrator(config, self.planner, self.audit, self.clock, self.training)
        self.stopping = asyncio.Event()
        self.sd = SystemdNotifier.from_env()
        self.leadership: Leadership | None = None
        self.desired: DesiredState | None = None
        self.decisions = 0
        self._wake = asyncio.Event()
        self._urgent = False
        self._urgent_wake = asyncio.Event()  # cuts a debounce short
        # Notices written to etcd that the mirror has not shown a pass yet (node id -> time):
        # the wake-up their watch delta brings is urgent too, not debounced.
        self._unseen_notices: dict[str, float] = {}
        self._seen: collections.OrderedDict[str, None] = collections.OrderedDict()
        # Measurement hooks (benchmarks/runtime_burst.py): handled events by outcome, and an
        # optional observer called once per handled event with (event id or msg id, outcome,
        # received time, handled time). Bounded: a Counter of three keys; no per-event memory.
        self.event_counts: collections.Counter[str] = collections.Counter()
        self.on_event: Callable[[str, str, float, float], None] | None = None
        self.event_batches = 0  # fetched batches that held events (one fsync each)
        self.failure: str | None = None  # why this controller must exit non-zero
        self._fenced_epoch = -1  # a term the event consumer found fenced: it ends
        # readmit requests by key: (value, parsed or None), re-validated only on a change
        self._readmit_seen: dict[str, tuple[bytes, ReadmitRequest | None]] = {}

    def wake(self, urgent: bool = False) -> None:
        if urgent or self._unseen_notices:
            self._urgent = True
            self._urgent_wake.set()
        self._wake.set()

    async def run(self) -> None:
        sec = self.cfg.security
        store = await self._retry(lambda: connect_etcd(self.cfg.etcd_endpoints, security=sec))
        nc = await self._retry(
            lambda: connect_nats(self.cfg.nats_urls, self.cfg.identity, 5.0, sec)
        )
        if store is None or nc is None:
            return
        self.sd.ready("standby: connected to etcd and NATS")
        warm = self.planner.warm_up() if isinstance(self.planner, ProcessPlanner) else None
        warming = asyncio.create_task(warm, name="controller:planner-warm-up") if warm else None
        try:
            while not self.stopping.is_set():
                self.sd.watchdog()
                try:
                    lead = await campaign(
                        store,
                        self.keys.leader,
                        self.cfg.identity,
                        self.cfg.lease_ttl_s,
                        timeout=self.cfg.resync_s,
                        clock=self.clock,
                    )
                except TemporaryError:
                    continue
                self.sd.status(f"leader, epoch {lead.epoch}")
                self.audit.write(
                    "leader", self.clock.now(), sync=True, epoch=lead.epoch, who=self.cfg.identity
                )
                try:
                    await self._lead(store, nc, lead)
                except Exception as exc:  # the leader's own loop: nothing may end it quietly
                    self.fail("leader loop crashed", epoch=lead.epoch, error=repr(exc)[:500])
                finally:
                    self.leadership = None
                    self.sd.status("standby")
                    if self.stopping.is_set():
                        await lead.resign()
                    else:
                        await lead.abandon()
        finally:
            if self.stopping.is_set():
                self.sd.stopping()
            if warming is not None:
                warming.cancel()
                with contextlib.suppress(BaseException):
                    await warming
            if isinstance(self.planner, ProcessPlanner):
                self.planner.close()
            await store.close()
            await close_nats(nc, 3)
            self.audit.close()
        if self.failure is not None:
            raise DaemonFailedError("controller failed", reason=self.failure)

    def fail(self, reason: str, **fields: Any) -> None:
        """Take the controller down: audit, alert, resign, and make ``run`` raise."""
        if self.failure is None:
            self.failure = reason
        _log.error("controller_failed", reason=reason, **fields)
        with contextlib.suppress(OSError, ValueError):  # the audit log may be what failed
            self.audit.write("failed", self.clock.now(), sync=True, reason=reason[:500], **fields)
        self.sd.status(f"failed: {reason}"[:200])
        self.stopping.set()
        self.wake(urgent=True)

    def _task_crashed(self, name: str, exc: BaseException) -> None:
        self.fail(f"task {name} crashed", error=repr(exc)[:500])

    async def _retry(self, make: Any) -> Any:
        while not self.stopping.is_set():
            try:
                return await make()
            except TemporaryError as exc:
                _log.warning("connect_retry", error=str(exc))
                await self.clock.sleep(0.5)
        return None

    async def _lead(self, store: EtcdStore, nc: Any, lead: Leadership) -> None:
        tasks = TaskSet(f"controller-{lead.epoch}", on_crash=self._task_crashed)
        bus = NatsEventBus(
            nc,
            self.keys,
            durable=f"controller-{self.keys.job}",
            replicas=self.cfg.event_stream_replicas,
        )
        executor = Executor(
            store,
            NatsCommands(nc, self.keys),
            self.keys,
            self.audit,
            lead,
            self.planner,
            self.clock,
            tasks,
            self.wake,
            self.cfg.command_timeout_s,
            self.cfg.resend_s,
        )
        cache = ObservedCache(
            store, self.keys, self._reject, on_change=self.wake, on_node_gone=self._node_gone
        )
        readmits = PrefixMirror(store, self.keys.readmits, self.wake)
        try:
            adopted = await self._adopt(store, executor, lead)
            if adopted is None:
                return
            desired = adopted
            if not await self._restore_calibration(store, lead):
                return
            for start in (cache.start, readmits.start):
                while not await self._start_cache(start):
                    await self.clock.sleep(0.2)
                    if self.stopping.is_set() or not lead.held:
                        return
            self.leadership = lead  # public once it has a desired state to show
            tasks.spawn("events", self._consume(bus, store, lead, cache))
            tasks.spawn("etcd-check", self._check(cache, readmits))
            while self._term_goes_on(lead):
                self.sd.watchdog()
                await self._sleep_until_woken(desired)
                if not self._term_goes_on(lead):
                    break
                try:
                    ready = executor.adopt_plan(desired)
                    if ready is not None:
                        await executor.write_desired(ready, "plan ready")
                        desired = ready
                    observed = self._observe(executor, cache, readmits, desired)
                    await self._notices_from_status(observed.status, store, lead, cache)
                    actions = decide(desired, observed, self.decide_cfg)
                    self.decisions += 1
                    desired = await executor.apply(actions, desired)
                    self.desired = desired
                    await self.audit.durable()  # this pass's records, before the next acts
                    self.calibrator.note(desired)
                    self.calibrator.maybe_fit(
                        desired,
                        observed,
                        tasks,
                        store,
                        lead,
                        self.wake,
                        functools.partial(self._fenced, lead),
                    )
                    if executor.progressed:
                        self.wake(urgent=True)  # our own follow-up: debounced already
                except FencedError as exc:
                    self.audit.write(
                        "fenced", self.clock.now(), sync=True, epoch=lead.epoch, error=str(exc)
                    )
                    return
                except TemporaryError as exc:
                    _log.warning("reconcile_retry", error=str(exc))
                    await self.clock.sleep(exc.retry_after or 0.2)
                    self.wake(urgent=True)
            if not lead.held:
                self.audit.write("deposed", self.clock.now(), sync=True, epoch=lead.epoch)
        finally:
            await tasks.close()
            await cache.close()
            await readmits.close()
            await bus.close()

    def _fenced(self, lead: Leadership, exc: FencedError) -> None:
        """A guarded write outside the loop (online calibration's) was refused: deposed."""
        self.audit.write("fenced", self.clock.now(), sync=True, epoch=lead.epoch, error=str(exc))
        self._fenced_epoch = lead.epoch
        self.wake(urgent=True)

    async def _restore_calibration(self, store: EtcdStore, lead: Leadership) -> bool:
        """Read the kept online calibration back (retried through an etcd outage); False
        if the term ended meanwhile."""
        while self._term_goes_on(lead):
            try:
                await self.calibrator.restore(store, lead)
                return True
            except TemporaryError:
                self.sd.watchdog()
                await self.clock.sleep(0.2)
        return False

    def _term_goes_on(self, lead: Leadership) -> bool:
        return not self.stopping.is_set() and lead.held and self._fenced_epoch != lead.epoch

    async def _start_cache(self, start: Callable[[], Awaitable[None]]) -> bool:
        try:
            await start()
        except TemporaryError as exc:
            _log.warning("observed_read_retry", error=str(exc))
            self.sd.watchdog()
            return False
        return True

    async def _adopt(self, store: EtcdStore, ex: Executor, lead: Leadership) -> DesiredState | None:
        """Take over the previous leader's desired state under our epoch.

        None if it cannot be read (the controller then fails): starting from a blank state
        would restart generations at 0, and agents would reuse the run directories of
        generation 0 under a different plan, with the committed checkpoints forgotten.
        """
        while True:
            try:
                kv = await store.get(self.keys.desired)
                break
            except TemporaryError:
                self.sd.watchdog()
                await self.clock.sleep(0.2)
        prev = None
        if kv is not None:
            try:
                prev = DesiredState.model_validate_json(kv.value)
            except ValidationError as exc:
                self.fail(
                    "desired state unreadable: refusing to lead from a blank state",
                    epoch=lead.epoch,
                    key=kv.key,
                    mod_revision=kv.mod_revision,
                    error=str(exc).splitlines()[0][:300],
                )
                return None
        desired = (prev or DesiredState(epoch=lead.epoch)).model_copy(update={"epoch": lead.epoch})
        await ex.write_desired(desired, "took over" if prev else "first leader")
        self.desired = desired
        self.wake()
        return desired

    async def _sleep_until_woken(self, desired: DesiredState) -> None:
        timeout = self.cfg.resync_s
        if desired.phase_deadline:
            timeout = max(0.0, min(timeout, desired.phase_deadline - self.clock.now() + 0.01))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout)
        if not self._urgent and self.cfg.debounce_s:
            with contextlib.suppress(TimeoutError):  # an urgent wake-up ends the debounce
                await asyncio.wait_for(self._urgent_wake.wait(), self.cfg.debounce_s)
        self._urgent = False
        self._urgent_wake.clear()
        self._wake.clear()

    async def _check(self, cache: ObservedCache, readmits: PrefixMirror) -> None:
        """Every ``poll_s``: compare the mirrors with etcd (a stale one is re-read)."""
        while True:
            await self.clock.sleep(self.cfg.poll_s)
            if not all(await asyncio.gather(cache.check(), readmits.check())):
                self.wake()

    def _readmit_requests(self, mirror: PrefixMirror) -> dict[str, ReadmitRequest]:
        """The readmit requests in etcd, by request id; a malformed one is audited once
        (``record_rejected``) and left alone."""
        cut = len(mirror.prefix)
        kvs = mirror.items()
        out = {}
        for key in [k for k in self._readmit_seen if k not in kvs]:
            del self._readmit_seen[key]
        for key, kv in kvs.items():
            seen = self._readmit_seen.get(key)
            if seen is None or seen[0] != kv.value:
                try:
                    req: ReadmitRequest | None = ReadmitRequest.model_validate_json(kv.value)
                except ValidationError as exc:
                    req = None
                    self._reject(key, str(exc).splitlines()[0])
                seen = (kv.value, req)
                self._readmit_seen[key] = seen
            if seen[1] is not None and key[cut:]:
                out[key[cut:]] = seen[1]
        return out

    def _observe(
        self, ex: Executor, cache: ObservedCache, readmits: PrefixMirror, desired: DesiredState
    ) -> Observed:
        snap = cache.snapshot()
        if self._unseen_notices:
            now = self.clock.now()
            self._unseen_notices = {
                n: t
                for n, t in self._unseen_notices.items()
                if n not in snap.notices and now - t < 2.0  # bounded: never waits on a lost one
            }
        o = Observed(
            now=self.clock.now(),
            nodes=snap.nodes,
            status=snap.status,
            notices=snap.notices,
            commits=snap.commits,
            acked=ex.acked_view,
            recalibration=self.calibrator.note(desired),
            readmit=self._readmit_requests(readmits),
        )
        return replace(o, excluded=unusable(desired, o))  # as decide sees it

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

    def _node_gone(self, node_id: str) -> None:
        """A registration disappeared (lease lost or revoked): urgent if a layout used it."""
        if urgent_wake("node_left", node_id, self.desired):
            self.wake(urgent=True)

    def _reject(self, key: str, error: str) -> None:
        self.audit.write("record_rejected", self.clock.now(), key=key, error=error)

    async def _consume(
        self, bus: NatsEventBus, store: EtcdStore, lead: Leadership, cache: ObservedCache
    ) -> None:
        """Fetch a batch, handle each event, fsync the batch's records once, then ack it."""
        while True:
            if not lead.fresh:
                # cut off from etcd: a new leader may consume from the same durable consumer;
                # what this one took it could neither record nor hand on for a while
                await self.clock.sleep(0.3)
                continue
            try:
                await bus.ensure_stream()
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
                    self.audit.write(
                        "fenced", self.clock.now(), sync=True, epoch=lead.epoch, error=str(exc)
                    )
                    self._fenced_epoch = lead.epoch
                    self.wake(urgent=True)
                    return
            await self.audit.durable()
            for d in handled:
                try:
                    await d.ack()
                except TemporaryError as exc:  # redelivered, then handled as a duplicate
                    _log.warning("event_ack_failed", error=str(exc))

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
        self.audit.write(
            "event_rejected",
            now,
            epoch=lead.epoch,
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
            self.audit.write(
                "event_rejected",
                now,
                epoch=lead.epoch,
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
            self.audit.write(
                "event_duplicate", now, epoch=lead.epoch, event_id=ev.event_id, subject=subject
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
            self.audit.write(
                "event",
                now,
                epoch=lead.epoch,
                event_id=ev.event_id,
                event_kind=ev.kind,
                node_id=ev.node_id,
                subject=subject,
                latency_s=round(now - ev.time, 4),
                **extra,
            )
        self.wake(urgent=urgent_wake(ev.kind, ev.node_id, self.desired))
        return "accepted", ev.event_id


def freeze_startup_heap() -> None:
    """Collect, then exempt every object alive now from later garbage collections.

    What a controller process holds at start (modules, pydantic schemas, the planner's
    imports: ~80,000 objects) lives as long as the process, yet every full collection
    scanned it again: 9-12 full collections of ~70 ms each in a 512-node run of
    benchmarks/runtime_decision_latency.py, each one stalling the event loop. Called once
    by the daemon's entry point, which owns the process (not by ``Controller``, which tests
    and benchmarks run inside their own processes).
    """
    gc.collect()
    gc.freeze()


async def run_controller(config: ControllerConfig) -> int:
    """Run until SIGTERM/SIGINT, then resign leadership; the exit status (1: failed)."""
    freeze_startup_heap()
    ctl = Controller(config)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, ctl.stopping.set)
    runner = asyncio.create_task(ctl.run(), name="controller:run")
    stop = asyncio.create_task(ctl.stopping.wait(), name="controller:stop-signal")
    await asyncio.wait({runner, stop}, return_when=asyncio.FIRST_COMPLETED)
    ctl.wake()
    try:
        await asyncio.wait_for(runner, 10)
    except TimeoutError:
        pass
    except DaemonFailedError as exc:
        _log.error("controller_exit", error=str(exc))
    finally:
        stop.cancel()
    return 1 if ctl.failure is not None else 0
