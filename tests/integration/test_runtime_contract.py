"""Contract tests of the coordination protocols against the real servers (no mocks).

Plain servers (no TLS, no auth), the one exception to the secure fixtures: these test the
backends' own contract (guarded writes, leases, fencing, dedup, redelivery, request/reply),
which does not depend on auth, and one client plays the controller and an agent at once,
which the per-node permissions forbid by design. The same calls over TLS with logins,
permissions and RBAC are in ``test_security_*.py``.
"""

from __future__ import annotations

import asyncio

import pytest

from sailor.coordination import (
    ChangedError,
    FencedError,
    Keys,
    KeyValue,
    NatsCommands,
    NatsEventBus,
    PrefixMirror,
    TemporaryError,
    UnavailableError,
    campaign,
    connect_etcd,
    connect_nats,
)
from sailor.localservers import LocalServers, ServerProcess

pytestmark = pytest.mark.usefixtures("no_task_leak")

KEYS = Keys(job="contract")


@pytest.fixture
def servers(plain_servers: LocalServers) -> LocalServers:
    """This module's servers are plain (see the docstring); the URL fixtures follow them."""
    return plain_servers


async def test_state_store_guarded_writes_and_leases(etcd_endpoint: str) -> None:
    store = await connect_etcd(etcd_endpoint)
    try:
        assert await store.get("/x") is None
        await store.put("/x", b"1")
        kv = await store.get("/x")
        assert kv is not None and kv.value == b"1"
        # guard on a key that does not exist: create_revision 0
        with pytest.raises(FencedError):
            await store.put_guarded("/y", b"2", guard_key="/leader", epoch=5)
        lease = await store.lease(2)
        created = await store.create_if_absent("/leader", b"me", lease)
        assert created is not None and created.lease == lease.id
        epoch = created.create_revision
        await store.put_guarded("/y", b"2", guard_key="/leader", epoch=epoch)
        assert [k.key for k in await store.get_prefix("/")] == ["/leader", "/x", "/y"]
        # a second create does not overwrite
        other = await store.lease(2)
        again = await store.create_if_absent("/leader", b"you", other)
        assert again is not None and again.value == b"me"
        await other.revoke()
        # the lease keeps the key alive beyond its TTL while kept alive
        await asyncio.sleep(2.5)
        assert await store.get("/leader") is not None
        await lease.revoke()
        assert await store.get("/leader") is None
        # revoked leases are not kept (a standby campaigning every second kept one each time)
        for _ in range(5):
            await (await store.lease(2)).revoke()
        last = await store.lease(2)
        assert store._leases == [last]
        await last.revoke()
        with pytest.raises(FencedError):
            await store.delete_guarded("/y", guard_key="/leader", epoch=epoch)
    finally:
        await store.close()


async def test_election_epochs_grow_and_deposed_leader_is_fenced(etcd_endpoint: str) -> None:
    a = await connect_etcd(etcd_endpoint)
    b = await connect_etcd(etcd_endpoint)
    try:
        first = await campaign(a, KEYS.leader, "a", ttl=1, timeout=5)
        waiting = asyncio.create_task(campaign(b, KEYS.leader, "b", ttl=1, timeout=10))
        await asyncio.sleep(0.5)
        assert not waiting.done()
        await first.abandon()  # crash: the lease expires after its TTL
        second = await asyncio.wait_for(waiting, 10)
        assert second.epoch > first.epoch
        with pytest.raises(FencedError):
            await a.put_guarded(KEYS.desired, b"old", KEYS.leader, first.epoch)
        await b.put_guarded(KEYS.desired, b"new", KEYS.leader, second.epoch)
        await second.resign()
    finally:
        await a.close()
        await b.close()


async def test_event_bus_dedups_and_redelivers_unacked(nats_url: str) -> None:
    nc = await connect_nats(nats_url, "contract")
    try:
        bus = NatsEventBus(nc, KEYS, durable="controller", ack_wait=1.0)
        await bus.ensure_stream()
        assert await bus.publish("node_joined", b"a", msg_id="e1") is True
        assert await bus.publish("node_joined", b"a", msg_id="e1") is False  # duplicate
        assert await bus.publish("node_left", b"b", msg_id="e2") is True
        got = await bus.fetch(10, timeout=1.0)
        assert [d.msg_id for d in got] == ["e1", "e2"]
        await got[0].ack()
        await bus.close()
        # e2 was never acked: a new consumer instance of the same durable gets it again
        bus2 = NatsEventBus(nc, KEYS, durable="controller", ack_wait=1.0)
        await bus2.ensure_stream()
        again: list[str] = []
        for _ in range(40):
            again += [d.msg_id for d in await bus2.fetch(10, timeout=1.0)]
            if again:
                break
        assert again == ["e2"]
        await bus2.close()
    finally:
        await nc.close()


async def test_event_bus_ack_wait_is_not_needed_after_ack(nats_url: str) -> None:
    nc = await connect_nats(nats_url, "contract")
    try:
        bus = NatsEventBus(nc, KEYS, durable="c2")
        await bus.ensure_stream()
        for i in range(50):
            await bus.publish("heartbeat", str(i).encode(), msg_id=f"h{i}")
        seen: list[bytes] = []
        while len(seen) < 50:
            batch = await bus.fetch(20, timeout=1.0)
            assert batch, "events lost"
            for d in batch:
                seen.append(d.data)
                await d.ack()
        assert seen == [str(i).encode() for i in range(50)]
        assert await bus.fetch(10, timeout=0.3) == []
        await bus.close()
    finally:
        await nc.close()


async def test_commands_request_reply(nats_url: str) -> None:
    nc = await connect_nats(nats_url, "contract")
    try:
        agent = NatsCommands(nc, KEYS)
        ctl = NatsCommands(nc, KEYS)

        async def handler(data: bytes) -> bytes:
            return b"ack:" + data

        await agent.serve("node-1", handler)
        assert await ctl.request("node-1", b"go", timeout=2) == b"ack:go"
        with pytest.raises(UnavailableError):
            await ctl.request("node-2", b"go", timeout=0.5)
        await agent.close()
    finally:
        await nc.close()


async def test_connect_to_dead_server_fails_fast() -> None:
    from tests.integration.conftest import free_port

    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(UnavailableError):
        await connect_nats(f"nats://127.0.0.1:{free_port()}", "dead", timeout=1.0)
    with pytest.raises(UnavailableError):
        await connect_etcd(f"127.0.0.1:{free_port()}", op_timeout=1.0)
    assert loop.time() - t0 < 10


async def test_clients_survive_server_restarts(
    nats_server: object, etcd_server: object, nats_url: str, etcd_endpoint: str
) -> None:
    from tests.integration.conftest import Server

    assert isinstance(nats_server, Server) and isinstance(etcd_server, Server)
    store = await connect_etcd(etcd_endpoint)
    nc = await connect_nats(nats_url, "restart")
    try:
        lease = await store.lease(3)
        await store.put("/n", b"1", lease=lease)
        bus = NatsEventBus(nc, KEYS, durable="r")
        await bus.ensure_stream()
        await bus.publish("heartbeat", b"before", msg_id="b1")
        await asyncio.to_thread(etcd_server.restart)
        await asyncio.to_thread(nats_server.restart)
        for _ in range(100):
            try:
                await store.put("/m", b"2")
                await bus.publish("heartbeat", b"after", msg_id="a1")
                break
            except UnavailableError:
                await asyncio.sleep(0.1)
            except Exception:
                await asyncio.sleep(0.1)
        await asyncio.sleep(1.5)
        assert lease.alive
        assert await store.get("/n") is not None  # the lease survived the restart
        got: list[bytes] = []
        for _ in range(20):
            for d in await bus.fetch(10, timeout=0.5):
                got.append(d.data)
                await d.ack()
            if b"after" in got:
                break
        assert got == [b"before", b"after"]
        await bus.close()
        await lease.revoke()
    finally:
        await nc.close()
        await store.close()


async def _until(cond: object, mirror: PrefixMirror | None = None, timeout: float = 10.0) -> None:
    """Poll ``cond()`` (running the mirror's staleness check, as the controller's poll does)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():  # type: ignore[operator]
        assert loop.time() < end, "condition not reached"
        if mirror is not None:
            await mirror.check()
        await asyncio.sleep(0.05)


async def test_prefix_mirror_follows_deltas_and_recovers_a_silent_watch(
    etcd_endpoint: str,
) -> None:
    store = await connect_etcd(etcd_endpoint)
    woken: list[int] = []
    deleted: list[str] = []
    m = PrefixMirror(
        store,
        "/mirror/",
        on_change=lambda: woken.append(1),
        stale_after_s=0.0,
        on_delete=deleted.append,
    )
    try:
        await store.put("/mirror/a", b"1")
        await m.start()
        a = m.get("/mirror/a")
        assert a is not None and a.value == b"1" and m.changed() == {"/mirror/a"}
        lease = await store.lease(60)
        await store.put("/mirror/b", b"2", lease=lease)
        await store.put("/mirror/a", b"3")
        await store.put("/mirrors-not", b"x")  # outside the prefix
        await _until(lambda: m.get("/mirror/b") is not None and m.get("/mirror/a").value == b"3")  # type: ignore[union-attr]
        assert m.changed() == {"/mirror/a", "/mirror/b"} and woken
        assert set(m.items()) == {"/mirror/a", "/mirror/b"}
        await lease.revoke()  # a lease that ends deletes its keys: a delete delta
        await _until(lambda: m.get("/mirror/b") is None)
        assert m.changed() == {"/mirror/b"} and await m.check()
        assert deleted == ["/mirror/b"]  # told which key went, once
        lease_e = await store.lease(60)
        await store.put("/mirror/e", b"6", lease=lease_e)
        await _until(lambda: m.get("/mirror/e") is not None)
        m.changed()
        # a watch that stops without an error (as aetcd's may when etcd restarts)
        assert m._watch is not None
        m._watch.cancel()
        await asyncio.sleep(0.05)
        await store.put("/mirror/c", b"4")
        await lease_e.revoke()  # deleted while nobody watches: the re-read finds it gone
        assert not await m.check()  # differs from the server: suspect
        assert not await m.check()  # and no delta came since: re-read, watch again
        assert m.get("/mirror/c") is not None and m.resyncs == 1
        assert m.changed() == {"/mirror/c", "/mirror/e"}
        assert deleted == ["/mirror/b", "/mirror/e"]
        await store.put("/mirror/d", b"5")
        await _until(lambda: m.get("/mirror/d") is not None)  # by the new watch
        assert await m.check() and m.resyncs == 1
    finally:
        await m.close()
        await store.close()


async def test_prefix_mirror_applies_every_key_one_transaction_changes(
    etcd_endpoint: str,
) -> None:
    """The keys one transaction writes or deletes share its revision; each is applied (the
    leader re-points several commit records, and deletes the request, in one). Before, only
    the first delta of a revision was: the others stayed as they were, and ``check`` agreed
    (the copy's key count and highest mod revision were the server's), so for good."""
    store = await connect_etcd(etcd_endpoint)
    m = PrefixMirror(store, "/mtx/", stale_after_s=0.0)
    try:
        await store.put("/mtx-guard", b"")
        guard = await store.get("/mtx-guard")
        assert guard is not None
        for key in ("/mtx/a", "/mtx/b", "/mtx/c"):
            await store.put(key, b"old")
        await m.start()
        await store.put_all_guarded(
            [("/mtx/a", b"new"), ("/mtx/b", b"new"), ("/mtx/d", b"new")],
            "/mtx-guard",
            guard.create_revision,
            delete=("/mtx/c",),
        )

        def values() -> dict[str, bytes]:
            return {k: kv.value for k, kv in m.items().items()}

        want = {"/mtx/a": b"new", "/mtx/b": b"new", "/mtx/d": b"new"}
        await _until(lambda: values() == want, m, timeout=3.0)
        assert await m.check()
    finally:
        await m.close()
        await store.close()


async def test_the_prefix_fingerprint_tells_a_stalled_copy_not_a_dropped_delta(
    etcd_endpoint: str,
) -> None:
    """What ``prefix_fingerprint`` (key count, highest mod revision) tells, as its
    docstring and the mirror's say: a copy stopped at a revision differs from the server
    once a key was written or deleted since; a copy that dropped one key of a transaction
    that wrote two (same revision, same count) does not."""
    store = await connect_etcd(etcd_endpoint)
    try:

        def fingerprint(kvs: dict[str, KeyValue]) -> tuple[int, int]:
            return len(kvs), max((kv.mod_revision for kv in kvs.values()), default=0)

        await store.put("/mfp-guard", b"")
        guard = await store.get("/mfp-guard")
        assert guard is not None
        for key in ("/mfp/a", "/mfp/b", "/mfp/c"):
            await store.put(key, b"old")
        _, kvs = await store.get_prefix_at("/mfp/")
        stalled = {kv.key: kv for kv in kvs}  # a copy whose watch stops here
        await store.delete("/mfp/c")
        assert await store.prefix_fingerprint("/mfp/") != fingerprint(stalled)
        _, kvs = await store.get_prefix_at("/mfp/")
        stalled = {kv.key: kv for kv in kvs}
        await store.put_all_guarded(
            [("/mfp/a", b"new"), ("/mfp/b", b"new")], "/mfp-guard", guard.create_revision
        )
        assert await store.prefix_fingerprint("/mfp/") != fingerprint(stalled)
        _, kvs = await store.get_prefix_at("/mfp/")
        dropped = {kv.key: kv for kv in kvs}
        dropped["/mfp/b"] = stalled["/mfp/b"]  # b's delta of the transaction dropped
        assert await store.prefix_fingerprint("/mfp/") == fingerprint(dropped)
    finally:
        await store.close()


async def test_prefix_mirror_survives_an_etcd_restart(
    etcd_server: ServerProcess, etcd_endpoint: str
) -> None:
    store = await connect_etcd(etcd_endpoint)
    m = PrefixMirror(store, "/mirror2/")
    try:
        await store.put("/mirror2/a", b"1")
        await m.start()
        await asyncio.to_thread(etcd_server.restart)
        for _ in range(100):
            try:
                await store.put("/mirror2/b", b"2")
                break
            except TemporaryError:
                await asyncio.sleep(0.1)
        await _until(lambda: m.get("/mirror2/b") is not None, mirror=m, timeout=20)
        assert m.get("/mirror2/a") is not None
    finally:
        await m.close()
        await store.close()


async def test_put_all_guarded_writes_its_marks_bound_to_the_lease(etcd_endpoint: str) -> None:
    """``marks``: empty keys written in the transaction, bound to the lease (gone with it),
    written only when the transaction is; marks without a lease are refused, naming them."""
    store = await connect_etcd(etcd_endpoint)
    try:
        lease = await store.lease(5)
        created = await store.create_if_absent("/mk/leader", b"me", lease)
        assert created is not None
        await store.put("/mk/req", b"r")
        req = await store.get("/mk/req")
        assert req is not None
        epoch = created.create_revision
        with pytest.raises(ChangedError):
            await store.put_all_guarded(
                [], "/mk/leader", epoch, delete=("/mk/req",), expect={"/mk/req": 1},
                marks=("/mk/taken",), lease=lease,
            )  # fmt: skip
        assert await store.get("/mk/taken") is None  # refused: no mark
        await store.put_all_guarded(
            [], "/mk/leader", epoch, delete=("/mk/req",),
            expect={"/mk/req": req.mod_revision}, marks=("/mk/taken",), lease=lease,
        )  # fmt: skip
        mark = await store.get("/mk/taken")
        assert mark is not None and mark.value == b"" and mark.lease == lease.id
        assert await store.get("/mk/req") is None
        with pytest.raises(ValueError, match=r"marks \['/mk/x'\] need a lease"):
            await store.put_all_guarded([], "/mk/leader", epoch, marks=("/mk/x",))
        await lease.revoke()
        assert await store.get("/mk/taken") is None
    finally:
        await store.close()


async def test_put_guarded_takes_the_revision_from_its_own_transaction(
    etcd_endpoint: str,
) -> None:
    """A call after the write that fails must not turn the write's success into an error
    (the caller would retry a write that happened): the revision is the transaction's own."""
    store = await connect_etcd(etcd_endpoint)
    try:
        lease = await store.lease(5)
        created = await store.create_if_absent("/g/leader", b"me", lease)
        assert created is not None
        calls: list[str] = []

        async def failing_revision() -> int:
            calls.append("revision")
            raise UnavailableError("etcd unavailable after the write")

        store.revision = failing_revision  # type: ignore[method-assign]
        rev = await store.put_guarded("/g/desired", b"v", "/g/leader", created.create_revision)
        kv = await store.get("/g/desired")
        assert kv is not None and kv.value == b"v" and kv.mod_revision == rev
        assert calls == []
        with pytest.raises(FencedError):
            await store.put_guarded("/g/desired", b"w", "/g/leader", created.create_revision + 1)
        await store.delete_guarded("/g/desired", "/g/leader", created.create_revision)
        assert await store.get("/g/desired") is None
        await lease.revoke()
    finally:
        await store.close()


async def test_put_all_guarded_writes_every_key_or_none(etcd_endpoint: str) -> None:
    """Online calibration keeps a version and its pointer in one guarded transaction."""
    store = await connect_etcd(etcd_endpoint)
    try:
        lease = await store.lease(5)
        created = await store.create_if_absent("/m/leader", b"me", lease)
        assert created is not None
        epoch = created.create_revision
        await store.put("/m/v/1", b"old")
        await store.put_all_guarded(
            [("/m/v/2", b"two"), ("/m/current", b"2")], "/m/leader", epoch, delete=["/m/v/1"]
        )
        assert [(k.key, k.value) for k in await store.get_prefix("/m/")] == [
            ("/m/current", b"2"),
            ("/m/leader", b"me"),
            ("/m/v/2", b"two"),
        ]
        with pytest.raises(FencedError):
            await store.put_all_guarded(
                [("/m/v/3", b"x"), ("/m/current", b"3")], "/m/leader", epoch + 1
            )
        assert await store.get("/m/v/3") is None
        current = await store.get("/m/current")
        assert current is not None and current.value == b"2"
        await lease.revoke()
    finally:
        await store.close()


async def test_a_request_is_taken_by_the_leader_or_withdrawn_never_both(
    etcd_endpoint: str,
) -> None:
    """An operator's request: the leader's write that applies it compares its revision and
    deletes it; the operator's withdrawal deletes it only while it is as written. Whichever
    comes second is refused, and the leader learns it was a withdrawal, not a fencing."""
    store = await connect_etcd(etcd_endpoint)
    try:
        lease = await store.lease(60)
        created = await store.create_if_absent("/r/leader", b"me", lease)
        assert created is not None
        epoch = created.create_revision
        rev = await store.put("/r/req/1", b"ask")
        assert await store.delete_unchanged("/r/req/1", rev)  # withdrawn first
        with pytest.raises(ChangedError):
            await store.put_all_guarded(
                [("/r/desired", b"applied")],
                "/r/leader",
                epoch,
                delete=["/r/req/1"],
                expect={"/r/req/1": rev},
            )
        assert await store.get("/r/desired") is None
        rev = await store.put("/r/req/2", b"ask")
        await store.put_all_guarded(  # taken first
            [("/r/desired", b"applied")],
            "/r/leader",
            epoch,
            delete=["/r/req/2"],
            expect={"/r/req/2": rev},
        )
        assert not await store.delete_unchanged("/r/req/2", rev)
        assert [k.key for k in await store.get_prefix("/r/req/")] == []
        rev = await store.put("/r/req/3", b"ask")
        with pytest.raises(FencedError):  # another epoch: fenced, whatever the request
            await store.put_all_guarded(
                [("/r/desired", b"x")], "/r/leader", epoch + 1, expect={"/r/req/3": rev}
            )
        await lease.revoke()
    finally:
        await store.close()


async def test_a_witnessed_write_is_written_once_and_its_witness_outlives_the_key(
    etcd_endpoint: str,
) -> None:
    """``put_witnessed``: the key and its witness in one transaction; tried again, refused
    while the witness is there, even once the key went (a request a leader took): the
    witness's mod revision is the first write's. Revoking the lease takes the witness."""
    store = await connect_etcd(etcd_endpoint)
    try:
        lease = await store.lease(30)
        rev = await store.put_witnessed("/w/req/1", b"ask", "/w/asked/1", lease)
        assert rev is not None
        kv = await store.get("/w/req/1")
        assert kv is not None and kv.value == b"ask" and kv.mod_revision == rev
        await store.delete("/w/req/1")  # taken
        assert await store.put_witnessed("/w/req/1", b"ask", "/w/asked/1", lease) is None
        assert await store.get("/w/req/1") is None  # not written again
        witness = await store.get("/w/asked/1")
        assert witness is not None and witness.mod_revision == rev
        await lease.revoke()
        assert await store.get("/w/asked/1") is None
    finally:
        await store.close()


async def test_a_lease_cut_off_from_etcd_is_alive_but_not_fresh(servers: LocalServers) -> None:
    """etcd stops answering (paused: a partition): the lease stays alive (etcd keeps leases
    across its own restarts, so no answer is no proof of loss) but is no longer fresh once
    its TTL has passed since the last refresh that answered. Once etcd answers again it is
    fresh again, or reported lost (the server expired it meanwhile): never left in
    between."""
    store = await connect_etcd(servers.etcd_endpoint, op_timeout=0.5)
    lease = await store.lease(2)
    try:
        assert lease.alive and lease.fresh
        servers.etcd.pause()
        try:
            await asyncio.sleep(3.0)
            assert lease.alive and not lease.fresh
        finally:
            servers.etcd.resume()
        loop = asyncio.get_running_loop()
        end = loop.time() + 10
        while lease.alive and not lease.fresh and loop.time() < end:
            await asyncio.sleep(0.1)
        assert lease.fresh or not lease.alive
    finally:
        await lease.revoke()
        await store.close()
