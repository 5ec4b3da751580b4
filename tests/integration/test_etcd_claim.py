"""``EtcdStore.claim`` and ``EtcdStore.lease_ttl`` on real etcd, and an agent restarted after a
crash on an etcd whose minimum lease TTL exceeds the agent's ``lease_ttl_s``.

The claim is what keeps two agents of one node id apart: of many claims at once exactly one
wins, a claim under the holder's own lease (its registration again) rewrites the record, and
another lease gets the holder's record back, unchanged. etcd raises every lease to its
minimum TTL (1.5 election timeouts): an agent that waited its configured TTL and a second for
a crashed predecessor's lease refused itself as a duplicate (``node_id_in_use`` naming its
own address twice); it now waits the TTL etcd granted that lease.

On plain servers: these are about the claim and the lease, not about RBAC (the duplicate-id
tests run the same wait on the secure servers).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sailor.agent.agent_config import AgentConfig, CheckSettings
from sailor.agent.daemon import Agent
from sailor.coordination import (
    DaemonFailedError,
    EtcdStore,
    Keys,
    TemporaryError,
    connect_etcd,
)
from sailor.localnet import free_port
from sailor.localservers import LocalServers, ServerMissingError, ServerProcess, server_binaries
from sailor.schemas.hardware import NodeSpec
from tests.integration.cluster_kit import event_stream

pytestmark = pytest.mark.usefixtures("no_task_leak")

KEYS = Keys(job="claim")

MIN_TTL_S = 5
"""etcd's minimum lease TTL with a 300 ms heartbeat and a 3 s election timeout (WAN-like
settings): 1.5 x 10 election ticks of 300 ms (4.5 s), rounded up. Far enough above the
agent's 1 s (plus the second of grace) that a restart's own start-up does not hide the
difference: the restarted agent claims ~0.2 s after the crash (its predecessor's join no
longer retried against a missing stream: up to 5 s before), so waiting the configured 2 s
would refuse it ~2.5 s before the crashed lease lapses. Was 8 s (500 ms / 5 s)."""


async def _until_leader(endpoint: str) -> None:
    """Until the member answers: its first election takes an election timeout or two."""
    for _ in range(300):
        try:
            store = await connect_etcd(endpoint)
        except TemporaryError:
            await asyncio.sleep(0.1)
            continue
        try:
            await store.revision()
            return
        except TemporaryError:
            await asyncio.sleep(0.1)
        finally:
            await store.close()
    raise AssertionError(f"etcd at {endpoint} elected no leader")


@pytest.fixture(scope="module")
def slow_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One etcd member with a 3 s election timeout (WAN-like settings), shared by the
    module's tests: its endpoint. Leases it grants last at least ``MIN_TTL_S``."""
    try:
        binary = server_binaries()[1]
    except ServerMissingError as exc:
        pytest.skip(str(exc))
    tmp_path = tmp_path_factory.mktemp("slow-etcd")
    port, peer = free_port(), free_port()
    argv = [
        *(binary, "--name", "wan", "--data-dir", str(tmp_path / "etcd")),
        *("--listen-client-urls", f"http://127.0.0.1:{port}"),
        *("--advertise-client-urls", f"http://127.0.0.1:{port}"),
        *("--listen-peer-urls", f"http://127.0.0.1:{peer}"),
        *("--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}"),
        *("--initial-cluster", f"wan=http://127.0.0.1:{peer}"),
        *("--heartbeat-interval", "300", "--election-timeout", "3000", "--log-level", "warn"),
    ]
    server = ServerProcess("etcd", argv, port, tmp_path / "etcd.log")
    server.start()
    endpoint = f"127.0.0.1:{port}"
    try:
        asyncio.run(_until_leader(endpoint))
        yield endpoint
    finally:
        server.stop()


async def _store(plain_servers: LocalServers) -> EtcdStore:
    return await connect_etcd(plain_servers.etcd_endpoint)


async def test_of_many_claims_at_once_exactly_one_wins(plain_servers: LocalServers) -> None:
    store = await _store(plain_servers)
    try:
        leases = [await store.lease(5) for _ in range(8)]
        key = KEYS.node("n1")
        results = await asyncio.gather(
            *(store.claim(key, f"agent-{i}".encode(), lease) for i, lease in enumerate(leases))
        )
        winners = [i for i, held in enumerate(results) if held is None]
        assert len(winners) == 1
        kv = await store.get(key)
        assert kv is not None and kv.lease == leases[winners[0]].id
        assert kv.value == f"agent-{winners[0]}".encode()
        for held in results:  # every loser got the winner's record back
            assert held is None or (held.lease, held.value) == (kv.lease, kv.value)
        for lease in leases:
            await lease.revoke()
    finally:
        await store.close()


async def test_a_claim_under_its_own_lease_rewrites_and_another_lease_is_refused(
    plain_servers: LocalServers,
) -> None:
    store = await _store(plain_servers)
    try:
        ours, theirs = await store.lease(5), await store.lease(5)
        key = KEYS.node("n2")
        assert await store.claim(key, b"v1", ours) is None
        first = await store.get(key)
        assert first is not None
        assert await store.claim(key, b"v2", ours) is None  # registration again: rewritten
        again = await store.get(key)
        assert again is not None and again.value == b"v2" and again.lease == ours.id
        assert again.create_revision == first.create_revision
        held = await store.claim(key, b"other", theirs)
        assert held is not None and held.lease == ours.id and held.value == b"v2"
        after = await store.get(key)
        assert after is not None and after.mod_revision == again.mod_revision  # unchanged
        await ours.revoke()  # the holder gone: the key is free to the other lease
        assert await store.claim(key, b"other", theirs) is None
        await theirs.revoke()
    finally:
        await store.close()


async def test_lease_ttl_is_what_etcd_granted(slow_etcd: str) -> None:
    store = await connect_etcd(slow_etcd)
    try:
        lease = await store.lease(1)
        ttl = await store.lease_ttl(lease.id)
        assert ttl is not None
        remaining, granted = ttl
        assert granted == MIN_TTL_S  # raised from the 1 s asked
        assert 0 < remaining <= granted
        await lease.revoke()
        assert await store.lease_ttl(lease.id) is None
    finally:
        await store.close()


def _agent(plain_servers: LocalServers, endpoint: str, work: Path) -> Agent:
    return Agent(
        AgentConfig(
            job=KEYS.job,
            node=NodeSpec(
                node_id="n1", gpu_type="A100-40", gpus=1, zone="z-a-1", address="10.0.0.1"
            ),
            nats_url=plain_servers.nats_url,
            etcd_endpoint=endpoint,
            lease_ttl_s=1,
            work_dir=work,
            check=CheckSettings(mode="off"),
        )
    )


async def test_an_agent_restarted_after_a_crash_waits_the_granted_ttl(
    plain_servers: LocalServers, slow_etcd: str, tmp_path: Path
) -> None:
    await event_stream(plain_servers, KEYS.job)  # the joins and the leave stored at once
    store = await connect_etcd(slow_etcd)
    first = _agent(plain_servers, slow_etcd, tmp_path)
    first_task = asyncio.create_task(first.run(), name="agent-first")
    again: Agent | None = None
    again_task = None
    try:
        for _ in range(150):
            old = await store.get(KEYS.node("n1"))
            if old is not None:
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("n1 never registered")
        await first.crash()  # its lease (5 s, not the 1 s asked) is left to expire
        first.stopping.set()
        await asyncio.wait_for(first_task, 15)
        again = _agent(plain_servers, slow_etcd, tmp_path)  # the same VM, restarted
        again_task = asyncio.create_task(again.run(), name="agent-again")
        end = time.monotonic() + MIN_TTL_S + 10
        while time.monotonic() < end and not again_task.done():
            kv = await store.get(KEYS.node("n1"))
            if kv is not None and kv.lease != old.lease:
                break
            await asyncio.sleep(0.1)
        assert again.failure is None, again.failure
        assert not again_task.done()
        kv = await store.get(KEYS.node("n1"))
        assert kv is not None and kv.lease != old.lease  # registered under its new lease
    finally:
        if again is not None and again_task is not None:
            again.stopping.set()
            await asyncio.wait_for(again_task, 15)
        await store.close()


async def test_a_node_key_without_a_lease_is_refused_after_the_ttl(
    plain_servers: LocalServers, tmp_path: Path
) -> None:
    """A node key written without a lease (lease 0: an operator's ``etcdctl put``) never
    lapses: the agent refuses after its configured TTL and the grace, naming lease 0 and
    what to do. Before, lease 0 read as a lapsed lease: the agent claimed again every
    0.05 s for ever, without a word."""
    ep = plain_servers.etcd_endpoint
    store = await connect_etcd(ep)
    key = KEYS.node("n1")
    await store.client.put(key.encode(), b"{}")
    agent = _agent(plain_servers, ep, tmp_path)  # lease_ttl_s=1: refused at ~2 s
    task = asyncio.create_task(agent.run(), name="agent")
    try:
        done, _ = await asyncio.wait({task}, timeout=10)
        assert task in done, "the agent still waits on a key that never lapses"
        with pytest.raises(DaemonFailedError, match=r"without a lease \(lease 0"):
            task.result()
        assert agent.held_elsewhere and agent.failure is not None
        assert f"etcdctl del {key}" in agent.failure
    finally:
        if not task.done():
            agent.stopping.set()
            await asyncio.wait({task}, timeout=15)
        await store.delete(key)
        await store.close()
