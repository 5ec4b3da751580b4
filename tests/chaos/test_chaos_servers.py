"""Chaos scenarios with real processes: faults of the control plane's servers and daemons.

etcd and nats-server restarted, a member of a 3-member etcd or 3-server NATS cluster lost, the
leading controller killed or frozen, an agent cut off (SIGSTOP), duplicate, delayed and
reordered events: each injected into a running secure cluster (nats-server and etcd with TLS,
logins, permissions, RBAC; ``sailor controller`` and ``sailor agent`` processes with real
tiny-gpt workers), which must train on. Each run ends with a drain so that the last step is
committed, and then checks (tests/chaos/harness.py): ``sailor audit`` passes, every loss
equals the uninterrupted run, the last checkpoint's weights equal the uninterrupted run's, and
no committed step was lost. The nodes' faults (notices, SIGKILLs) are in
tests/chaos/test_chaos_nodes.py: two files, so that ``make test`` (``--dist loadfile``) runs
the CI scenarios of each on a worker of its own.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.chaos.harness import STEP_S, ChaosRun, verdict

pytestmark = pytest.mark.chaos


async def test_server_restarts(tmp_path: Path) -> None:
    """etcd SIGKILLed and restarted, then nats-server SIGTERMed and restarted (JetStream file
    store kept), each down 1 s, in one run: training goes on through both in the same layout,
    and the control plane still reconfigures (the drain). One cluster for both faults keeps
    the CI time down (one start-up, one drain, one reference run for the verdict)."""
    # STEP_S, 0.2 s steps: the waits after the faults are counted in them
    async with ChaosRun(tmp_path, "server restarts (etcd, NATS)", min_step_s=STEP_S) as run:
        gen = await run.start(["n1", "n2"])
        for which, hard in (("etcd", True), ("nats", False)):
            server = run.servers.nats if which == "nats" else run.servers.etcd
            run.fault(f"{'SIGKILL' if hard else 'SIGTERM'} {which}, down 1 s, restart")
            await asyncio.to_thread(server.restart, 1.0, hard)
            # training went on, nothing relaunched; >= 1.6 s of steps also let every client
            # reconnect (a notice right after an etcd restart is test_notice_during_etcd_outage)
            await run.advance(gen, 8)
            assert await run.generation() == gen
        out = await run.finish(gen, drain="n2")  # the control plane still reconfigures
    verdict(out, min_reconf=1)


@pytest.mark.chaos_long  # make test: tests/integration/test_runtime_clusters.py, in-process
async def test_cluster_member_losses(tmp_path: Path) -> None:
    """Issue 18, item 9: a 3-member etcd cluster loses a member (SIGKILL) mid-run, then a
    3-server NATS cluster (event stream R3) loses a server; the clients fail over along their
    endpoint lists, training goes on in the same layout, and the drain still reconfigures."""
    sizes = {"nats_servers": 3, "etcd_members": 3}
    async with ChaosRun(tmp_path, "cluster member losses", min_step_s=STEP_S, **sizes) as run:
        gen = await run.start(["n1", "n2"])
        # the first of each list: every etcd client starts on it, so all of them fail over
        run.fault("SIGKILL etcd member 1 of 3")
        await asyncio.to_thread(run.servers.etcd_members[0].kill)
        await run.advance(gen, 5)  # >= 1 s of training after the loss, as after the next
        run.fault("SIGKILL nats server 1 of 3")
        await asyncio.to_thread(run.servers.nats_members[0].kill)
        await run.advance(gen, 5)
        assert await run.generation() == gen  # nothing was relaunched
        out = await run.finish(gen, drain="n2")
    verdict(out, min_reconf=1)


@pytest.mark.chaos_long
async def test_controller_failover_and_fencing(tmp_path: Path) -> None:
    async with ChaosRun(tmp_path, "controller SIGKILL + fencing") as run:
        gen = await run.start(["n1", "n2"], controllers=("c1", "c2"))
        first = run.leader()
        standby = "c2" if first == "c1" else "c1"
        run.fault(f"SIGKILL leader {first}")
        run.cluster.kill_controller(first)
        await run.drive.until(lambda: run.leader() == standby, f"{standby} leads")
        await run.advance(gen, 5)  # the run goes on under the new leader, not relaunched
        run.fault(f"{first} comes back")
        run.cluster.start_controller(first)
        await run.advance(gen, 5)
        run.fault(f"SIGSTOP leader {standby} past its lease, then SIGCONT")
        run.cluster.freeze(run.cluster.controller_process(standby))
        await run.drive.until(lambda: run.leader() == first, f"{first} leads again")
        await run.advance(gen, 3)
        run.cluster.thaw(run.cluster.controller_process(standby))
        await run.advance(gen, 8)  # the thawed old leader changes nothing
        assert await run.generation() == gen
        recs = run.records()
        assert [r["who"] for r in recs if r.get("kind") == "leader"] == [first, standby, first]
        out = await run.finish(gen, drain="n2")
    verdict(out, min_reconf=1)


@pytest.mark.chaos_long
async def test_partition_agent_from_servers(tmp_path: Path) -> None:
    """SIGSTOP of an agent: no lease renewal, no commands, no events; its workers run on."""
    async with ChaosRun(tmp_path, "partition (SIGSTOP agent)") as run:
        gen = await run.start(["n1", "n2", "n3"])
        run.fault("SIGSTOP agent n2 (workers keep running)")
        run.cluster.freeze("agent-n2")
        gen = await run.running_without({"n2"})
        await run.advance(gen, 3)
        run.fault("SIGCONT agent n2 (heals)")
        run.cluster.thaw("agent-n2")
        # it re-registers and joins again: a layout with n2 back in it
        await run.drive.until(
            lambda: run.drive.view.phase == "running" and "n2" in run.placed(), "n2 back"
        )
        gen = run.drive.view.generation
        out = await run.finish(gen, drain="n3")
    verdict(out, min_reconf=3)


@pytest.mark.chaos_long
async def test_duplicate_delayed_and_reordered_events(tmp_path: Path) -> None:
    """Events only wake the controller (level-triggered): none of these changes the layout."""
    import time

    from sailor.coordination import Keys, NatsEventBus, connect_nats
    from sailor.schemas.events import Heartbeat, NodeJoined, NodeLeft, WorkerFailed
    from sailor.schemas.hardware import NodeSpec

    async with ChaosRun(tmp_path, "duplicate/delayed/reordered events") as run:
        gen = await run.start(["n1", "n2"])
        # n1's own login: what a confused (or replaying) agent n1 can publish
        run.fault("12 duplicate, 300 s old and reordered events from n1's login")
        sec = run.servers.security("n1")
        nc = await connect_nats(run.servers.nats_url, "n1-replay", security=sec)
        bus = NatsEventBus(nc, Keys(job=run.cluster.job), durable="unused", source="n1")
        now = time.time()
        spec = NodeSpec(node_id="n1", gpu_type="cpu", gpus=1, zone="local-a", address="127.0.0.1")
        joined = NodeJoined(event_id="chaos-join", node_id="n1", time=now, node=spec)
        stale_left = NodeLeft(event_id="chaos-left-old", node_id="n1", time=now - 300, reason="x")
        old_fail = WorkerFailed(
            event_id="chaos-fail-old", node_id="n1", time=now - 300, plan_id="gone", cause="old"
        )
        beats = [
            Heartbeat(event_id=f"chaos-beat-{i}", node_id="n1", time=now - i, step=i)
            for i in range(5)
        ]
        try:
            run.drive.note("same event twice under one msg id (stream dedup)")
            assert await bus.publish("node_joined", joined.model_dump_json().encode(), "m-1")
            assert not await bus.publish("node_joined", joined.model_dump_json().encode(), "m-1")
            run.drive.note("same event id under new msg ids (controller dedup)")
            for mid in ("m-2", "m-3"):
                await bus.publish("node_joined", joined.model_dump_json().encode(), mid)
            run.drive.note("delayed: a 300 s old NodeLeft and WorkerFailed of a live node")
            await bus.publish("node_left", stale_left.model_dump_json().encode(), "m-4")
            await bus.publish("worker_failed", old_fail.model_dump_json().encode(), "m-5")
            run.drive.note("reordered: leave before join, heartbeats newest first")
            left2 = stale_left.model_copy(update={"event_id": "chaos-left-2", "time": now + 1})
            await bus.publish("node_left", left2.model_dump_json().encode(), "m-6")
            join2 = joined.model_copy(update={"event_id": "chaos-join-2", "time": now})
            await bus.publish("node_joined", join2.model_dump_json().encode(), "m-7")
            for b in beats:
                await bus.publish("heartbeat", b.model_dump_json().encode(), b.event_id)
        finally:
            await nc.close()
        await run.advance(gen, 10)
        assert await run.generation() == gen  # nothing was relaunched
        recs = run.records()
        assert sum(r.get("kind") == "event_duplicate" for r in recs) >= 2
        out = await run.finish(gen, drain="n2")
    verdict(out, min_reconf=1)
