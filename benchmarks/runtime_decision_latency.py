"""Controller decision latency (event received → new desired plan in etcd) at 64/512/2048 nodes.

Setup: a real nats-server (JetStream) and etcd 3.4 on loopback (``runtime_servers.py``); the
real ``Controller`` in this process with ``planner="sailor"`` (``sailor.planner`` search, then
``replan``) planning OPT-350 (catalog, global batch 1024) on spot 4-GPU nodes, half A100-40
and half V100-16, in us-central1-a, with analytic profiles. The agents are simulated in a
*separate process* (so they do not share the controller's event loop and GIL) by
``SimCluster``: one NATS connection and one etcd client shared by all simulated nodes, but
per node exactly what ``sailor.agent`` does through ``sailor.coordination``: its own lease,
``nodes/<id>`` bound to it, ``status/<id>`` under it, a command subscription answering each
command with a ``CommandAck`` (epoch check, at-most-once per command id), and join / leave /
preemption events on the JetStream stream with ``event_id`` as the message id. Simulated
workers are instantaneous: a Launch (which names its plan by id and digest) is resolved as
the agent does, from the desired state in etcd through ``sailor.agent.plan_source`` — one
cache for the whole simulated process, so each plan is read once here, where real agents
read it once per node, in parallel, from their own machines — then makes the node report a
step after the load step, a Stop its stop step, a Checkpoint that step saved, an Abort idle.

Per cluster size, after the first layout runs, rounds of three events, each waited for until
the controller is RUNNING again in a new generation:

- leave: a node of the running layout leaves (NodeLeft, then its lease is revoked, as an
  agent on SIGTERM) → abort → teardown (Abort to every busy node) → replan;
- join: a new node of a known shape registers and publishes NodeJoined → quiesce + replan;
- notice: a node of the layout publishes a PreemptionNotice (deadline in 120 s) → quiesce +
  replan (the node then leaves, unmeasured).

From the controller's audit log, per event: ``received`` (the ``event`` record), ``decision``
(first desired-state write after it), ``plan`` (the desired state carrying the new plan,
cause "plan ready"), and ``planning_s`` (the ``plan`` record: time from the start of the
planning call to its result, in the planner's worker process or thread). Coordination
overhead = (received → plan) − planner. ``agent → plan`` starts at the simulated agent's
first action (for a join, the etcd registration that the controller's watch may see before
the event arrives). Controller knobs as in runtime_reconfig.py: debounce 50 ms (inside the
overhead of a join; a leave of a placed node and a notice are not debounced), revision poll
100 ms; the planner runs as configured by default, in its warm worker process
(``planner_process: true``: the ``process`` rows). ``--baseline`` adds, per size, a run with
the planner in a thread of the controller (``planner_process: false``: the ``thread`` rows)
in the same session, for comparison. ``--profile FILE`` writes a cProfile of the
controller's process (its event-loop thread only: not the planner's thread or process) per
size and mode. Each size starts measuring once the controller has handled the setup's join
events.
Target (issue 7): ≤ 200 ms at 512 nodes. Prints; asserts nothing.

Before the cluster sizes, without servers: the in-place LOAD sizing a LAUNCH decision runs
(``plan_deadlines.in_place_read_bytes``: the agents' held-worker match, then the engine's
relayout schedule) at ``--in-place-ranks`` (512, 2,048 and 4,096 by default): LLAMA-3-8
(catalog), pipelines of 4 stages × TP 8, one 8-GPU node per stage, the middle pipeline
dropped. Compared with the restart path's sizing of the same new plan in the same run
(``read_bytes_per_node``: a pass over the plan). ``--sizes ''`` runs it alone.

Then, without servers: the admission check a pass runs per registered node up to three times
(``decide.exclusion``: the daemon's, ``decide``'s, an idle job's) at ``--admission-nodes``
(512 and 2,048 by default), 8-GPU nodes of 4 GPU types, with the catalog's price table and a
large one (the catalog's plus 8 rows in each of 40 more regions: 339 rows, nodes spread over
those regions: 40 shapes). Compared in the same run with no planner reach (the stand-in
planner: admission by failure records and runtime only) and with a cold reach (a fresh
reach and price table each call: what the first pass after a start costs; before the
verdicts were kept per shape, every pass cost that or more: ~51 ms at 512 nodes and 339 rows
on the development machine, 0.5 ms after).

Run: ``.venv/bin/python benchmarks/runtime_decision_latency.py [--sizes 64,512,2048]
[--in-place-ranks 512,2048,4096] [--admission-nodes 512,2048]``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import gc
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from functools import partial
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from runtime_servers import free_port, servers

from sailor import catalog
from sailor.agent.plan_source import PlanSource
from sailor.controller.config import ControllerConfig
from sailor.controller.daemon import Controller, freeze_startup_heap
from sailor.controller.decide import exclusion
from sailor.controller.decision_types import Observed
from sailor.controller.plan_deadlines import in_place_read_bytes, read_bytes_per_node
from sailor.controller.planning.in_process import SailorPlanner
from sailor.coordination import (
    EtcdLease,
    EtcdStore,
    Keys,
    NatsCommands,
    NatsEventBus,
    TemporaryError,
    connect_etcd,
    connect_nats,
)
from sailor.planner.reach import PlannerReach
from sailor.schemas.commands import Abort, Checkpoint, CommandAdapter, Launch, Stop
from sailor.schemas.events import Heartbeat, NodeJoined, NodeLeft, PreemptionNotice
from sailor.schemas.hardware import NodeSpec
from sailor.schemas.plan import Pipeline, Plan, ReplicaGroup, Stage
from sailor.schemas.prices import PriceTable
from sailor.schemas.runtime import AgentStatus, CommandAck, DesiredState, Phase

__all__ = ["SimCluster", "SimHandle", "node_spec"]

MODEL = "OPT-350"
GLOBAL_BATCH = 1024  # OPT-350's batch in the catalog
ZONE = "us-central1-a"
GPU_TYPES = ("A100-40", "V100-16")
SIM_LEASE_TTL_S = 60  # keepalive every 20 s: 2048 leases cost ~100 refreshes/s, not ~3000
ROUNDS = {64: 5, 512: 3, 2048: 2}
SETUP_CONCURRENCY = 128


def node_spec(i: int) -> NodeSpec:
    return NodeSpec(
        node_id=f"n{i:05d}",
        gpu_type=GPU_TYPES[i % len(GPU_TYPES)],
        gpus=4,
        zone=ZONE,
        spot=True,
        address=f"10.0.{i // 250}.{i % 250 + 1}",
    )


class _SimNode:
    """What one agent keeps: lease, status, highest epoch, applied command ids."""

    def __init__(self, spec: NodeSpec, lease: EtcdLease) -> None:
        self.spec = spec
        self.lease = lease
        self.status = AgentStatus(node_id=spec.node_id)
        self.max_epoch = 0
        self.applied: dict[str, CommandAck] = {}
        self.lock = asyncio.Lock()


class SimCluster:
    """Many simulated agents over one NATS connection and one etcd client."""

    def __init__(self, job: str, nats_url: str, etcd_endpoint: str) -> None:
        self.keys = Keys(job=job)
        self.nats_url = nats_url
        self.etcd_endpoint = etcd_endpoint
        self.nodes: dict[str, _SimNode] = {}
        self.store: EtcdStore | None = None
        self.nc: Any = None
        self.bus: NatsEventBus | None = None
        # one publisher per node: the controller takes an event only from its own node's
        # subject (sailor.<job>.events.<node>.<kind>), as an agent publishes it
        self._buses: dict[str, NatsEventBus] = {}
        self.commands: NatsCommands | None = None
        self.published: dict[str, tuple[str, Any]] = {}  # event id -> (kind, event), in order
        self.sent_at: dict[str, float] = {}  # event id -> time of its first publish
        self.plans = PlanSource(self._read_desired)
        self.plan_reads = 0

    async def _read_desired(self) -> Any:
        assert self.store is not None
        self.plan_reads += 1
        return await self.store.get(self.keys.desired)

    async def start(self, create_stream: bool = True) -> None:
        self.store = await connect_etcd(self.etcd_endpoint, op_timeout=10.0)
        self.nc = await connect_nats(self.nats_url, f"sim-{self.keys.job}")
        self.bus = NatsEventBus(self.nc, self.keys, durable="unused", op_timeout=10.0)
        if create_stream:
            # Setup only: lets the nodes register before the controller starts, so that the
            # first layout is planned for the whole cluster (agents never create the stream).
            await self.bus.ensure_stream()
        self.commands = NatsCommands(self.nc, self.keys)

    async def publish(self, kind: str, event: Any, msg_id: str | None = None) -> bool:
        """Publish like ``Agent._publish`` (bounded retries); False if the stream deduped it."""
        assert self.nc is not None
        bus = self._buses.get(event.node_id)
        if bus is None:
            bus = NatsEventBus(
                self.nc, self.keys, durable="unused", op_timeout=10.0, source=event.node_id
            )
            self._buses[event.node_id] = bus
        if event.event_id not in self.published:
            self.published[event.event_id] = (kind, event)
            self.sent_at[event.event_id] = time.time()
        for _ in range(20):
            try:
                return await bus.publish(
                    kind, event.model_dump_json().encode(), msg_id or event.event_id
                )
            except TemporaryError:
                await asyncio.sleep(0.25)
        raise RuntimeError(f"event {event.event_id} not published")

    async def join(self, spec: NodeSpec, tag: str = "join") -> tuple[float, str]:
        """Register under a lease, serve commands, publish NodeJoined; (start time, event id)."""
        assert self.store is not None and self.commands is not None
        t0 = time.time()
        lease = await self.store.lease(SIM_LEASE_TTL_S)
        node = self.nodes.get(spec.node_id)
        if node is not None:
            node.lease = lease  # re-registration under a fresh lease, as after a lost lease
        else:
            node = _SimNode(spec, lease)
            self.nodes[spec.node_id] = node
            await self.commands.serve(spec.node_id, lambda data, n=node: self._on_command(n, data))
        await self.store.put(self.keys.node(spec.node_id), spec.model_dump_json().encode(), lease)
        await self._put_status(node)
        ev = NodeJoined(
            event_id=f"{spec.node_id}-{tag}", node_id=spec.node_id, time=time.time(), node=spec
        )
        await self.publish("node_joined", ev)
        return t0, ev.event_id

    async def leave(self, node_id: str, tag: str = "leave") -> tuple[float, str]:
        """As an agent on SIGTERM: publish NodeLeft, then revoke the lease."""
        node = self.nodes.pop(node_id)
        t0 = time.time()
        ev = NodeLeft(event_id=f"{node_id}-{tag}", node_id=node_id, time=t0, reason="shutdown")
        await self.publish("node_left", ev)
        await node.lease.revoke()
        return t0, ev.event_id

    async def notice(self, node_id: str, in_s: float, tag: str = "notice") -> tuple[float, str]:
        t0 = time.time()
        ev = PreemptionNotice(
            event_id=f"{node_id}-{tag}",
            node_id=node_id,
            time=t0,
            deadline=t0 + in_s,
            source="bench",
        )
        await self.publish("preemption_notice", ev)
        return t0, ev.event_id

    def heartbeat(self, node_id: str, tag: str) -> Heartbeat:
        st = self.nodes[node_id].status
        return Heartbeat(
            event_id=f"{node_id}-{tag}",
            node_id=node_id,
            time=time.time(),
            plan_id=st.plan_id,
            step=max(st.step, 0),
        )

    async def _put_status(self, node: _SimNode) -> None:
        assert self.store is not None
        st = node.status.model_copy(update={"time": time.time(), "epoch": node.max_epoch})
        with contextlib.suppress(TemporaryError):  # a node that left: its lease is gone
            await self.store.put(
                self.keys.status(node.spec.node_id), st.model_dump_json().encode(), node.lease
            )

    async def _on_command(self, node: _SimNode, data: bytes) -> bytes:
        async with node.lock:
            return (await self._apply(node, data)).model_dump_json().encode()

    async def _apply(self, node: _SimNode, data: bytes) -> CommandAck:
        nid = node.spec.node_id
        cmd = CommandAdapter.validate_json(data)
        if cmd.node_id != nid or cmd.epoch < node.max_epoch:
            return CommandAck(
                command_id=cmd.command_id,
                node_id=nid,
                accepted=False,
                reason="stale or misaddressed",
                epoch_seen=node.max_epoch,
            )
        if cmd.command_id in node.applied:
            return node.applied[cmd.command_id].model_copy(update={"duplicate": True})
        node.max_epoch = cmd.epoch
        st = node.status
        # Instantaneous simulated workers: each command's effect is reported at once.
        if isinstance(cmd, Launch):
            try:
                await self.plans.resolve(cmd)
            except TemporaryError as exc:  # as the agent: refuse unapplied, to be re-sent
                return CommandAck(
                    command_id=cmd.command_id,
                    node_id=nid,
                    accepted=False,
                    reason=str(exc),
                    epoch_seen=node.max_epoch,
                )
            st = st.model_copy(
                update={
                    "generation": cmd.generation,
                    "plan_id": cmd.plan_id,
                    "state": "running",
                    "start_step": cmd.load_step,
                    "step": max(cmd.load_step, 0) + 1,
                    "saved_step": -1,
                }
            )
        elif isinstance(cmd, Stop):
            st = st.model_copy(update={"step": max(st.step, cmd.at_step)})
        elif isinstance(cmd, Checkpoint):
            st = st.model_copy(update={"step": max(st.step, cmd.step), "saved_step": cmd.step})
        elif isinstance(cmd, Abort):
            st = st.model_copy(update={"state": "idle"})
        node.status = st
        await self._put_status(node)
        ack = CommandAck(
            command_id=cmd.command_id, node_id=nid, accepted=True, epoch_seen=node.max_epoch
        )
        node.applied[cmd.command_id] = ack
        return ack

    async def join_many(self, specs: list[NodeSpec]) -> None:
        sem = asyncio.Semaphore(SETUP_CONCURRENCY)

        async def one(s: NodeSpec) -> None:
            async with sem:
                await self.join(s)

        await asyncio.gather(*(one(s) for s in specs))

    async def close(self) -> None:
        if self.commands is not None:
            await self.commands.close()
        if self.store is not None:
            await self.store.close()  # stops keepalives; the servers are discarded afterwards
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.nc.close(), 5)


# --- the simulated cluster in its own process, driven over a pipe --------------------------


# An extra operation the simulated cluster's process runs on request: ``op(sim, *args)``.
# Benchmarks built on this one (``runtime_burst.py``) pass theirs in, so this module never
# imports them (no import circle).
SimOp = Callable[..., Awaitable[Any]]


def _sim_main(
    job: str, nats_url: str, etcd: str, n: int, conn: Connection, ops: dict[str, SimOp]
) -> None:
    asyncio.run(_sim_loop(job, nats_url, etcd, n, conn, ops))


async def _sim_loop(
    job: str, nats_url: str, etcd: str, n: int, conn: Connection, ops: dict[str, SimOp]
) -> None:
    sim = SimCluster(job, nats_url, etcd)
    try:
        await sim.start()
        t0 = time.perf_counter()
        await sim.join_many([node_spec(i) for i in range(n)])
        conn.send(("ready", time.perf_counter() - t0))
        while True:
            msg = await asyncio.to_thread(conn.recv)
            op, args = msg[0], msg[1:]
            if op == "stop":
                break
            try:
                if op == "join":
                    out: Any = await sim.join(node_spec(int(args[0])))
                elif op == "leave":
                    out = await sim.leave(str(args[0]))
                elif op == "notice":
                    out = await sim.notice(str(args[0]), float(args[1]))
                elif op == "plan_reads":
                    out = sim.plan_reads
                elif op in ops:
                    out = await ops[op](sim, *args)
                else:
                    out = RuntimeError(f"unknown op {op}")
            except Exception as exc:  # reported to the parent, which raises
                out = exc
            conn.send(out)
    finally:
        await sim.close()
        conn.send(("closed",))


class SimHandle:
    """The parent's side: start the simulated cluster process and call it (bounded waits)."""

    def __init__(
        self, job: str, nats_url: str, etcd: str, n: int, ops: dict[str, SimOp] | None = None
    ) -> None:
        # spawn, not fork: the parent already runs grpc and asyncio threads; ``ops`` must be
        # module-level functions (pickled by name, imported again in the child)
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_sim_main,
            args=(job, nats_url, etcd, n, child, dict(ops or {})),
            name=f"sim-{job}",
        )
        self.proc.start()
        child.close()

    def _recv(self, timeout: float) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"simulated cluster silent for {timeout}s")
        out = self.conn.recv()
        if isinstance(out, Exception):
            raise out
        return out

    async def ready(self, timeout: float) -> float:
        return float((await asyncio.to_thread(self._recv, timeout))[1])

    async def call(self, *msg: Any, timeout: float = 60.0) -> Any:
        self.conn.send(msg)
        return await asyncio.to_thread(self._recv, timeout)

    async def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.send(("stop",))
            await asyncio.to_thread(self._recv, 30.0)
        await asyncio.to_thread(self.proc.join, 10)
        if self.proc.is_alive():
            self.proc.terminate()
            await asyncio.to_thread(self.proc.join, 5)


# --- the measurement ------------------------------------------------------------------------


def controller_config(job: str, tmp: Path, nats: str, etcd: str, **kw: Any) -> ControllerConfig:
    return ControllerConfig(
        job=job,
        identity=f"ctl-{job}",
        nats_url=nats,
        etcd_endpoint=etcd,
        audit_log=tmp / f"audit-{job}.jsonl",
        checkpoint_dir=str(tmp / "ckpt"),
        debounce_s=0.05,
        poll_s=0.1,
        resync_s=1.0,
        command_timeout_s=5.0,  # 768 concurrent requests at 2048 nodes on 2 shared cores
        base_port=free_port(),
        planner="sailor",
        model=MODEL,
        global_batch_size=GLOBAL_BATCH,  # the config's default (8) would override the catalog's
        **kw,
    )


async def wait_running(ctl: Controller, after_gen: int, timeout: float) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while loop.time() < end:
        d = ctl.desired
        if d is not None and d.phase is Phase.RUNNING and d.generation > after_gen:
            return
        await asyncio.sleep(0.01)
    raise RuntimeError(f"RUNNING after generation {after_gen} not reached in {timeout}s")


async def wait_handled(ctl: Controller, count: int, timeout: float) -> None:
    """Until the controller has handled ``count`` events (any outcome)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while sum(ctl.event_counts.values()) < count:
        if loop.time() > end:
            raise RuntimeError(f"{count} events not handled in {timeout}s")
        await asyncio.sleep(0.01)


def _records_from(audit: Path, offset: int) -> list[dict[str, Any]]:
    """The log's records from byte ``offset`` on (the log is not rotated in this run).

    Not the whole log each time: parsing all of it (~20,000 records by the end at 512 nodes)
    in the controller's process after every event made tens of thousands of objects that
    set off full garbage collections of the controller's process later, inside the
    measured path of the next event.
    """
    with audit.open("rb") as fh:
        fh.seek(max(0, offset - 1))
        data = fh.read()
    # from the first line that starts at or after the offset (it may fall inside a record)
    start = data.find(b"\n") + 1 if offset else 0
    recs = [json.loads(line) for line in data[start:].splitlines() if line.strip()]
    recs.sort(key=lambda r: float(r.get("time", 0.0)))  # by time, as read_records
    return recs


async def _measure_when_logged(
    audit: Path, event_id: str, t_agent: float, offset: int
) -> dict[str, float]:
    """``_measure`` once the event's own record is in the log (bounded wait)."""
    for _ in range(300):
        recs = _records_from(audit, offset)
        if any(r["kind"] == "event" and r.get("event_id") == event_id for r in recs):
            return _measure(recs, event_id, t_agent)
        await asyncio.sleep(0.1)
    raise RuntimeError(f"no audit record of event {event_id} after 30 s")


def _measure(recs: list[dict[str, Any]], event_id: str, t_agent: float) -> dict[str, float]:
    got = [r for r in recs if float(r["time"]) >= t_agent - 1e-3]
    recv = next(r for r in got if r["kind"] == "event" and r.get("event_id") == event_id)
    t_recv = float(recv["time"])
    decision = next(r for r in got if r["kind"] == "phase")
    plan = next(r for r in got if r["kind"] == "plan")
    written = next(
        r
        for r in got
        if r["kind"] == "phase" and r.get("cause") == "plan ready" and r["time"] >= plan["time"]
    )
    total = float(written["time"]) - t_recv
    planner = float(plan["planning_s"])
    return {
        "transport": t_recv - t_agent,
        "decision": float(decision["time"]) - t_recv,
        "total": total,
        "planner": planner,
        "coord": total - planner,
        "agent_total": float(written["time"]) - t_agent,
        "gpus": float(plan["gpus"]),
    }


async def run_size(
    tmp: Path, nats: str, etcd: str, n: int, rounds: int, thread: bool = False
) -> dict[str, Any]:
    """One size; the controller as configured by default, or with ``thread``, planning in a
    thread (``planner_process: false``)."""
    job = f"lat{n}" + ("t" if thread else "")
    sim = SimHandle(job, nats, etcd, n)
    ctl: Controller | None = None
    task: asyncio.Task[None] | None = None
    extra: dict[str, Any] = {"planner_process": False} if thread else {}
    cfg = controller_config(job, tmp, nats, etcd, **extra)
    out: dict[str, Any] = {"n": n, "events": [], "process": cfg.planner_process}
    try:
        out["register_s"] = await sim.ready(timeout=300)
        freeze_startup_heap()  # as the daemon's entry point (run_controller) does
        ctl = Controller(cfg)
        t0 = time.perf_counter()
        task = asyncio.create_task(ctl.run(), name=f"bench-ctl-{job}")
        await wait_running(ctl, -1, 300)
        out["first_layout_s"] = time.perf_counter() - t0
        # The setup's n join events may still be queued in the stream: measure from a drained
        # consumer, else an event's record can trail the decision its etcd change caused.
        await wait_handled(ctl, n, 120)
        out["setup_drained_s"] = time.perf_counter() - t0
        audit = tmp / f"audit-{job}.jsonl"
        next_id = n
        for _ in range(rounds):
            for kind in ("leave", "join", "notice"):
                await asyncio.sleep(0.3)  # let the loop go quiet
                d = ctl.desired
                if d is None:
                    raise RuntimeError("controller lost its desired state")
                gen = d.generation
                offset = audit.stat().st_size
                placed = sorted(d.placement)
                victim = placed[len(placed) // 2]
                if kind == "leave":
                    t_agent, eid = await sim.call("leave", victim)
                elif kind == "join":
                    t_agent, eid = await sim.call("join", next_id)
                    next_id += 1
                else:
                    t_agent, eid = await sim.call("notice", victim, 120.0)
                await wait_running(ctl, gen, 120)
                row = await _measure_when_logged(audit, eid, t_agent, offset)
                row["kind"] = kind  # type: ignore[assignment]
                out["events"].append(row)
                if kind == "notice":
                    await sim.call("leave", victim)  # the reclaimed node goes away
        out["decisions"] = ctl.decisions
        out["event_counts"] = dict(ctl.event_counts)
        out["plan_reads"] = await sim.call("plan_reads")
    finally:
        if ctl is not None and task is not None:
            ctl.stopping.set()
            ctl.wake()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(task, 30)
        await sim.stop()
    return out


class _GcTimes:
    """Garbage collections of this (the controller's) process: count and seconds per generation."""

    def __init__(self) -> None:
        self.count = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        g = info["generation"]
        self.count[g] += 1
        self.seconds[g] += time.perf_counter() - self._t0

    def __str__(self) -> str:
        return ", ".join(
            f"gen{g} {c} ({1000 * t:.0f} ms)"
            for g, (c, t) in enumerate(zip(self.count, self.seconds, strict=True))
        )


def _p95(xs: list[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(0.95 * (len(s) - 1))))]


def _ms(x: float) -> str:
    return f"{1000 * x:7.0f}"


def _mode(r: dict[str, Any]) -> str:
    return "process" if r["process"] else "thread"


def report(results: list[dict[str, Any]]) -> None:
    cols = ("total", "planner", "coord", "decision", "transport", "agent_total")
    print(
        "\nper size, all events (ms): total = event received -> desired state with the new plan"
        " in etcd;\n  planner = inside sailor.planner; coord = total - planner;"
        " decision = received -> first desired write;\n  transport = agent publish -> received;"
        " agent_total = agent's first action -> plan in etcd"
    )
    head = " ".join(f"{c + ' p50':>12} {c + ' p95':>12}" for c in cols)
    print(f"{'nodes':>6} {'planner':>7} {'events':>6} {head}")
    for r in results:
        ev = r["events"]
        if r.get("error"):
            print(f"{r['n']:>6} {_mode(r):>7} failed: {r['error']}")
            continue
        cells = " ".join(
            f"{_ms(statistics.median([e[c] for e in ev])):>12} {_ms(_p95([e[c] for e in ev])):>12}"
            for c in cols
        )
        print(f"{r['n']:>6} {_mode(r):>7} {len(ev):>6} {cells}")
    print("\nmedian by event kind (ms): total / planner / coord / decision")
    for r in results:
        for kind in ("leave", "join", "notice"):
            ev = [e for e in r["events"] if e["kind"] == kind]
            if not ev:
                continue
            med = [_ms(statistics.median([e[c] for e in ev])).strip() for c in cols[:4]]
            print(f"{r['n']:>6} {_mode(r):>7} {kind:<7} n={len(ev)}  " + " / ".join(med))
    print("\nsetup per size")
    for r in results:
        if r.get("error"):
            continue
        gpus = sorted({int(e["gpus"]) for e in r["events"]})
        print(
            f"{r['n']:>6} nodes ({4 * r['n']} GPUs): registered in {r['register_s']:.2f} s, "
            f"first layout (search + launch) {r['first_layout_s']:.1f} s, plans use {gpus} GPUs, "
            f"controller passes {r['decisions']}, events {r['event_counts']}, "
            f"plan reads by the agents {r.get('plan_reads', '?')}, controller process's "
            f"garbage collections {r.get('gc', '?')} ({_mode(r)})"
        )
    print("\ntarget (issue 7): <= 200 ms at 512 nodes (reported, not asserted)")


# --- the in-place LOAD sizing of a LAUNCH decision -------------------------------------------

IN_PLACE_STAGES = 4
IN_PLACE_TP = 8


def _in_place_layout(pipelines: int) -> tuple[Plan, dict[str, tuple[int, ...]]]:
    """``pipelines`` pipelines of LLAMA-3-8 in 4 even stages at TP 8, stage s of pipeline p
    on node ``p<p>s<s>`` (GPUs 0-7)."""
    model = catalog.model("LLAMA-3-8")
    n = model.num_all_layers
    cuts = [round(i * n / IN_PLACE_STAGES) for i in range(IN_PLACE_STAGES + 1)]
    group = ReplicaGroup(gpu_type="A100-80", zone=ZONE, tp=IN_PLACE_TP, gpus_per_node=8)
    pipe = Pipeline(
        stages=tuple(
            Stage(first_layer=cuts[i], last_layer=cuts[i + 1] - 1, replica=group)
            for i in range(IN_PLACE_STAGES)
        ),
        microbatch_size=1,
        num_microbatches=8,
    )
    plan = Plan(
        plan_id=f"llama-{pipelines}",
        model=model.name,
        global_batch_size=8 * pipelines,
        pipelines=(pipe,) * pipelines,
    )
    per = IN_PLACE_STAGES * IN_PLACE_TP
    placement = {
        f"p{p}s{s}": tuple(range(p * per + s * IN_PLACE_TP, p * per + (s + 1) * IN_PLACE_TP))
        for p in range(pipelines)
        for s in range(IN_PLACE_STAGES)
    }
    return plan, placement


def _best(f: Callable[[], object]) -> float:
    """Seconds of the fastest of three calls of ``f`` (one when it takes over 10 s)."""
    times: list[float] = []
    while len(times) < 3 and (not times or times[-1] < 10.0):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return min(times)


def in_place_sizing(ranks: list[int]) -> None:
    """Time ``in_place_read_bytes`` from a layout of ``r`` ranks to one with its middle
    pipeline dropped (the other nodes keep their workers), against ``read_bytes_per_node``
    of the new plan."""
    model = catalog.model("LLAMA-3-8")
    per = IN_PLACE_STAGES * IN_PLACE_TP
    print(
        f"\nin-place LOAD sizing (LAUNCH decision): {model.name}, pipelines of "
        f"{IN_PLACE_STAGES} stages x TP {IN_PLACE_TP}, one node per stage, the middle pipeline "
        "dropped; best of 3 (1 above 10 s)"
    )
    print(f"{'ranks':>6} {'in place (s)':>13} {'full read (s)':>14} {'ratio':>7}")
    for r in ranks:
        pipes = max(2, r // per)
        old, old_place = _in_place_layout(pipes)
        new, _ = _in_place_layout(pipes - 1)
        drop = pipes // 2
        new_place: dict[str, tuple[int, ...]] = {}
        for p in range(pipes):
            if p == drop:
                continue
            q = p if p < drop else p - 1  # the pipeline's index in the new plan
            for s in range(IN_PLACE_STAGES):
                first = q * per + s * IN_PLACE_TP
                new_place[f"p{p}s{s}"] = tuple(range(first, first + IN_PLACE_TP))
        inplace = _best(partial(in_place_read_bytes, old, old_place, new, new_place, model))
        full = _best(partial(read_bytes_per_node, new, new_place, model))
        print(f"{pipes * per:>6} {inplace:>13.3f} {full:>14.4f} {inplace / full:>7.0f}")


# --- the admission check of a pass ----------------------------------------------------------

ADMISSION_TYPES = ("A100-40", "V100-16", "H100-80", "L4")
ADMISSION_REGIONS = 40


def _large_prices() -> PriceTable:
    """The catalog's price table and its first 8 rows again in 40 more regions."""
    base = catalog.prices()
    more = [
        p.model_copy(update={"region": f"r{i}"})
        for i in range(ADMISSION_REGIONS)
        for p in base.gpus[:8]
    ]
    return base.model_copy(update={"gpus": (*base.gpus, *more)})


def _ms_per_call(f: Callable[[], object], calls: int) -> float:
    f()  # the first call: a warm reach fills its verdicts
    t0 = time.perf_counter()
    for _ in range(calls):
        f()
    return (time.perf_counter() - t0) / calls * 1e3


def _cold(d: DesiredState, o: Observed, reach: PlannerReach) -> object:
    """``exclusion`` with a reach and a price table as fresh as at a start (nothing kept)."""
    table = reach.prices
    fresh = table.model_copy(update={"gpus": (*table.gpus,)})  # another tuple object
    return exclusion(d, o, None, reach.model_copy(update={"prices": fresh}))


def admission_pass(sizes: list[int]) -> None:
    """Time ``exclusion`` over ``n`` registered nodes with no reach, a cold one, a warm one."""
    model = catalog.model(MODEL)
    print(
        f"\nadmission check of a pass (decide.exclusion, up to 3 a pass): {MODEL}'s planner "
        f"reach, 8-GPU nodes of {'/'.join(ADMISSION_TYPES)}; ms per call"
    )
    print(
        f"{'nodes':>6} {'price rows':>10} {'shapes':>6} {'no reach':>9} {'cold':>8} "
        f"{'warm':>8} {'cold/warm':>9} {'warm/none':>9}"
    )
    for large in (False, True):
        prices = _large_prices() if large else catalog.prices()
        reach = SailorPlanner(model, prices=prices).reach()
        for n in sizes:
            nodes = {
                f"n{i}": NodeSpec(
                    node_id=f"n{i}",
                    gpu_type=ADMISSION_TYPES[i % len(ADMISSION_TYPES)],
                    gpus=8,
                    zone=f"r{i % ADMISSION_REGIONS}-a" if large else ZONE,
                    address="h",
                )
                for i in range(n)
            }
            shapes = len({(s.gpu_type, s.zone) for s in nodes.values()})
            o = Observed(now=1.0, nodes=nodes, status={})
            d = DesiredState(epoch=1)

            calls = max(3, 10_000 // n)
            none = _ms_per_call(partial(exclusion, d, o, None, None), calls)
            cold_ms = _ms_per_call(partial(_cold, d, o, reach), max(3, calls // 10))
            warm = _ms_per_call(partial(exclusion, d, o, None, reach), calls)
            print(
                f"{n:>6} {len(prices.gpus):>10} {shapes:>6} {none:>9.2f} {cold_ms:>8.2f} "
                f"{warm:>8.2f} {cold_ms / warm:>9.1f} {warm / none:>9.1f}"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="64,512,2048")
    ap.add_argument(
        "--in-place-ranks",
        default="512,2048,4096",
        help="world sizes the in-place LOAD sizing is timed at ('' : not timed)",
    )
    ap.add_argument(
        "--admission-nodes",
        default="512,2048",
        help="registered nodes the admission check is timed at ('' : not timed)",
    )
    ap.add_argument("--rounds", type=int, default=0, help="rounds per size (0: 5/3/2)")
    ap.add_argument(
        "--baseline",
        action="store_true",
        help="also run each size with the planner in a thread (planner_process: false)",
    )
    ap.add_argument(
        "--profile",
        metavar="FILE",
        default="",
        help="cProfile the controller's process (event loop thread) per size into FILE-<n>.prof",
    )
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s]
    print(f"machine: {platform.machine()} {platform.processor() or ''} cpus={os.cpu_count()}")
    if args.in_place_ranks:
        in_place_sizing([int(r) for r in args.in_place_ranks.split(",") if r])
    if args.admission_nodes:
        admission_pass([int(n) for n in args.admission_nodes.split(",") if n])
    if not sizes:
        return
    print(
        f"python {platform.python_version()}; controller in-process, planner=sailor, {MODEL} "
        f"(gbs 1024), nodes 4x {'/'.join(GPU_TYPES)} spot in {ZONE}; simulated agents in one "
        "separate process (shared NATS + etcd connection, one lease per node)"
    )
    results = []
    with tempfile.TemporaryDirectory(prefix="sailor-latency-") as d:
        tmp = Path(d)
        with servers(tmp) as (nats, etcd):
            for n in sizes:
                for thread in (False, True) if args.baseline else (False,):
                    rounds = args.rounds or ROUNDS.get(n, 2)
                    t0 = time.perf_counter()
                    prof = cProfile.Profile() if args.profile else None
                    res: dict[str, Any] = {"n": n, "process": not thread, "events": []}
                    gcs = _GcTimes()
                    gc.callbacks.append(gcs)
                    try:
                        if prof is not None:
                            prof.enable()
                        res = asyncio.run(run_size(tmp, nats, etcd, n, rounds, thread))
                    except Exception as exc:  # reported in the table, the other sizes still run
                        res["error"] = repr(exc)
                    finally:
                        gc.callbacks.remove(gcs)
                        res["gc"] = str(gcs)
                        if prof is not None:
                            prof.disable()
                            prof.dump_stats(f"{args.profile}-{n}-{_mode(res)}.prof")
                    results.append(res)
                    took = time.perf_counter() - t0
                    print(f"  {n} nodes ({_mode(res)}) done in {took:.0f} s", flush=True)
    report(results)


if __name__ == "__main__":
    main()
