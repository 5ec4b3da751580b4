"""Two agents with one node id, on real etcd and NATS: the second does not take the first's
registration over. It waits one lease TTL (an agent that crashed leaves its record until
its lease lapses), then refuses to start naming both addresses, and stops without a
NodeLeft and without touching ``nodes/<id>``. Before, its plain put replaced the first's
record, and when it stopped the key was gone while the first still ran. An agent started
again after a crash still registers, once the old lease has lapsed."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import pytest

from sailor.agent.agent_config import AgentConfig, CheckSettings
from sailor.agent.daemon import CLAIM_GRACE_S, Agent
from sailor.coordination import (
    DaemonFailedError,
    Keys,
    NatsCommands,
    NatsEventBus,
    connect_etcd,
    connect_nats,
)
from sailor.coordination.etcd_store import EtcdStore
from sailor.localservers import LocalServers
from sailor.schemas.hardware import NodeSpec
from tests.integration.cluster_kit import event_stream

pytestmark = pytest.mark.usefixtures("no_task_leak")

JOB = "t"
KEYS = Keys(job=JOB)
TTL = 2


def _agent(servers: LocalServers, work: Path, address: str) -> Agent:
    return Agent(
        AgentConfig(
            job=JOB,
            node=NodeSpec(node_id="n1", gpu_type="A100-40", gpus=1, zone="z-a-1", address=address),
            nats_url=servers.nats_url,
            etcd_endpoint=servers.etcd_endpoint,
            lease_ttl_s=TTL,
            work_dir=work,
            security=servers.security("n1"),
            check=CheckSettings(mode="off"),
        )
    )


async def _registered(store: EtcdStore, timeout: float = 15.0) -> NodeSpec:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        kv = await store.get(KEYS.node("n1"))
        if kv is not None:
            return NodeSpec.model_validate_json(kv.value)
        await asyncio.sleep(0.1)
    raise AssertionError("n1 never registered")


async def test_a_second_agent_of_the_same_node_id_refuses_to_start(
    servers: LocalServers, tmp_path: Path
) -> None:
    store = await connect_etcd(servers.etcd_endpoint, security=servers.security("c1"))
    nc = await connect_nats(servers.nats_url, "c1", security=servers.security("c1"))
    first = _agent(servers, tmp_path / "vm-a", "10.0.0.1")
    first_task = asyncio.create_task(first.run(), name="agent-first")
    try:
        bus = NatsEventBus(nc, KEYS, durable="dup-test")
        await bus.ensure_stream()
        assert (await _registered(store)).address == "10.0.0.1"
        kv = await store.get(KEYS.node("n1"))
        assert kv is not None
        lease = kv.lease
        second = _agent(servers, tmp_path / "vm-b", "10.0.0.2")
        t0 = time.monotonic()
        with pytest.raises(DaemonFailedError) as err:
            await asyncio.wait_for(second.run(), TTL + CLAIM_GRACE_S + 15)
        waited = time.monotonic() - t0
        assert waited >= TTL  # it gave a crashed holder's lease the time to lapse
        reason = str(err.value)
        assert "'n1'" in reason and "10.0.0.1" in reason and "10.0.0.2" in reason
        assert second.held_elsewhere
        # the first agent's registration is untouched, and stays after the second is gone
        await asyncio.sleep(TTL + 0.5)
        kv = await store.get(KEYS.node("n1"))
        assert kv is not None and kv.lease == lease
        assert NodeSpec.model_validate_json(kv.value).address == "10.0.0.1"
        assert not first_task.done()
        kinds = []
        while batch := await bus.fetch(20, timeout=0.5):
            for d in batch:
                kinds.append(d.subject.rsplit(".", 1)[1])
                await d.ack()
        assert kinds == ["node_joined"]  # the second neither joined nor left
        await bus.close()
    finally:
        first.stopping.set()
        await asyncio.wait_for(first_task, 15)
        await nc.close()
        await store.close()


async def test_an_agent_restarted_after_a_crash_registers_once_the_old_lease_lapses(
    servers: LocalServers, tmp_path: Path
) -> None:
    await event_stream(servers, JOB)  # the joins and the leave stored at once
    store = await connect_etcd(servers.etcd_endpoint, security=servers.security("c1"))
    first = _agent(servers, tmp_path / "vm-a", "10.0.0.1")
    first_task = asyncio.create_task(first.run(), name="agent-first")
    again: Agent | None = None
    again_task = None
    try:
        await _registered(store)
        old = await store.get(KEYS.node("n1"))
        assert old is not None
        await first.crash()  # its lease is left to expire, its record with it
        first.stopping.set()
        await asyncio.wait_for(first_task, 15)
        again = _agent(servers, tmp_path / "vm-a", "10.0.0.1")
        again_task = asyncio.create_task(again.run(), name="agent-again")
        end = time.monotonic() + TTL + CLAIM_GRACE_S + 10
        while time.monotonic() < end:
            kv = await store.get(KEYS.node("n1"))
            if kv is not None and kv.lease != old.lease:
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("the restarted agent did not register")
        assert not again_task.done() and again.failure is None
    finally:
        if again is not None and again_task is not None:
            again.stopping.set()
            await asyncio.wait_for(again_task, 15)
        await store.close()


class _Recording(Agent):
    """An agent that records whether it served its command subject."""

    served = False

    async def _serve(self, commands: NatsCommands) -> None:
        self.served = True
        await super()._serve(commands)


async def test_of_two_agents_started_together_only_the_registered_one_serves_commands(
    servers: LocalServers, tmp_path: Path
) -> None:
    """Both found the key free (a read), both served commands until the loser's claim came
    and refused it: commands of the node were answered by whichever replied first."""
    await event_stream(servers, JOB)  # the join and the leave stored at once
    store = await connect_etcd(servers.etcd_endpoint, security=servers.security("c1"))
    a = _Recording(_agent(servers, tmp_path / "vm-a", "10.0.0.1").cfg)
    b = _Recording(_agent(servers, tmp_path / "vm-b", "10.0.0.2").cfg)
    tasks = {
        a: asyncio.create_task(a.run(), name="agent-a"),
        b: asyncio.create_task(b.run(), name="agent-b"),
    }
    try:
        done, _ = await asyncio.wait(
            tasks.values(), timeout=TTL + CLAIM_GRACE_S + 20, return_when=asyncio.FIRST_COMPLETED
        )
        assert len(done) == 1
        loser = a if tasks[a] in done else b
        winner = b if loser is a else a
        with pytest.raises(DaemonFailedError):
            await tasks[loser]
        assert loser.held_elsewhere and not loser.served
        assert winner.served
        spec = await _registered(store)
        assert spec.address == winner.node.address
    finally:
        for agent, task in tasks.items():
            agent.stopping.set()
            with contextlib.suppress(DaemonFailedError):
                await asyncio.wait_for(task, 15)
        await store.close()
