"""``sailor agent``: one per node. Registration lease, commands, watchers, supervisor.

The agent first checks its node (the GPU checks of ``sailor check``, in a child process;
skipped on CPU nodes): a GPU node that fails them does not join (``check.mode: enforce``).
It then registers its node under an etcd lease kept alive in the background (a lease that
expires is a node that left), publishes join/leave events, serves commands on its own NATS
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
Must never import the controller.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ipaddress
import json
import signal
import socket
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import structlog
from pydantic import Field, ValidationError, model_validator

from sailor.agent.cgroup_layout import CFS_PERIOD_US, MIN_QUOTA_US, validate_cores
from sailor.agent.check_gather import gather_gpu_subprocess, node_facts
from sailor.agent.check_verdicts import judge
from sailor.agent.cpu_quota import CpuQuota, QuotaState
from sailor.agent.fence import EpochFence
from sailor.agent.plan_source import PlanSource, PlanUnavailableError
from sailor.agent.supervisor import (
    DEFAULT_WORKER_ARGV,
    TEARDOWN_TIMEOUT_S,
    Supervisor,
    SupervisorClosedError,
    WorkerTeardownError,
)
from sailor.agent.watchers import Notice, PreemptionWatcher, make_watcher
from sailor.coordination import (
    Clock,
    DaemonFailedError,
    EtcdLease,
    EtcdStore,
    Keys,
    KeyValue,
    NatsCommands,
    NatsEventBus,
    SystemClock,
    TaskSet,
    TemporaryError,
    close_nats,
    connect_etcd,
    connect_nats,
)
from sailor.coordination.endpoints import ServerEndpoints
from sailor.coordination.sd_notify import SystemdNotifier
from sailor.coordination.security import SecurityConfig
from sailor.schemas._base import Frozen
from sailor.schemas.commands import Abort, Checkpoint, CommandAdapter, Launch, Stop
from sailor.schemas.device_kind import is_cpu_type
from sailor.schemas.events import NodeJoined, NodeLeft, PreemptionNotice, WorkerFailed
from sailor.schemas.hardware import NodeSpec
from sailor.schemas.node_check import EndpointFacts, NodeFacts
from sailor.schemas.runtime import AgentStatus, CommandAck

__all__ = ["Agent", "AgentConfig", "CheckSettings", "WatcherConfig", "run_agent"]

_log = structlog.get_logger("sailor.agent")
_UNSEEN = object()
"""No quota read yet (the first reading is no change)."""

TASK_BACKOFF_S = 0.5
"""First restart delay of a crashed long-lived task (doubling, capped at 30 s)."""
TASK_MAX_CRASHES = 5
"""Crashes in a row (none after a minute of running) after which the agent gives up."""
PUBLISH_BACKOFF_MAX_S = 2.0
"""Longest pause between two tries of a notice's publish: a 30 s notice (GCP's) still gets
~12 tries, and one try soon after NATS is back (each try waits up to 2 s for the stream)."""


def node_address(endpoints: Sequence[str], probe: Callable[[str], str] | None = None) -> str:
    """The address this node registers when its configuration gives none: the local address
    of the route to each server endpoint (``host:port``), the first that is not loopback;
    a loopback one only when every server is on this host (a one-machine cluster, where it is
    right); '' when none is found."""
    found = [(probe or route_address)(e) for e in endpoints]
    for addr in found:
        if addr and not ipaddress.ip_address(addr).is_loopback:
            return addr
    return next((a for a in found if a), "")


def _host_port(url: str) -> str:
    """``host:port`` of a NATS URL (``nats://host:port``)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    return f"[{host}]:{parts.port or 4222}" if ":" in host else f"{host}:{parts.port or 4222}"


def route_address(endpoint: str) -> str:
    """The local address this host reaches ``endpoint`` (``host:port``) from: the one its
    peers on that network reach it at. No packet is sent (a UDP socket's connect only picks
    the route); '' when it cannot be found."""
    host, _, port = endpoint.rpartition(":")
    host = host.strip("[]")
    try:
        infos = socket.getaddrinfo(host, int(port or 0), type=socket.SOCK_DGRAM)
        family, _, _, _, addr = infos[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            return str(s.getsockname()[0])
    except (OSError, ValueError, IndexError):
        return ""


class WatcherConfig(Frozen):
    kind: str = Field(description="gcp, aws, azure or file.")
    target: str = Field(description="Metadata base URL, or a path for 'file'.")


class CheckSettings(Frozen):
    """The node check the agent runs before it joins (``sailor check``, docs/operations.md)."""

    mode: Literal["enforce", "report", "off"] = Field(
        default="enforce",
        description="enforce: a GPU node that fails the check does not join; report: it joins "
        "and logs the failures; off: no GPU checks (toy trainers standing in for GPUs on a CPU "
        "host). CPU nodes (gpu_type cpu or cpu-<kind>) skip the GPU checks in every mode.",
    )
    probe: bool = Field(default=True, description="Run the one-node NCCL collective probe.")
    timeout_s: float = Field(
        default=300.0, gt=0, description="Deadline of the GPU checks, probe included, s."
    )


class AgentConfig(ServerEndpoints):
    """Everything ``sailor agent`` needs."""

    job: str = Field(default="default", min_length=1, max_length=64, description="Job name.")
    node: NodeSpec = Field(description="This node (GPU type and count, zone, spot, address).")
    lease_ttl_s: int = Field(default=2, ge=1, description="Registration lease TTL.")
    work_dir: Path = Field(default=Path("sailor-agent"), description="Run files of workers.")
    worker_argv: tuple[str, ...] = Field(
        default=DEFAULT_WORKER_ARGV, description="Worker command template (see supervisor)."
    )
    warm_spares: int = Field(
        default=0,
        ge=0,
        le=64,
        description="Worker processes kept started and waiting (torch imported, nothing "
        "built) for in-place launches: a joining node's or a new rank's start-up then stays "
        "out of the reconfiguration's downtime; the controller counts a joined node once its "
        "spares are up (ControllerConfig.in_place). 0: none.",
    )
    teardown_timeout_s: float = Field(
        default=TEARDOWN_TIMEOUT_S,
        gt=0,
        description="After SIGKILL, how long a killed worker's processes (its whole process "
        "group) may take to go before this node reports a failure (retry false) and takes no "
        "rank: a rank in the GPU driver's teardown outlives SIGKILL for tens of seconds and "
        "holds its GPU meanwhile. No worker starts here while they go.",
    )
    watchers: tuple[WatcherConfig, ...] = Field(default=(), description="Preemption sources.")
    watch_poll_s: float = Field(default=0.5, gt=0, description="Watcher poll period.")
    preemption_drain_s: float = Field(
        default=25.0,
        ge=0,
        description="On SIGTERM with a preemption notice (GCP's preemption is an ACPI "
        "shutdown: systemd stops the agent as the notice starts), keep serving the "
        "controller this long at most, until its layout no longer uses this node (the "
        "checkpoint committed, the next generation launched) or the notice's deadline: "
        "below the unit's TimeoutStopSec (30 s). 0: stop at once.",
    )
    status_interval_s: float = Field(default=0.2, gt=0, description="Status write period.")
    security: SecurityConfig | None = Field(
        default=None, description="TLS and NATS login (docs/operations.md#security); off if absent."
    )
    check: CheckSettings = Field(
        default_factory=CheckSettings, description="The node check run before joining."
    )
    cpu_quota: float | None = Field(
        default=None,
        gt=0,
        description="CPU cores' worth this node's workers may use together (e.g. 0.4), "
        "enforced by the cgroup cpu controller (v1 cpu.cfs_quota_us or v2 cpu.max, 100 ms "
        "period): one machine hosts nodes of different speed, each of a CPU kind "
        "(node.gpu_type cpu-<kind>; docs/runtime.md). None: no quota (a GPU node has none "
        "unless set here). Where no writable cpu controller exists the agent warns and runs "
        "its workers unthrottled, and its status says cpu_quota: unavailable.",
    )

    cpu_quota_from: Literal["exec", "ready"] = Field(
        default="exec",
        description="When a worker comes under the quota. 'exec': before its first "
        "instruction (start-up, the torch import and the rendezvous are throttled too: a "
        "node's whole life is slow). 'ready': once it reports ready to train (groups built, "
        "checkpoint loaded), so the quota throttles training, checkpoint saves and the stop, "
        "and a slow node's start does not lengthen every reconfiguration's downtime "
        "(sailor demo; docs/runtime.md).",
    )

    cpu_quota_period_ms: float = Field(
        default=CFS_PERIOD_US / 1000,
        ge=MIN_QUOTA_US / 1000,
        le=1000,
        description="The cgroup's enforcement period, ms (the kernel takes 1 ms to 1 s; "
        "default 100, its own). Within a period a throttled worker runs at full speed until "
        "its quota is spent, then stalls: a shorter period spreads the quota more evenly "
        "over steps shorter than a few periods, at the cost of more preemptions.",
    )

    @model_validator(mode="after")
    def _enforceable(self) -> AgentConfig:
        if self.cpu_quota is not None:
            validate_cores(self.cpu_quota, self.cpu_quota_period_us)
        return self

    def anchored(self, config_file: Path) -> AgentConfig:
        """This config with the relative paths of the files it reads (the ``security``
        files) taken from ``config_file``'s directory: under systemd the working directory
        is ``/``. What it writes (``work_dir``) is left as given: give it absolute."""
        if self.security is None:
            return self
        base = config_file.absolute().parent
        return self.model_copy(update={"security": self.security.anchored(base)})

    @property
    def cpu_quota_period_us(self) -> int:
        """The period as the kernel takes it, whole microseconds."""
        return round(self.cpu_quota_period_ms * 1000)


class Agent:
    """The agent of one node."""

    def __init__(self, config: AgentConfig, clock: Clock | None = None) -> None:
        self.cfg = config
        self.node = config.node
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
        self._plans = PlanSource(self._read_desired)
        self.facts: NodeFacts | None = None
        self.refused = ""
        self.quota: CpuQuota | None = None  # the workers' CPU quota (cpu_quota.py), if any
        self._quota_seen: QuotaState | object = _UNSEEN  # as of the last status write

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

    def _attach_workers(self) -> None:
        """Workers join the quota's cgroup at exec (the shell prefix) or once ready (the
        supervisor's ``on_ready`` moves the pid in: all its threads, the gloo ones too; an
        in-place relayout lifts the quota until its workers are ready again)."""
        if self.quota is None:
            return
        if self.cfg.cpu_quota_from == "exec":
            self.supervisor.exec_prefix = self.quota.exec_prefix
            return
        quota = self.quota

        sup = self.supervisor

        async def join(pid: int) -> None:
            try:
                await asyncio.to_thread(quota.adopt, (pid,))
                if all(w.started for w in sup.workers):  # a relayout's lift ends
                    await asyncio.to_thread(quota.resume)
            except OSError as exc:  # the worker trains on, unthrottled: say so
                _log.warning("cpu_quota_join_failed", pid=pid, error=str(exc))

        async def lift() -> None:
            try:
                await asyncio.to_thread(quota.suspend)
            except OSError as exc:
                _log.warning("cpu_quota_lift_failed", error=str(exc))

        sup.on_ready = join
        sup.on_handover = lift

    def cpu_quota(self) -> QuotaState:
        """The workers' CPU quota as the kernel holds it: cores, 'unavailable' or None."""
        return None if self.quota is None else self.quota.state()

    async def set_cpu_quota(self, cores: float | None) -> QuotaState:
        """Change the CPU quota of this node's workers now (None: lift it); returns the new
        state. A node started without a quota gets its cgroup now, and its running workers
        are moved into it (processes they started themselves are not). Where no writable
        cpu controller exists this warns and changes nothing (``'unavailable'``)."""
        if self.quota is None:
            self.quota = await asyncio.to_thread(
                CpuQuota.start,
                self.cfg.job,
                self.node.node_id,
                cores,
                period_us=self.cfg.cpu_quota_period_us,
            )
            self._attach_workers()
            await asyncio.to_thread(self.quota.adopt, self.supervisor.pids())
        else:
            await asyncio.to_thread(self.quota.set, cores)
        self.supervisor.changed.set()
        return self.quota.state()

    async def _run(self) -> None:
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
        sec = self.cfg.security
        t0 = time.monotonic()
        store = await self._retry(lambda: connect_etcd(self.cfg.etcd_endpoints, security=sec))
        t1 = time.monotonic()
        nc = await self._retry(
            lambda: connect_nats(self.cfg.nats_urls, self.node.node_id, security=sec)
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
                    url=",".join(self.cfg.nats_urls),
                    reachable=True,
                    tls=tls,
                    seconds=time.monotonic() - t1,
                ),
            }
        )
        if not self.node.address:
            # the rendezvous of a plan whose rank 0 is here listens on this address: without
            # one the controller could only name 127.0.0.1, which other nodes cannot reach
            servers = [*self.cfg.etcd_endpoints, *(_host_port(u) for u in self.cfg.nats_urls)]
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
            # a killed rank its previous incarnation left behind holds its GPU still: no
            # rank starts on top of it (the failure says so)
            await self.supervisor.restore_killed()
            await self._fence_from_desired()
            await commands.serve(self.node.node_id, self._on_command)
            await self.supervisor.top_up_spares()
            await self._register()
            self.sd.ready(f"registered node {self.node.node_id}")
            self._keep("status", self._status_loop)
            self._keep("registration", self._registration_loop)
            for w in self.watchers:
                self._keep(f"watch-{w.name}", lambda w=w: self._watch(w))
            await self.stopping.wait()
            await self._drain_if_preempted()
        finally:
            if self.stopping.is_set():
                self.sd.stopping()
            await self._shutdown(store, nc, commands)
        if self.failure is not None:
            raise DaemonFailedError("agent failed", reason=self.failure)

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
        if kv is None:
            return
        try:
            epoch = json.loads(kv.value)["epoch"]
        except (ValueError, KeyError, TypeError):
            return  # not ours to judge: the controller refuses an unreadable desired state
        if isinstance(epoch, int) and epoch > self.max_epoch:
            await asyncio.to_thread(self._fence.raise_to, epoch)
            self.max_epoch = epoch

    async def check_node(self) -> NodeFacts | None:
        """The node's facts, or None when the check failed in ``enforce`` mode (the agent then
        does not join: ``refused`` says why). CPU nodes and mode ``off`` gather nothing."""
        settings = self.cfg.check
        if is_cpu_type(self.node.gpu_type) or settings.mode == "off":
            return node_facts(self.node)
        gpu = await gather_gpu_subprocess(probe=settings.probe, timeout_s=settings.timeout_s)
        facts = node_facts(self.node, gpu)
        report = judge(facts, node_id=self.node.node_id)
        bad = [line for line in report.lines if line.verdict == "fail"]
        for line in report.lines:
            if line.verdict != "ok" and line.check not in ("nats", "etcd"):
                _log.warning(
                    "node_check",
                    node=self.node.node_id,
                    check=line.check,
                    verdict=line.verdict,
                    detail=line.detail[:500],
                    action=line.action[:300],
                )
        if not bad:
            return facts
        why = "; ".join(f"{line.check}: {line.detail}" for line in bad)[:2000]
        if settings.mode == "report":
            _log.warning("node_check_failed_joining_anyway", node=self.node.node_id, why=why)
            return facts
        self.refused = why
        _log.error(
            "node_check_failed_not_joining",
            node=self.node.node_id,
            gpu_type=self.node.gpu_type,
            why=why,
            fix="run `sailor check --config <agent config>` on this node for what to do",
        )
        return None

    async def _retry(self, make: Any) -> Any:
        while not self.stopping.is_set():
            try:
                return await make()
            except TemporaryError:
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

    async def _register(self) -> None:
        assert_store = self._store
        if assert_store is None:
            return
        while not self.stopping.is_set():
            try:
                if self._lease is not None and self._lease.alive:
                    # granted by a try whose put failed: revoke it, or it would be refreshed
                    # for the life of the agent with nothing on it
                    await self._lease.revoke()
                self._lease = await assert_store.lease(self.cfg.lease_ttl_s)
                await assert_store.put(
                    self.keys.node(self.node.node_id),
                    self.node.model_dump_json().encode(),
                    lease=self._lease,
                )
                break
            except TemporaryError:
                await self.clock.sleep(0.3)
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
            failure=(sup.failure or sup.held_failure)[:4000],
            held_step=sup.held_step if state == "held" else -1,
            spares=sup.spares_ready,
            spares_wanted=sup.spares_wanted,
            notice=self.notice,
            cpu_quota=self.cpu_quota(),
            time=self.clock.now(),
            timings=sup.timings() if state == "running" else (),
        )

    def _follow_quota(self) -> None:
        """A quota changed (here or from outside: the kernel's value is read) changes the
        workers' speed: the step timings measured before it are dropped."""
        now = self.cpu_quota()
        if now != self._quota_seen:
            if self._quota_seen is not _UNSEEN:
                _log.info("cpu_quota_changed", node=self.node.node_id, cores=now)
                self.supervisor.restart_timings()
            self._quota_seen = now

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
                event = WorkerFailed(
                    event_id=self._event_id("fail"),
                    node_id=self.node.node_id,
                    time=self.clock.now(),
                    plan_id=st.plan_id,
                    cause=st.failure[:4000],
                )
                # on a task of its own: its retries through a NATS outage (~45 s) must not
                # stop this loop, the agent's watchdog ping and its status in etcd (the
                # failure reaches the controller there too)
                self._tasks.spawn("worker-failed", self._publish("worker_failed", event))
            await self.clock.sleep(self.cfg.status_interval_s / 4)

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
            await self._publish("preemption_notice", event, until=notice.deadline)

    def _record_notice(self, notice: Notice) -> PreemptionNotice | None:
        """Keep a notice for the status record; the event to publish (None: one was
        already reported)."""
        if self.noticed:
            return None
        self.noticed = True
        event = PreemptionNotice(
            event_id=self._event_id("notice"),
            node_id=self.node.node_id,
            time=self.clock.now(),
            deadline=notice.deadline,
            source=notice.source,
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

    async def _on_command(self, data: bytes) -> bytes:
        async with self._lock:
            if self._closing:  # the workers are gone for good: start none now
                return (
                    self._refuse(_command_id(data), "agent shutting down")
                    .model_dump_json()
                    .encode()
                )
            try:
                ack = await self._apply(data)
            except Exception as exc:  # a command that fails is refused with its cause, on
                # record, not lost in the NATS client's callback (the controller re-sends it)
                _log.exception("command_failed", node=self.node.node_id)
                ack = self._refuse(_command_id(data), f"failed: {type(exc).__name__}: {exc}"[:1000])
            return ack.model_dump_json().encode()

    async def _close_supervisor(self) -> None:
        """Refuse every command from now on, let one being applied end (for at most the
        workers' kill grace: an Abort that holds waits that long), then kill the workers. A
        Launch still going on after that starts no more workers, and the supervisor kills
        those it started: none outlives the agent."""
        self._closing = True
        try:
            async with asyncio.timeout(2 * self.supervisor.kill_grace_s):
                async with self._lock:
                    pass
        except TimeoutError:
            _log.warning("shutdown_during_command", node=self.node.node_id)
        await self.supervisor.close()

    async def _apply(self, data: bytes) -> CommandAck:
        try:
            cmd = CommandAdapter.validate_json(data)
        except ValidationError as exc:
            return self._refuse("?", f"malformed: {str(exc).splitlines()[0][:200]}")
        if cmd.node_id != self.node.node_id:
            return self._refuse(cmd.command_id, f"addressed to {cmd.node_id}")
        if cmd.epoch < self.max_epoch:
            return self._refuse(cmd.command_id, f"stale epoch {cmd.epoch} < {self.max_epoch}")
        if cmd.command_id in self.applied:
            return self.applied[cmd.command_id].model_copy(update={"duplicate": True})
        if cmd.epoch > self.max_epoch:
            # durable before the command is applied: a restart must not forget it
            try:
                await asyncio.to_thread(self._fence.raise_to, cmd.epoch)
            except OSError as exc:  # not applied (refused, on record): the controller re-sends
                return self._refuse(cmd.command_id, f"epoch fence not persisted: {exc}"[:1000])
        self.max_epoch = cmd.epoch
        if isinstance(cmd, Launch):
            try:  # a Launch names its plan; read it from etcd (cached by plan id)
                plan = await self._plans.resolve(cmd)
            except TemporaryError as exc:  # not applied: the controller re-sends it
                return self._refuse(cmd.command_id, f"plan {cmd.plan_id}: {exc}"[:1000])
            try:  # and its training config, by digest (none: the workers' defaults)
                training = await self._plans.training(cmd)
            except TemporaryError as exc:
                return self._refuse(cmd.command_id, f"training config: {exc}"[:1000])
            try:
                await self.supervisor.launch(cmd.model_copy(update={"plan": plan}), training)
            except SupervisorClosedError:  # the agent began shutting down meanwhile
                return self._refuse(cmd.command_id, "agent shutting down")
            except WorkerTeardownError as exc:  # also the status's failure (retry false)
                return self._refuse(cmd.command_id, f"a killed worker holds on: {exc}"[:1000])
        elif isinstance(cmd, Stop):
            self.supervisor.stop_at(cmd.at_step)
        elif isinstance(cmd, Checkpoint):
            self.supervisor.save_at(cmd.step, cmd.directory, cmd.prune_below)
        elif isinstance(cmd, Abort):
            await self.supervisor.abort(hold=cmd.hold)
        ack = CommandAck(
            command_id=cmd.command_id,
            node_id=self.node.node_id,
            accepted=True,
            epoch_seen=self.max_epoch,
        )
        self.applied[cmd.command_id] = ack
        while len(self.applied) > 10_000:
            self.applied.popitem(last=False)
        self.supervisor.changed.set()
        return ack

    async def _read_desired(self) -> KeyValue | None:
        if self._store is None:
            raise PlanUnavailableError("not connected to etcd")
        return await self._store.get(self.keys.desired)

    def _refuse(self, command_id: str, reason: str) -> CommandAck:
        """The refusal ack, and a journal line: every refused command is on record twice."""
        _log.warning(
            "command_refused",
            node=self.node.node_id,
            command_id=command_id[:128],
            reason=reason[:300],
            epoch_seen=self.max_epoch,
        )
        return CommandAck(
            command_id=command_id,
            node_id=self.node.node_id,
            accepted=False,
            reason=reason,
            epoch_seen=self.max_epoch,
        )

    async def _shutdown(self, store: EtcdStore, nc: Any, commands: NatsCommands) -> None:
        await self._tasks.close()
        await self._close_supervisor()
        if self._crashed:
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


def _command_id(data: bytes) -> str:
    """The command id of a raw command, or "?" (for a refusal's ack)."""
    try:
        return str(CommandAdapter.validate_json(data).command_id)
    except ValidationError:
        return "?"


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
