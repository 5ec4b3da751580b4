"""``sailor agent``: one per node. Registration lease, commands, watchers, supervisor.

The agent first checks its node (the GPU checks of ``sailor check``, in a child process;
skipped on CPU nodes): a GPU node that fails them does not join (``check.mode: enforce``).
It then registers its node under an etcd lease kept alive in the background (a lease that
expires is a node that left), only where no other agent's lease holds the node's key (one
that stays held past a lease TTL is another live agent of this node id: it refuses to
start, naming both addresses), publishes join/leave events, serves commands on its own NATS
subject (refusing a lower epoch than the highest seen, applying each command id at most once,
replying with an ack), writes its status under its lease, and publishes a preemption notice
the moment a watcher sees one (retried until its deadline, and kept in the status record so
that it reaches the controller through etcd while NATS is down). SIGTERM: stop the workers,
publish NodeLeft, revoke the lease. The epoch fence is persisted (``fence.py``) and raised to
the desired state's epoch on start, so a restarted agent still refuses a deposed controller.
With ``cpu_quota`` set, the workers run in the node's cgroup under that quota (``cpu_quota.py``;
``set_cpu_quota`` changes it at run time; from exec, or from each worker's ``ready`` report
with ``cpu_quota_from='ready'``), and the cgroup is removed when the agent stops.
A long-lived task that crashes is restarted with backoff; one that keeps crashing takes the
agent down (``run`` raises ``DaemonFailedError``, the process exits non-zero and systemd
restarts it).
The agent's configuration is ``agent_config.py``; parts of :class:`Agent` live in modules of
their own: applying commands (``agent_commands.py``), the CPU quota (``agent_quota.py``), the
node check and the address it registers (``node_join.py``).
Must never import the controller.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import math
import os
import signal
import time
import uuid
from typing import Any

import structlog

from sailor.agent.agent_commands import AgentCommands
from sailor.agent.agent_config import AgentConfig
from sailor.agent.agent_quota import UNSEEN, AgentCpuQuota
from sailor.agent.cpu_quota import CpuQuota, QuotaState
from sailor.agent.fence import EpochFence
from sailor.agent.node_join import AgentNodeCheck, host_port, node_address, registered_node
from sailor.agent.plan_source import PlanSource, PlanUnavailableError
from sailor.agent.release import sailor_release
from sailor.agent.supervisor import Supervisor
from sailor.agent.teardown import boot_ticks, start_ticks
from sailor.agent.watchers import GCP_NOTICE_S, Notice, PreemptionWatcher, make_watcher
from sailor.coordination import (
    Clock,
    DaemonFailedError,
    EtcdLease,
    EtcdStore,
    EventTooLargeError,
    Keys,
    KeyValue,
    NatsCommands,
    NatsEventBus,
    PermanentError,
    SystemClock,
    TaskSet,
    TemporaryError,
    close_nats,
    connect_etcd,
    connect_nats,
    safe_token,
)
from sailor.coordination.names import check_node_id
from sailor.coordination.sd_notify import SystemdNotifier
from sailor.coordination.security import warn_if_unauthenticated
from sailor.megatron_patch.errors import culprit_of
from sailor.schemas.events import NodeJoined, NodeLeft, PreemptionNotice, WorkerFailed
from sailor.schemas.hardware import NodeSpec
from sailor.schemas.node_check import EndpointFacts, NodeFacts
from sailor.schemas.redact import redact_urls
from sailor.schemas.runtime import AgentStatus, CommandAck

__all__ = ["Agent", "process_age_s", "run_agent"]

_log = structlog.get_logger("sailor.agent")


TASK_BACKOFF_S = 0.5
"""First restart delay of a crashed long-lived task (doubling, capped at 30 s)."""
TASK_MAX_CRASHES = 5
"""Crashes in a row (none after a minute of running) after which the agent gives up."""
CLAIM_GRACE_S = 1.0
"""Beyond one lease TTL, how long an agent waits for another lease on its node's key to
lapse before it refuses to start (the holder's last refresh and etcd's expiry check lag)."""
RETRY_LOG_EVERY = 10
"""A connect or claim that keeps failing is logged on its first failure, then every tenth."""
PUBLISH_BACKOFF_MAX_S = 2.0
"""Longest pause between two tries of a notice's publish: a 30 s notice (GCP's) still gets
~12 tries, and one try soon after NATS is back (each try waits up to 2 s for the stream)."""


def _log_retry(event: str, tries: int, exc: Exception, **fields: object) -> None:
    """Log a failed try of ``tries`` so far: the first, then every
    :data:`RETRY_LOG_EVERY`-th (an agent that cannot reach a server says so, without a line
    every half second)."""
    if tries == 1 or tries % RETRY_LOG_EVERY == 0:
        _log.warning(event, tries=tries, error=str(exc)[:300], **fields)


class Agent(AgentCommands, AgentCpuQuota, AgentNodeCheck):
    """The agent of one node."""

    def __init__(self, config: AgentConfig, clock: Clock | None = None) -> None:
        self.cfg = config
        self.node = config.node
        # the fence file and the run directory are named by the node id: one that is not a
        # plain name (``..``, a ``/``) would put them outside work_dir. AgentConfig refuses
        # it; checked again here for a config copied with an update (not validated)
        check_node_id(self.node.node_id, "node.node_id")
        self.keys = Keys(job=config.job)
        self.clock = clock or SystemClock()
        self.stopping = asyncio.Event()
        self.sd = SystemdNotifier.from_env()
        # the highest epoch accepted: persisted, so that it outlives this process
        self._fence = EpochFence(config.work_dir / f"{self.node.node_id}.epoch")
        self.max_epoch = self._fence.epoch
        self.failure: str | None = None  # why this agent must exit non-zero
        self.applied: collections.OrderedDict[str, CommandAck] = collections.OrderedDict()
        self.supervisor = Supervisor(
            config.work_dir / self.node.node_id,
            config.worker_argv,
            warm_spares=config.warm_spares,
            teardown_timeout_s=config.teardown_timeout_s,
        )
        self.watchers: list[PreemptionWatcher] = [
            make_watcher(w.kind, w.target, self.clock) for w in config.watchers
        ]
        self.noticed = False
        self.notice: PreemptionNotice | None = None  # also in the status record (etcd path)
        self._lease: EtcdLease | None = None
        self._store: EtcdStore | None = None
        self._bus: NatsEventBus | None = None
        self._tasks = TaskSet(f"agent-{self.node.node_id}", on_crash=self._task_crashed)
        self._failure_reported = ""
        self._lock = asyncio.Lock()
        self._closing = False  # shutting down or crashed: commands are refused
        self._crashed = False
        self.held_elsewhere = False  # another agent's lease holds this node's key
        self.token_clash = ""  # another registered node id shares our NATS token: why
        self._plans = PlanSource(self._read_desired)
        self.facts: NodeFacts | None = None
        self.refused = ""
        self.quota: CpuQuota | None = None  # the workers' CPU quota (cpu_quota.py), if any
        self._quota_seen: QuotaState | object = UNSEEN  # as of the last status write

    async def run(self) -> None:
        if self.cfg.cpu_quota is not None:
            self.quota = await asyncio.to_thread(
                CpuQuota.start,
                self.cfg.job,
                self.node.node_id,
                self.cfg.cpu_quota,
                period_us=self.cfg.cpu_quota_period_us,
            )
            self._attach_workers()
        try:
            await self._run()
        finally:  # the workers are gone (stopped in _shutdown, or never started)
            if self.quota is not None:
                await asyncio.to_thread(self.quota.close)

    async def _run(self) -> None:
        # a killed rank its previous incarnation left behind holds its GPU still: it gets the
        # SIGKILL it is owed first (no etcd, no NATS needed; the node check's own processes
        # would meet it on the GPU), and no rank starts on top of it (the failure says so)
        await self.supervisor.restore_killed()
        check = asyncio.create_task(self.check_node(), name=f"agent-{self.node.node_id}-check")
        stop = asyncio.create_task(self.stopping.wait(), name=f"agent-{self.node.node_id}-stop")
        await asyncio.wait({check, stop}, return_when=asyncio.FIRST_COMPLETED)
        for t in (check, stop):  # SIGTERM during the check: stop it (its child is killed)
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t
        facts = check.result() if not check.cancelled() else None
        if facts is None:
            return
        # its torch build, NCCL version and the release its workers run
        self.node = registered_node(self.node, facts, sailor_release())
        sec = self.cfg.security
        warn_if_unauthenticated(sec, "agent", self.node.node_id)
        t0 = time.monotonic()
        store = await self._retry(
            "etcd", lambda: connect_etcd(self.cfg.etcd_endpoints, security=sec)
        )
        t1 = time.monotonic()
        nc = await self._retry(
            "nats", lambda: connect_nats(self.cfg.nats_urls, self.node.node_id, security=sec)
        )
        if store is None or nc is None:
            return
        tls = sec is not None
        self.facts = facts.model_copy(
            update={  # the agent's own connections are the reachability facts of its join
                "cpu_quota": self.cpu_quota(),
                "etcd": EndpointFacts(
                    url=",".join(self.cfg.etcd_endpoints), reachable=True, tls=tls, seconds=t1 - t0
                ),
                "nats": EndpointFacts(
                    url=redact_urls(self.cfg.nats_urls),  # facts travel: no password
                    reachable=True,
                    tls=tls,
                    seconds=time.monotonic() - t1,
                ),
            }
        )
        if not self.node.address:
            # the rendezvous of a plan whose rank 0 is here listens on this address: without
            # one the controller could only name 127.0.0.1, which other nodes cannot reach
            servers = [*self.cfg.etcd_endpoints, *(host_port(u) for u in self.cfg.nats_urls)]
            found = await asyncio.to_thread(node_address, servers)
            if found:
                self.node = self.node.model_copy(update={"address": found})
                _log.info("node_address_detected", address=found)
            else:
                _log.warning("node_address_unknown", node=self.node.node_id)
        self._store = store
        self._bus = NatsEventBus(nc, self.keys, durable="unused", source=self.node.node_id)
        commands = NatsCommands(nc, self.keys)
        try:
            await self._fence_from_desired()
            # another agent of this node id: refused before serving its command subject.
            # The claim itself comes first (a read of the key did: two agents that started
            # together both found it free and served commands until the loser's claim)
            t2 = time.monotonic()
            if await self._until_free(self._claim_key) and await self._token_own(stop=True):
                _log.info(
                    "node_registered",
                    node=self.node.node_id,
                    process_age_s=process_age_s(),
                    etcd_s=round(t1 - t0, 2),
                    nats_s=round(t2 - t1, 2),
                    claim_s=round(time.monotonic() - t2, 2),
                )
                await self._serve(commands)
        finally:
            if self.stopping.is_set():
                self.sd.stopping()
            await self._shutdown(store, nc, commands)
        if self.failure is not None:
            raise DaemonFailedError("agent failed", reason=self.failure)

    async def _serve(self, commands: NatsCommands) -> None:
        """Registered: serve commands, announce the join, keep the long-lived tasks until
        the stop. A command the controller sends between the registration and the
        subscription finds no responder and is sent again (its loop is level-triggered)."""
        await commands.serve(self.node.node_id, self._on_command)
        if not self.supervisor.kill_under_way:  # else once the restored kill is over
            await self.supervisor.top_up_spares()
        await self._announce()
        self.sd.ready(f"registered node {self.node.node_id}")
        self._keep("status", self._status_loop)
        self._keep("registration", self._registration_loop)
        for w in self.watchers:
            self._keep(f"watch-{w.name}", lambda w=w: self._watch(w))
        await self.stopping.wait()
        await self._drain_if_preempted()

    def _keep(self, name: str, factory: Any) -> None:
        """A long-lived task: restarted with backoff, the agent's end if it keeps crashing."""
        self._tasks.keep(name, factory, backoff_s=TASK_BACKOFF_S, max_crashes=TASK_MAX_CRASHES)

    def _task_crashed(self, name: str, exc: BaseException) -> None:
        self.failure = self.failure or f"task {name} kept crashing: {exc!r}"[:500]
        _log.error("agent_failed", node=self.node.node_id, reason=self.failure)
        self.sd.status(f"failed: {self.failure}"[:200])
        self.stopping.set()

    async def _fence_from_desired(self) -> None:
        """Raise the fence to the epoch of the desired state (its newest writer's) before
        serving commands: a fence file lost with the run directory is covered too."""
        while not self.stopping.is_set():
            try:
                kv = await self._read_desired()
                break
            except TemporaryError:
                await self.clock.sleep(0.3)
        else:
            return
        epoch: Any = 0
        if kv is not None:
            try:
                epoch = json.loads(kv.value)["epoch"]
            except (ValueError, KeyError, TypeError, RecursionError):
                return  # not ours to judge: the controller refuses an unreadable desired state
        if not isinstance(epoch, int):
            return
        await self._fence_within_etcd(epoch)
        if epoch > self.max_epoch:
            await asyncio.to_thread(self._fence.raise_to, epoch)
            self.max_epoch = epoch

    async def _fence_within_etcd(self, desired_epoch: int) -> None:
        """A fence beyond etcd's current revision was raised to an epoch no leader held
        (see ``fence.py``): lowered to the desired state's epoch, on record."""
        if self._store is None or self.max_epoch == 0:
            return
        try:
            revision = await self._store.revision()
        except TemporaryError:
            return  # kept as it is; the next start looks again
        was = self.max_epoch
        to = max(0, min(desired_epoch, revision))
        if await asyncio.to_thread(self._fence.lower_to, to, revision):
            self.max_epoch = self._fence.epoch
            _log.warning(
                "fence_lowered",
                node=self.node.node_id,
                was=was,
                to=self.max_epoch,
                etcd_revision=revision,
            )

    async def _retry(self, server: str, make: Any) -> Any:
        """``make()`` (a connect to ``server``) until it succeeds, 0.5 s apart; None on stop.
        Each failure is logged (the first, then every tenth): an agent that cannot reach a
        server says so, where it waited without a word (a joining node "never registered"
        left a log of one line)."""
        tries = 0
        t0 = time.monotonic()
        while not self.stopping.is_set():
            try:
                return await make()
            except TemporaryError as exc:
                tries += 1
                _log_retry(
                    "connect_retry",
                    tries,
                    exc,
                    node=self.node.node_id,
                    server=server,
                    waited_s=round(time.monotonic() - t0, 1),
                )
                await self.clock.sleep(0.5)
        return None

    async def _publish(self, kind: str, event: Any, until: float | None = None) -> bool:
        """Publish ``event``; True once JetStream stored it.

        Without ``until``: 20 tries 0.25 s apart. With it (a Unix time): keep trying, with
        backoff up to ``PUBLISH_BACKOFF_MAX_S``, until that time has passed (one try at least,
        even when it has passed already). One message id
        for every try, so a publish that reached the stream before its ack was lost is
        stored once (the stream's duplicate window, 2 min, outlasts any notice we retry).
        """
        assert_bus = self._bus
        if assert_bus is None:
            return False
        pause, tries = 0.25, 0
        while (tries < 20) if until is None else (tries == 0 or self.clock.now() < until):
            tries += 1
            try:
                await assert_bus.publish(kind, event.model_dump_json().encode(), event.event_id)
                return True
            except EventTooLargeError:  # refused for good (logged by the bus, once)
                return False
            except TemporaryError as exc:
                if until is not None:
                    _log.warning("event_publish_retry", kind=kind, tries=tries, error=str(exc))
                await self.clock.sleep(pause)
                if until is not None:
                    pause = min(pause * 2, PUBLISH_BACKOFF_MAX_S)
        _log.warning("event_not_published", kind=kind, event_id=event.event_id, tries=tries)
        return False

    def _event_id(self, kind: str) -> str:
        return f"{self.node.node_id}-{kind}-{uuid.uuid4().hex[:12]}"

    async def _claim_key(self) -> KeyValue | None:
        """Write this node's record under our lease (granted now if we hold none alive),
        unless another lease holds the key: then its record."""
        if self._store is None:
            raise TemporaryError("not connected to etcd")
        if self._lease is None or not self._lease.alive:
            self._lease = await self._store.lease(self.cfg.lease_ttl_s)
        return await self._store.claim(
            self.keys.node(self.node.node_id), self.node.model_dump_json().encode(), self._lease
        )

    async def _until_free(self, attempt: Any) -> bool:
        """Run ``attempt`` (``_claim_key``) until it finds the key free; False when another
        lease still holds it past that lease's own TTL (and ``CLAIM_GRACE_S``) from when it
        was first seen, or on stop. An agent that crashed leaves its record until its lease
        lapses; a live one keeps it refreshed: two agents must not share a node id (the
        second took the first's key over, and took it away when it stopped). The wait is the
        TTL etcd *granted* the holder's lease, read from etcd: etcd raises every lease to its
        minimum TTL (1.5 election timeouts, 8 s on WAN settings), so the configured
        ``lease_ttl_s`` was too short, and an agent restarted after a crash refused itself.
        A lease still there past its granted TTL was refreshed since: a live holder. An etcd
        that was unreachable starts the wait over: etcd extends every lease when it comes
        back. A key written without a lease (lease 0: an operator's ``etcdctl put``) never
        lapses: it is held as by a live holder, refused after the configured TTL (and the
        grace) with what to do. A holder whose lease keeps reading as gone while the key
        stays (etcd answering oddly) is retried no longer than that either."""
        deadline: float | None = None
        watched = 0  # the holder's lease the deadline is of
        lapsed: float | None = None  # since when its lease reads as gone but the key stays
        failed = 0  # attempts etcd failed (logged as _retry logs them)
        while not self.stopping.is_set():
            try:
                held = await attempt()
                ttl = None if held is None else await self._lease_ttl(held.lease)
            except TemporaryError as exc:
                failed += 1
                _log_retry("node_claim_retry", failed, exc, node=self.node.node_id)
                deadline = lapsed = None
                await self.clock.sleep(0.3)
                continue
            if held is None:
                return True
            now = self.clock.now()
            if ttl is None:  # its lease lapsed between the two reads: claim again
                if lapsed is None:
                    lapsed = now
                    _log.warning("node_key_lease_gone", node=self.node.node_id, lease=held.lease)
                elif now - lapsed >= self.cfg.lease_ttl_s + CLAIM_GRACE_S:
                    self._refuse_held(held, self.cfg.lease_ttl_s)
                    return False
                await self.clock.sleep(0.05)
                continue
            lapsed = None
            if deadline is None or held.lease != watched:
                remaining, granted = ttl
                watched = held.lease
                deadline = now + max(granted, remaining) + CLAIM_GRACE_S
                _log.warning(
                    "node_key_held",
                    node=self.node.node_id,
                    lease=held.lease,
                    address=_address_of(held.value),
                    lease_ttl_s=granted,
                    remaining_s=remaining,
                    wait_s=deadline - now,
                )
            elif now >= deadline:
                self._refuse_held(held, ttl[1])
                return False
            await self.clock.sleep(0.3)
        return False

    async def _lease_ttl(self, lease_id: int) -> tuple[int, int] | None:
        """(remaining, granted) of the holder's lease; where etcd's RBAC does not let this
        agent read it, the configured TTL stands in for both (the wait of before), as for a
        key written without a lease (lease 0, which never lapses)."""
        if self._store is None:
            raise TemporaryError("not connected to etcd")
        if lease_id == 0:
            return self.cfg.lease_ttl_s, self.cfg.lease_ttl_s
        try:
            return await self._store.lease_ttl(lease_id)
        except PermanentError as exc:
            _log.warning("lease_ttl_unreadable", lease=lease_id, error=str(exc)[:300])
            return self.cfg.lease_ttl_s, self.cfg.lease_ttl_s

    def _refuse_held(self, held: KeyValue, ttl_s: int) -> None:
        theirs = _address_of(held.value) or "no address"
        ours = self.node.address or "no address"
        self.held_elsewhere = True
        key = self.keys.node(self.node.node_id)
        if held.lease == 0:
            self.failure = (
                f"node id {self.node.node_id!r}: its key {key} was written without a lease "
                f"(lease 0, at {theirs}; an operator's etcdctl put?), so it never lapses; "
                f"still there after {ttl_s} s and {CLAIM_GRACE_S:g} s more; this agent (at "
                f"{ours}) does not start; delete the key (etcdctl del {key}) and start it again"
            )
        else:
            self.failure = (
                f"node id {self.node.node_id!r} is registered by another agent (at {theirs}, "
                f"lease {held.lease:x}) that keeps its lease refreshed: it did not lapse "
                f"within its TTL of {ttl_s} s and {CLAIM_GRACE_S:g} s more; this agent (at "
                f"{ours}) does not start; give every agent a node id of its own"
            )
        _log.error("node_id_in_use", node=self.node.node_id, theirs=theirs, ours=ours)
        self.sd.status(f"failed: {self.failure}"[:200])
        self.stopping.set()

    async def _register(self) -> bool:
        """Register under a lease of our own, where no other agent's lease holds the key
        (``_until_free``); then announce the join. False: refused, or stopped."""
        if not await self._until_free(self._claim_key):
            return False
        await self._token_own(stop=False)
        await self._announce()
        return True

    async def _token_own(self, stop: bool) -> bool:
        """Whether no other registered node id shares this one's NATS token (``safe_token``:
        ``gpu.1`` and ``gpu_1`` share every subject, and each agent answers the other's
        commands: which reply reaches the controller is a race). Checked once registered
        (two that register together both see the other and both refuse). A clash at the
        start (``stop``) refuses to start, naming both; one found at a re-registration is
        logged only: this agent's workers may be training, and the controller admits only
        one of the pair. For a deployment without ``security:``: with it, etcd's RBAC does
        not let an agent list the nodes (the check is skipped), and ``certs issue`` refuses
        clashing logins (certificates issued before that check: the controller's admission
        still leaves the pair out)."""
        if self._store is None:
            raise TemporaryError("not connected to etcd")
        mine = safe_token(self.node.node_id)
        while not self.stopping.is_set():
            try:
                records = await self._store.get_prefix(self.keys.nodes)
                break
            except TemporaryError:
                await self.clock.sleep(0.3)
            except PermanentError as exc:
                # etcd's RBAC (``security:``) lets an agent read its own node's keys only:
                # there its login was clash-checked when its certificate was issued, and the
                # controller's admission refuses a pair all the same
                _log.info("node_token_unchecked", node=self.node.node_id, error=str(exc)[:200])
                return True
        else:
            return False
        others = sorted(
            node
            for kv in records
            if (node := kv.key[len(self.keys.nodes) :]) != self.node.node_id
            and safe_token(node) == mine
        )
        if not others:
            return True
        why = (
            f"node id {self.node.node_id!r} shares its NATS token {mine!r} with registered "
            f"node {', '.join(repr(o) for o in others)}: NATS cannot tell their commands and "
            "events apart; give every agent a node id that differs in more than '.' and '_'"
        )
        _log.error("node_token_clash", node=self.node.node_id, others=others, stop=stop)
        if stop:
            self.token_clash = why
            self.failure = why
            self.sd.status(f"failed: {why}"[:200])
            self.stopping.set()
        return False

    async def _announce(self) -> None:
        """Publish this node's join (its spec and facts)."""
        await self._publish(
            "node_joined",
            NodeJoined(
                event_id=self._event_id("join"),
                node_id=self.node.node_id,
                time=self.clock.now(),
                node=self.node,
                facts=self.facts,
            ),
        )

    async def _registration_loop(self) -> None:
        while True:
            await self.clock.sleep(0.5)
            if self._lease is not None and not self._lease.alive and not self.stopping.is_set():
                _log.warning("registration_lost", node=self.node.node_id)
                await self._register()

    def status(self) -> AgentStatus:
        sup = self.supervisor
        state = sup.state if sup.state != "starting" else "idle"
        failed_step, save_failure = sup.save_failed
        return AgentStatus(
            node_id=self.node.node_id,
            epoch=self.max_epoch,
            generation=sup.generation,
            plan_id=sup.plan_id,
            state=state,
            step=sup.step,
            loss=sup.loss,
            start_step=sup.start_step,
            saved_step=sup.saved_step,
            save_failed_step=failed_step,
            save_failure=save_failure,
            failure=(sup.failure or sup.held_failure)[:4000],
            culprit=culprit_of(sup.failure) if sup.failure else sup.held_culprit,
            held_step=sup.held_step if state == "held" else -1,
            killing=sup.killing,
            spares=sup.spares_ready,
            spares_wanted=sup.spares_wanted,
            notice=self.notice,
            cpu_quota=self.cpu_quota(),
            time=self.clock.now(),
            timings=sup.timings() if state == "running" else (),
        )

    async def _status_loop(self) -> None:
        last = b""
        while True:
            self.sd.watchdog()  # the status loop is the agent's pulse; no ping: systemd restarts
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.supervisor.changed.wait(), self.cfg.status_interval_s)
            self.supervisor.changed.clear()
            self._follow_quota()
            st = self.status()
            body = st.model_dump_json(exclude={"time"}).encode()
            if body != last and self._store is not None and self._lease is not None:
                try:
                    await self._store.put(
                        self.keys.status(self.node.node_id),
                        st.model_dump_json().encode(),
                        lease=self._lease,
                    )
                    last = body
                except TemporaryError:
                    pass
            if st.failure and st.failure != self._failure_reported:
                self._failure_reported = st.failure
                event = self._failure_event(st)
                # on a task of its own: its retries through a NATS outage (~45 s) must not
                # stop this loop, the agent's watchdog ping and its status in etcd (the
                # failure reaches the controller there too)
                self._tasks.spawn("worker-failed", self._publish("worker_failed", event))
            await self.clock.sleep(self.cfg.status_interval_s / 4)

    def _failure_event(self, st: AgentStatus) -> WorkerFailed:
        """The ``worker_failed`` event of the failure ``st`` reports, with the rank its
        record names as guilty (``culprit``; -1: none, or a value that is no rank): the
        controller charges that rank's node, not this one."""
        return WorkerFailed(
            event_id=self._event_id("fail"),
            node_id=self.node.node_id,
            time=self.clock.now(),
            plan_id=st.plan_id,
            cause=st.failure[:4000],
            culprit=st.culprit,
        )

    async def _watch(self, watcher: PreemptionWatcher) -> None:
        while not self.noticed:
            notice = await watcher.check()
            if notice is not None:
                await self._noticed(notice)
                return
            await self.clock.sleep(self.cfg.watch_poll_s)

    async def _noticed(self, notice: Notice) -> None:
        """Report a preemption notice (once)."""
        event = self._record_notice(notice)
        if event is not None:
            await self._publish("preemption_notice", event, until=event.deadline)

    def _record_notice(self, notice: Notice) -> PreemptionNotice | None:
        """Keep a notice for the status record; the event to publish (None: one was
        already reported)."""
        if self.noticed:
            return None
        deadline = notice.deadline
        if not (math.isfinite(deadline) and deadline >= 0):
            # the notice is real (its source said so), its time is not: GCP's 30 s. Before, a
            # negative one (a notice file's ``{"in_s": -100}``, a cloud's date before 1970)
            # failed the event's validation after ``noticed`` was set: the notice was lost
            _log.warning(
                "notice_deadline_unusable",
                node=self.node.node_id,
                source=notice.source,
                deadline=repr(deadline),
                why=f"not a Unix time >= 0: the default of {GCP_NOTICE_S:g} s from now is taken",
            )
            deadline = self.clock.now() + GCP_NOTICE_S
        self.noticed = True
        event = PreemptionNotice(
            event_id=self._event_id("notice"),
            node_id=self.node.node_id,
            time=self.clock.now(),
            deadline=deadline,
            source=notice.source[:64],
        )
        # Two paths to the controller: the status record in etcd (written by the status
        # loop, which wakes now) and the event, retried until the deadline. Either one
        # alone is enough, so a NATS outage does not lose the notice.
        self.notice = event
        self.supervisor.changed.set()
        return event

    async def _drain_if_preempted(self) -> None:
        """Stopping with live workers: if this is a preemption (a notice already seen, or
        one the watchers report now: on GCP the ACPI shutdown that stops the agent *is*
        the notice, and a poll may not have seen it yet), report it and keep serving the
        controller until it has checkpointed and stopped the workers, the notice's deadline
        or ``preemption_drain_s``, whichever comes first. Otherwise stop at once."""
        limit = self.cfg.preemption_drain_s
        if limit <= 0 or self.failure is not None or not self.supervisor.live_workers():
            return
        if self.notice is None:
            for w in self.watchers:
                try:
                    notice = await asyncio.wait_for(w.check(), timeout=2.0)
                except (TimeoutError, OSError):
                    continue
                event = self._record_notice(notice) if notice is not None else None
                if event is not None:
                    self._tasks.spawn(
                        "notice-at-stop",
                        self._publish("preemption_notice", event, until=event.deadline),
                    )
                    break
        if self.notice is None:
            return
        end = min(self.clock.now() + limit, self.notice.deadline)
        _log.info("preemption_drain", node=self.node.node_id, until=end)
        while self.clock.now() < end and not await self._layout_moved_on():
            await self.clock.sleep(0.2)

    async def _layout_moved_on(self) -> bool:
        """Whether the controller's layout no longer uses this node (its checkpoint is
        committed and the next generation launched without it). Workers that stopped and
        saved are not enough: the controller records the commit after that."""
        try:
            d = await self._plans.desired()
        except (TemporaryError, PlanUnavailableError):
            return False
        return d is not None and self.node.node_id not in d.placement

    async def _read_desired(self) -> KeyValue | None:
        if self._store is None:
            raise PlanUnavailableError("not connected to etcd")
        return await self._store.get(self.keys.desired)

    async def _shutdown(self, store: EtcdStore, nc: Any, commands: NatsCommands) -> None:
        await self._tasks.close()
        await self._close_supervisor()
        if self._crashed or self.held_elsewhere or self.token_clash:
            # held elsewhere: the node is the other agent's, which has not left; a token
            # clash: never announced (the revoke takes the record away)
            if self._lease is not None:
                await self._lease.revoke()  # ours holds nothing
            await commands.close()
            await store.close()
            await close_nats(nc, 3)
            return
        await self._publish(
            "node_left",
            NodeLeft(
                event_id=self._event_id("leave"),
                node_id=self.node.node_id,
                time=self.clock.now(),
                reason="shutdown",
            ),
        )
        if self._lease is not None:
            await self._lease.revoke()
        await commands.close()
        await store.close()
        await close_nats(nc, 3)

    async def crash(self) -> None:
        """Testing: vanish without notice (no leave event, lease left to expire). The CPU
        quota's cgroup is removed as on a stop: local housekeeping nobody else sees."""
        self._crashed = True
        await self._tasks.close()
        await self._close_supervisor()
        if self.quota is not None:
            await asyncio.to_thread(self.quota.close)
        if self._lease is not None:
            await self._lease.stop_keepalive()
        self._lease = None


async def run_agent(config: AgentConfig) -> int:
    """Run until SIGTERM/SIGINT (a preemption looks like this too), then leave cleanly.
    Returns the exit status: 1 when the node check refused to join or the agent failed."""
    agent = Agent(config)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, agent.stopping.set)
    try:
        await agent.run()
    except DaemonFailedError as exc:
        _log.error("agent_exit", error=str(exc))
        return 1
    return 1 if agent.refused else 0


def process_age_s() -> float | None:
    """Seconds since this process started (its interpreter's start and imports included:
    on a loaded 2-core host most of an agent's time to register); None where ``/proc`` has
    no answer."""
    started = start_ticks()
    if started is None:
        return None
    return round((boot_ticks() - started) / os.sysconf("SC_CLK_TCK"), 2)


def _address_of(raw: bytes) -> str:
    """The address a node record names ("" when it names none or is not one)."""
    try:
        return NodeSpec.model_validate_json(raw).address
    except ValueError:
        return ""
