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

Operators' readmit requests (``readmit/``, ``sailor node readmit``) and requests to clear
bad checkpoint marks (``clear-bad/``, ``sailor checkpoint clear-bad``) are mirrored like the
observed prefixes and handed to ``decide``, which forgets the records or marks they name;
the executor deletes each once the desired state without them is written.

Online calibration (``online_calibration.py``): each pass hands ``decide`` the calibrator's
verdict (if one says to reconfigure) and may start a fit of the agents' step timings; a new
leader reads the kept calibration back from etcd before its first pass.

Nothing fails in silence: a crash of any task of the term (the event consumer, the etcd
check, a command, a replan) or a desired state it cannot read on takeover takes the
controller down — a ``failed`` audit record, leadership resigned, ``run`` raises
``DaemonFailedError`` and the process exits non-zero (systemd restarts it). A controller
never leads from a blank state over one it could not read: generations stay monotone across
leaders. Must never import torch or the agent.

The event intake (validate, record, ack; which wake-ups are urgent: ``urgent_wake``) is
``event_intake.py``, mixed into ``Controller``; this module holds the term's loop.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import gc
import signal
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any, TypeVar

import structlog
import yaml
from pydantic import ValidationError

from sailor.controller.audit import ADOPTION_CAUSES, AuditLog
from sailor.controller.audit_budget import AuditBudget
from sailor.controller.config import ControllerConfig
from sailor.controller.decide import decide, exclusion, wanted_replan
from sailor.controller.decision_types import DecideConfig, Observed
from sailor.controller.event_intake import EventIntake, urgent_wake
from sailor.controller.executor import Executor
from sailor.controller.failing_nodes import upgraded
from sailor.controller.job_precision import job_precision
from sailor.controller.observed import ObservedCache
from sailor.controller.online_calibration import Calibrator
from sailor.controller.planning import (
    Planner,
    ProcessPlanner,
    load_model_spec,
    planner_from_config,
)
from sailor.controller.training import check_checkpoint_dirs, load_training
from sailor.coordination import (
    Clock,
    DaemonFailedError,
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
    unclustered_replicas,
)
from sailor.coordination.sd_notify import SystemdNotifier
from sailor.coordination.security import warn_if_unauthenticated
from sailor.planner.reach import PlannerReach
from sailor.schemas.model import ModelSpec
from sailor.schemas.runtime import ClearBadRequest, DesiredState, ReadmitRequest
from sailor.schemas.training import TrainingConfig

__all__ = ["Controller", "freeze_startup_heap", "run_controller"]

_log = structlog.get_logger("sailor.controller")

_R = TypeVar("_R", ReadmitRequest, ClearBadRequest)
_T = TypeVar("_T")


def _model_for_deadlines(config: ControllerConfig) -> ModelSpec | None:
    """The model spec that sizes the plans' phase deadlines (``deadlines.derive``), read at
    start like the planner's: None when derivation is off, or when the stand-in planner's
    model name is none the catalog or a file knows (its plans then get the configured
    deadlines, and the log says why). The sailor planner has read the same spec already:
    a broken model file stopped the controller there. A model file that is no YAML
    (``yaml.YAMLError``, no ValueError) is one the stand-in's plans do without, too: it
    stopped the controller's construction here, for a size it can do without."""
    if not config.deadlines.derive.enabled:
        return None
    try:
        return load_model_spec(config.model, config.global_batch_size)
    except (OSError, KeyError, ValueError, yaml.YAMLError) as exc:
        _log.warning("deadlines_not_derived", model=config.model, error=str(exc))
        return None


def _reach_of(planner: Planner) -> PlannerReach | None:
    """What ``planner`` can use (its ``reach``: the sailor planner's, in a thread or a
    process), read at start like its inputs; None for a planner that has none (the stand-in,
    a test's), which takes any node."""
    reach = getattr(planner, "reach", None)
    got = reach() if callable(reach) else None
    return got if isinstance(got, PlannerReach) else None


class Controller(EventIntake):
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
            checkpoint_every_s=config.checkpoint_every_s,
            notice_margin_s=config.notice_margin_s,
            stop_ahead_steps=config.stop_ahead_steps,
            in_place=config.in_place,
            base_port=config.base_port,
            training=self.training,
            exclusion=config.exclusion,
            model=_model_for_deadlines(config),
            planner_reach=_reach_of(self.planner),
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
        # audit records the events of each source may cause (a flooding node's are counted)
        self._audit_budget = AuditBudget()
        # Measurement hooks (benchmarks/runtime_burst.py): handled events by outcome, and an
        # optional observer called once per handled event with (event id or msg id, outcome,
        # received time, handled time). Bounded: a Counter of three keys; no per-event memory.
        self.event_counts: collections.Counter[str] = collections.Counter()
        self.on_event: Callable[[str, str, float, float], None] | None = None
        self.event_batches = 0  # fetched batches that held events (one fsync each)
        self.failure: str | None = None  # why this controller must exit non-zero
        self._fenced_epoch = -1  # a term the event consumer found fenced: it ends
        # operators' requests by key: (value, parsed or None), re-validated only on a change
        self._readmit_seen: dict[str, tuple[bytes, ReadmitRequest | None]] = {}
        self._clear_bad_seen: dict[str, tuple[bytes, ClearBadRequest | None]] = {}
        self._not_admitted: dict[str, str] = {}  # last audited (``_audit_admission``)

    def wake(self, urgent: bool = False) -> None:
        if urgent or self._unseen_notices:
            self._urgent = True
            self._urgent_wake.set()
        self._wake.set()

    async def run(self) -> None:
        sec = self.cfg.security
        warn_if_unauthenticated(sec, "controller", self.cfg.identity)
        store = await self._retry(lambda: connect_etcd(self.cfg.etcd_endpoints, security=sec))
        nc = await self._retry(
            lambda: connect_nats(self.cfg.nats_urls, self.cfg.identity, 5.0, sec)
        )
        if store is None or nc is None:
            return
        # the config checks that need no term, before campaigning: a standby with a config
        # no leader could run is refused now, not once it leads (maybe days later, when the
        # leader it would replace is lost)
        refused = unclustered_replicas(nc, self.cfg.event_stream_replicas)
        if refused is not None:
            self._stream_refused(refused, None)  # fails it: no campaign, closed below
        else:
            self.sd.ready("standby: connected to etcd and NATS")
        warm = (
            self.planner.warm_up()
            if isinstance(self.planner, ProcessPlanner) and refused is None
            else None
        )
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
            max_bytes=self.cfg.event_stream_max_bytes,
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
            decide_cfg=self.decide_cfg,
        )
        cache = ObservedCache(
            store, self.keys, self._reject, on_change=self.wake, on_node_gone=self._node_gone
        )
        readmits = PrefixMirror(store, self.keys.readmits, self.wake)
        clear_bads = PrefixMirror(store, self.keys.clear_bads, self.wake)
        try:
            adopted = await self._adopt(store, executor, lead)
            if adopted is None:
                return
            desired = adopted
            if not await self._restore_calibration(store, lead):
                return
            for start in (cache.start, readmits.start, clear_bads.start):
                while not await self._start_cache(start):
                    await self.clock.sleep(0.2)
                    if self.stopping.is_set() or not lead.held:
                        return
            self.leadership = lead  # public once it has a desired state to show
            tasks.spawn("events", self._consume(bus, store, lead, cache))
            tasks.spawn("etcd-check", self._check(cache, readmits, clear_bads))
            while self._term_goes_on(lead):
                self.sd.watchdog()
                await self._sleep_until_woken(desired)
                if not self._term_goes_on(lead):
                    break
                try:
                    if not executor.orphans_settled:  # takes an earlier term left unsettled
                        await executor.settle_orphan_marks()
                    ready = executor.replans.adopt(desired)
                    if ready is not None:  # a plan
                        await executor.write_desired(*ready)
                        desired = ready[0]
                    observed = self._observe(executor, cache, (readmits, clear_bads), desired)
                    # why the replan the job waits for failed, or no reason once it is another
                    wanted = wanted_replan(desired, observed, self.decide_cfg)
                    shown = executor.replans.failure_shown(desired, wanted)
                    if shown is not None:
                        await executor.write_desired(*shown)
                        desired = shown[0]
                    await self._notices_from_status(observed.status, store, lead, cache)
                    if self.calibrator.measured != self.decide_cfg.measured:  # deadlines
                        self.decide_cfg = self.decide_cfg.model_copy(
                            update={"measured": self.calibrator.measured}
                        )
                        executor.decide_cfg = self.decide_cfg
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
                    # the pass may have written some of its states (a readmit, then a write
                    # that failed), or one whose answer was lost (etcd restarted after the
                    # commit): the next pass decides from what etcd holds, not from the
                    # state this one started from (it wrote back the records a readmit
                    # had forgotten, the request's key gone)
                    reread = await self._reread(store, lead, desired)
                    if reread is None:
                        break
                    executor.settle_lost(reread)  # a state written whose answer was lost
                    await executor.settle_lost_takes()  # a request deleted, so
                    desired = self.desired = reread
                    self.wake(urgent=True)
            if not lead.held:
                self.audit.write("deposed", self.clock.now(), sync=True, epoch=lead.epoch)
        finally:
            await tasks.close()
            await cache.close()
            await readmits.close()
            await clear_bads.close()
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

    async def _retried(
        self, lead: Leadership, call: Callable[[], Awaitable[_T]]
    ) -> tuple[bool, _T | None]:
        """``call()`` tried again through ``TemporaryError`` (an etcd outage) every 0.2 s
        while the term goes on, the watchdog fed: (True, its result), or (False, None) once
        the term ended (stopping, the lease lost, fenced)."""
        while self._term_goes_on(lead):
            try:
                return True, await call()
            except TemporaryError:
                self.sd.watchdog()
                await self.clock.sleep(0.2)
        return False, None

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

        None if it cannot be read (the controller then fails: starting from a blank state
        would restart generations at 0, and agents would reuse the run directories of
        generation 0 under a different plan, with the committed checkpoints forgotten), or if
        the term ended while etcd did not take the takeover's write (a ``TemporaryError`` is
        retried: before, an etcd restart at the takeover ended the controller).
        """
        read, kv = await self._retried(lead, lambda: store.get(self.keys.desired))
        if not read:
            return None
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
        # an older leader's state becomes this release's (its lost nodes recorded)
        desired = (upgraded(prev) if prev else DesiredState(epoch=lead.epoch)).model_copy(
            update={"epoch": lead.epoch}
        )
        # an etcd restart at the takeover is waited out, as every write's
        # the audit checker takes this record's marks for all there are (ADOPTION_CAUSES)
        why = ADOPTION_CAUSES[0] if prev else ADOPTION_CAUSES[1]
        written, _ = await self._retried(lead, lambda: ex.write_desired(desired, why))
        if not written:
            return None
        self.desired = desired
        self.wake()
        return desired

    async def _reread(
        self, store: EtcdStore, lead: Leadership, desired: DesiredState
    ) -> DesiredState | None:
        """The desired state as etcd holds it, after a pass that ``TemporaryError`` cut
        short (retried through an etcd outage); ``desired``: what the pass started from.
        None if the term ended meanwhile, or the key is not this term's: another leader
        wrote it (this one's next write would be fenced), or it is gone or unreadable (the
        controller fails: a term that went on, or the next one, would lead from a blank
        state, generations from 0, as ``_adopt`` refuses to)."""
        read, kv = await self._retried(lead, lambda: store.get(self.keys.desired))
        if not read:
            return None
        try:
            got = DesiredState.model_validate_json(kv.value) if kv is not None else None
        except ValidationError as exc:
            self.fail(
                "desired state unreadable after an etcd error",
                epoch=lead.epoch,
                error=str(exc).splitlines()[0][:300],
            )
            return None
        if got is None:  # someone deleted it: a new term would start from a blank state
            self.fail("desired state gone after an etcd error", epoch=lead.epoch)
            return None
        if got.epoch != lead.epoch:
            self.audit.write(
                "fenced",
                self.clock.now(),
                sync=True,
                epoch=lead.epoch,
                error="the desired state is not this term's",
            )
            return None
        if got != desired:  # a write of the pass went through: its records are in etcd
            self.audit.write(
                "desired_reread",
                self.clock.now(),
                epoch=lead.epoch,
                generation=got.generation,
                phase=got.phase.value,
                cause=got.cause,
            )
        return got

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

    async def _check(self, cache: ObservedCache, *mirrors: PrefixMirror) -> None:
        """Every ``poll_s``: compare the mirrors with etcd (a stale one is re-read)."""
        while True:
            await self.clock.sleep(self.cfg.poll_s)
            if not all(await asyncio.gather(cache.check(), *(m.check() for m in mirrors))):
                self.wake()

    def _requests(
        self,
        mirror: PrefixMirror,
        kind: type[_R],
        seen_by_key: dict[str, tuple[bytes, _R | None]],
        withdrawn: dict[str, int],
    ) -> dict[str, _R]:
        """An operator's requests of ``kind`` in etcd (``mirror``), by request id; a
        malformed one is audited once (``record_rejected``) and left alone, and one a write
        found withdrawn (``withdrawn``: key -> revision seen) is left out while the mirror
        still shows it at that revision."""
        cut = len(mirror.prefix)
        kvs = mirror.items()
        out = {}
        for key in [k for k in seen_by_key if k not in kvs]:
            del seen_by_key[key]
        for key, kv in kvs.items():
            if key in withdrawn and withdrawn[key] == kv.mod_revision:
                continue
            seen = seen_by_key.get(key)
            if seen is None or seen[0] != kv.value:
                try:
                    req: _R | None = kind.model_validate_json(kv.value)
                except ValidationError as exc:
                    req = None
                    self._reject(key, str(exc).splitlines()[0])
                seen = (kv.value, req)
                seen_by_key[key] = seen
            if seen[1] is not None and key[cut:]:
                out[key[cut:]] = seen[1]
        return out

    def _observe(
        self,
        ex: Executor,
        cache: ObservedCache,
        requests: tuple[PrefixMirror, PrefixMirror],
        desired: DesiredState,
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
            acked=ex.sends.acked_view,
            refused=ex.sends.refused_view,
            recalibration=self.calibrator.note(desired),
            readmit=self._requests(requests[0], ReadmitRequest, self._readmit_seen, ex.withdrawn),
            clear_bad=self._requests(
                requests[1], ClearBadRequest, self._clear_bad_seen, ex.withdrawn
            ),
        )
        # what a pass that applies a request compares: taken only while it is as seen here
        ex.request_revisions = {
            key: kv.mod_revision for m in requests for key, kv in m.items().items()
        }
        # a withdrawn request's mark goes once the mirror no longer shows it so
        ex.withdrawn = {k: r for k, r in ex.withdrawn.items() if ex.request_revisions.get(k) == r}
        # once per pass: the nodes out as decide sees them, and those audited as not admitted
        cfg = self.decide_cfg
        excluded, refused = exclusion(
            desired, o, job_precision(desired, cfg.training), cfg.planner_reach
        )
        self._audit_admission(refused, o.now)
        return replace(o, excluded=excluded)

    def _audit_admission(self, refused: dict[str, str], now: float) -> None:
        """An audit record and a journal line each time the nodes left out for their runtime
        or the job's precision (``refused``: ``decide.exclusion``'s, node -> why) change."""
        if refused == self._not_admitted:
            return
        self._not_admitted = refused
        self.audit.write("not_admitted", now, nodes=refused)
        for node, why in sorted(refused.items()):
            _log.warning("node_not_admitted", node=node, why=why)

    def _node_gone(self, node_id: str) -> None:
        """A registration disappeared (lease lost or revoked): urgent if a layout used it."""
        if urgent_wake("node_left", node_id, self.desired):
            self.wake(urgent=True)

    def _reject(self, key: str, error: str) -> None:
        self.audit.write("record_rejected", self.clock.now(), key=key, error=error)


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
