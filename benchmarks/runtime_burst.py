"""A burst of 10,000 events at the real JetStream stream with the real controller consuming.

Setup: real nats-server and etcd on loopback; the real ``Controller`` in this process
(``planner="sailor"``, OPT-350, gbs 1024) running a layout on 64 simulated 4-GPU nodes; the
simulated agents and the burst's publishers in a separate process (``SimCluster`` of
``runtime_decision_latency.py``: per node its own lease and command subscription, events
published through ``NatsEventBus`` with ``event_id`` as the message id, as ``sailor.agent``).

The burst, 10,000 publishes, from up to ``CONCURRENCY`` concurrent publishers:

- 2,000 joins: 1,000 new nodes register under a lease and publish NodeJoined, then register
  again under a fresh lease (as an agent whose lease was lost) and publish NodeJoined again;
- 1,000 leaves: each of those nodes then publishes NodeLeft and revokes its lease (real
  membership churn: the controller replans and reconfigures while it drains the stream);
- 3,500 heartbeats about the 64 running nodes;
- 2,500 retried publishes of already-sent events with the same ``event_id`` (an agent's
  retry): JetStream's duplicate window must drop every one;
- 1,000 late duplicates: an already-sent event re-published under another message id (a
  duplicate arriving past the stream's 2 min window): the controller's own dedup must record
  ``event_duplicate`` and apply nothing.

Checks (printed): every distinct event handled exactly once as new (accepted, or rejected
when its node had already left by the time it was handled), every late duplicate handled
exactly once as a duplicate, no ``event`` audit record twice for one id, the durable consumer
ends with nothing pending or unacked. Figures: handling latency (publish → handled by the
controller) p50/p99, the controller's own time per event, and the drain time (first publish
→ last event handled). Uses the controller's ``on_event`` hook and ``event_counts``.
Prints; asserts nothing.

Run: ``.venv/bin/python benchmarks/runtime_burst.py``
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from runtime_decision_latency import (
    GPU_TYPES,
    MODEL,
    ZONE,
    SimCluster,
    SimHandle,
    controller_config,
    node_spec,
    wait_running,
)
from runtime_servers import servers

from sailor.controller.audit import read_records
from sailor.controller.daemon import Controller
from sailor.coordination import Keys, connect_nats

BASE_NODES = 64
CHURN_NODES = 1_000  # x (join, re-join, leave) = 3,000 events
HEARTBEATS = 3_500
RETRIES = 2_500  # same message id: dropped by JetStream
PROCESS = "--thread-planner" not in sys.argv[1:]
"""Planner in its worker process (the default), or in a thread with ``--thread-planner``."""
LATE_DUPLICATES = 1_000  # same event id, new message id: dropped by the controller
CONCURRENCY = 64
DRAIN_TIMEOUT_S = 600.0
STALL_TIMEOUT_S = 60.0


async def run_burst(sim: SimCluster, seed: int = 7) -> dict[str, Any]:
    """In the simulated cluster's process: publish the burst; what was sent, and when."""
    rng = random.Random(seed)
    kinds: dict[str, str] = {}
    late: dict[str, float] = {}
    retried = collections.Counter[bool]()
    sem = asyncio.Semaphore(CONCURRENCY)
    setup = set(sim.published)

    async def chain(i: int) -> None:
        for tag in ("join1", "join2"):
            async with sem:
                _, eid = await sim.join(node_spec(i), tag)
            kinds[eid] = "join"
        async with sem:
            _, eid = await sim.leave(node_spec(i).node_id, "leave")
        kinds[eid] = "leave"

    async def heartbeats() -> None:
        for k in range(HEARTBEATS):
            ev = sim.heartbeat(node_spec(rng.randrange(BASE_NODES)).node_id, f"hb{k}")
            async with sem:
                await sim.publish("heartbeat", ev)
            kinds[ev.event_id] = "heartbeat"

    def recent() -> list[str]:
        ids = [e for e in list(sim.published)[-400:] if e not in setup]
        return [e for e in ids if e in kinds]

    async def duplicates() -> None:
        todo = ["retry"] * RETRIES + ["late"] * LATE_DUPLICATES
        rng.shuffle(todo)
        for how in todo:
            for _ in range(2000):  # bounded wait for enough published events to pick from
                ids = recent()
                if how == "late":
                    ids = [e for e in ids if e not in late]  # one late duplicate per event id
                if ids:
                    break
                await asyncio.sleep(0.005)
            else:
                raise RuntimeError("no published event to duplicate")
            eid = rng.choice(ids)
            kind, ev = sim.published[eid]
            async with sem:
                if how == "late":
                    late[eid] = time.time()
                    await sim.publish(kind, ev, msg_id=f"{eid}-late")
                else:
                    retried[await sim.publish(kind, ev)] += 1

    t0 = time.time()
    await asyncio.gather(
        *(chain(BASE_NODES + i) for i in range(CHURN_NODES)), heartbeats(), duplicates()
    )
    return {
        "t0": t0,
        "t1": time.time(),
        "sent": {e: sim.sent_at[e] for e in kinds},
        "kinds": kinds,
        "late": late,
        "retried_dropped": retried[False],
        "retried_stored": retried[True],
    }


async def _consumer_state(nats: str, keys: Keys, durable: str) -> tuple[int, int]:
    nc = await connect_nats(nats, "burst-check")
    try:
        info = await nc.jetstream().consumer_info(keys.stream, durable)
        return int(info.num_pending or 0), int(info.num_ack_pending or 0)
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(nc.close(), 5)


async def scenario(tmp: Path, nats: str, etcd: str) -> dict[str, Any]:
    job = "burst"
    sim = SimHandle(job, nats, etcd, BASE_NODES, ops={"burst": run_burst})
    ctl: Controller | None = None
    task: asyncio.Task[None] | None = None
    handled: list[tuple[str, str, float, float]] = []
    try:
        await sim.ready(timeout=120)
        ctl = Controller(controller_config(job, tmp, nats, etcd, planner_process=PROCESS))
        ctl.on_event = lambda eid, outcome, rx, done: handled.append((eid, outcome, rx, done))
        task = asyncio.create_task(ctl.run(), name="bench-ctl-burst")
        await wait_running(ctl, -1, 300)
        await asyncio.sleep(0.5)
        handled.clear()  # the setup's join events
        before = dict(ctl.event_counts)
        batches_before, fsyncs_before = ctl.event_batches, ctl.audit.fsyncs
        burst = await sim.call("burst", timeout=DRAIN_TIMEOUT_S)
        expected = len(burst["sent"]) + len(burst["late"])
        loop = asyncio.get_running_loop()
        end = loop.time() + DRAIN_TIMEOUT_S
        last_n, last_change = -1, loop.time()
        while len(handled) < expected and loop.time() < end:
            if len(handled) != last_n:
                last_n, last_change = len(handled), loop.time()
            elif loop.time() - last_change > STALL_TIMEOUT_S:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)  # anything redelivered or extra would show up here
        pending, unacked = await _consumer_state(nats, Keys(job=job), f"controller-{job}")
        counts = {k: v - before.get(k, 0) for k, v in ctl.event_counts.items()}
        return {
            "burst": burst,
            "handled": list(handled),
            "counts": counts,
            "pending": pending,
            "unacked": unacked,
            "audit": read_records([tmp / f"audit-{job}.jsonl"]),
            "decisions": ctl.decisions,
            "batches": ctl.event_batches - batches_before,
            "fsyncs": ctl.audit.fsyncs - fsyncs_before,
        }
    finally:
        if ctl is not None and task is not None:
            ctl.stopping.set()
            ctl.wake()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(task, 30)
        await sim.stop()


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def report(r: dict[str, Any]) -> None:
    b = r["burst"]
    sent: dict[str, float] = b["sent"]
    late: dict[str, float] = b["late"]
    kinds: dict[str, str] = b["kinds"]
    publishes = len(sent) + b["retried_dropped"] + b["retried_stored"] + len(late)
    print(
        f"\npublished {publishes} events in {b['t1'] - b['t0']:.1f} s "
        f"({publishes / max(b['t1'] - b['t0'], 1e-9):.0f}/s): "
        + ", ".join(f"{k} {v}" for k, v in sorted(collections.Counter(kinds.values()).items()))
        + f", retries {b['retried_dropped'] + b['retried_stored']}"
        f" (dropped by JetStream: {b['retried_dropped']}), late duplicates {len(late)}"
    )
    new = collections.Counter(eid for eid, outcome, *_ in r["handled"] if outcome != "duplicate")
    dup = collections.Counter(eid for eid, outcome, *_ in r["handled"] if outcome == "duplicate")
    lost = [e for e in sent if new[e] == 0]
    twice = [e for e, c in new.items() if c > 1]
    unknown = [e for e in new if e not in sent]
    late_missed = [e for e in late if dup[e] != 1]
    audited = collections.Counter(x.get("event_id") for x in r["audit"] if x["kind"] == "event")
    applied_twice = [e for e, c in audited.items() if c > 1]
    dup_records = sum(1 for x in r["audit"] if x["kind"] == "event_duplicate")
    outcomes = collections.Counter(o for _, o, *_ in r["handled"])
    print(f"controller outcomes: {dict(outcomes)}  (event_counts delta {r['counts']})")
    once = sum(1 for e in sent if new[e] == 1)
    print(
        f"distinct events {len(sent)}: handled as new exactly once {once}, "
        f"lost {len(lost)}, handled twice {len(twice)}, unknown ids {len(unknown)}"
    )
    print(
        f"late duplicates {len(late)}: recorded as duplicate exactly once "
        f"{len(late) - len(late_missed)}, otherwise {len(late_missed)}; "
        f"event_duplicate audit records {dup_records}; event ids audited twice "
        f"{len(applied_twice)}; retries stored by JetStream {b['retried_stored']}"
    )
    print(f"durable consumer at the end: pending {r['pending']}, ack pending {r['unacked']}")
    print(
        f"controller reconcile passes during the run: {r['decisions']}; event batches "
        f"{r['batches']} ({len(r['handled']) / max(r['batches'], 1):.0f} events each); "
        f"audit fsyncs {r['fsyncs']}"
    )
    plans = [x for x in r["audit"] if x["kind"] == "plan"]
    print(
        f"plans computed during the run: {len(plans)}, "
        f"{sum(float(x.get('planning_s', 0)) for x in plans):.1f} s in the planner"
    )
    first = {}
    for eid, outcome, rx, done in r["handled"]:
        key = (eid, outcome == "duplicate")
        first.setdefault(key, (rx, done))
    lat, own = [], []
    by_kind: dict[str, list[float]] = collections.defaultdict(list)
    for (eid, is_dup), (rx, done) in first.items():
        t = late.get(eid) if is_dup else sent.get(eid)
        if t is None:
            continue
        lat.append(done - t)
        own.append(done - rx)
        by_kind["late duplicate" if is_dup else kinds.get(eid, "?")].append(done - t)
    if not lat:
        print("no handled events to time")
        return
    last = max(done for *_, done in r["handled"])
    print(
        f"\nhandling latency (publish -> handled), {len(lat)} events: "
        f"p50 {1000 * statistics.median(lat):.0f} ms, p99 {1000 * _pct(lat, 0.99):.0f} ms, "
        f"max {1000 * max(lat):.0f} ms"
    )
    print(
        f"controller time per event (received -> handled): p50 {1000 * statistics.median(own):.2f}"
        f" ms, p99 {1000 * _pct(own, 0.99):.2f} ms"
    )
    for k, xs in sorted(by_kind.items()):
        print(
            f"  {k:<15} n={len(xs):>5}  p50 {1000 * statistics.median(xs):7.0f} ms  "
            f"p99 {1000 * _pct(xs, 0.99):7.0f} ms"
        )
    print(
        f"drain: first publish -> last event handled {last - b['t0']:.1f} s; "
        f"last publish -> last handled {last - b['t1']:.1f} s"
    )


def main() -> None:
    print(f"machine: {platform.machine()} {platform.processor() or ''} cpus={os.cpu_count()}")
    print(
        f"python {platform.python_version()}; controller in-process (planner=sailor in a "
        f"{'process' if PROCESS else 'thread'}, {MODEL}, "
        f"{BASE_NODES} running 4x {'/'.join(GPU_TYPES)} nodes in {ZONE}); simulated agents and "
        f"publishers in one separate process, {CONCURRENCY} publishes in flight"
    )
    with tempfile.TemporaryDirectory(prefix="sailor-burst-") as d:
        tmp = Path(d)
        with servers(tmp) as (nats, etcd):
            t0 = time.perf_counter()
            result = asyncio.run(scenario(tmp, nats, etcd))
            print(f"run took {time.perf_counter() - t0:.0f} s")
    report(result)


if __name__ == "__main__":
    main()
