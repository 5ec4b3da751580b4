"""The etcd backend of ``StateStore`` (aetcd): guarded transactions and kept-alive leases.

A guarded write is one etcd transaction: ``compare create_revision(guard_key) == epoch``,
then put. The leader key is bound to the leader's lease, so once the lease is gone (the
leader was deposed, crashed or partitioned away) the comparison fails and the write is
refused with ``FencedError``: a deposed leader can change nothing.

Reconnects: the grpc channel reconnects by itself; we cap its back-off at 1 s (grpc's default
grows to 120 s, which would turn a 2 s etcd restart into minutes of downtime) and put a timeout
on every call. This module must never import NATS or any daemon code.

Failover: aetcd's client talks to one endpoint, so the store keeps a list (every member of
the etcd cluster) and one client per endpoint, made when first used. A call that fails as
unavailable (connection refused or reset, or no answer within the timeout) moves the store
to the next endpoint for the calls after it; the failed call itself is the caller's to retry
(``UnavailableError`` is a ``TemporaryError``). Calls in flight on the old client finish or
fail there; its watches break and the mirror re-reads and watches again on the new one.
Leases, revisions and watches are the cluster's, not a member's, so nothing else changes.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

import aetcd
import aetcd.exceptions
import aetcd.utils
import grpc
import grpc.aio
import structlog
from aetcd import rpc

from sailor.coordination.api import KeyValue
from sailor.coordination.clock import Clock, SystemClock
from sailor.coordination.deadline import within
from sailor.coordination.errors import (
    ChangedError,
    FencedError,
    PermanentError,
    TemporaryError,
    UnavailableError,
)
from sailor.coordination.etcd_tls import TlsClient
from sailor.coordination.security.settings import SecurityConfig
from sailor.coordination.tasks import TaskSet

__all__ = ["EtcdLease", "EtcdStore", "connect_etcd"]

_log = structlog.get_logger("sailor.etcd")
_T = TypeVar("_T")

_GRPC_OPTIONS = {
    # Reconnect soon after a member comes back: attempts start 0.1 s apart, at most 1 s.
    "grpc.initial_reconnect_backoff_ms": 100,
    "grpc.max_reconnect_backoff_ms": 1000,
    # Despite its name, gRPC core reads this as the *minimum connect timeout*: how long one
    # attempt may take from TCP connect to the server's HTTP/2 settings (TLS included:
    # three round trips, 0.5-1 s between regions; more on a loaded host). At 100 ms every
    # attempt over such a link failed, and so did every call. A call's own deadline
    # (``op_timeout``) still bounds how long it waits for the attempt.
    "grpc.min_reconnect_backoff_ms": 20_000,
    "grpc.keepalive_time_ms": 5000,
    "grpc.keepalive_timeout_ms": 2000,
}


def _kv(item: Any) -> KeyValue:
    key = item.key.decode() if isinstance(item.key, bytes) else str(item.key)
    return KeyValue(
        key=key,
        value=bytes(item.value),
        create_revision=int(item.create_revision),
        mod_revision=int(item.mod_revision),
        lease=int(item.lease),
    )


class EtcdLease:
    """A granted lease, refreshed every ttl/3 s by a guarded background task."""

    def __init__(
        self, store: EtcdStore, lease: Any, ttl: int, clock: Clock, asked_at: float
    ) -> None:
        self._store = store
        self._lease = lease
        self.ttl = ttl
        self._clock = clock
        self._alive = True
        # Until when the server holds the lease for sure: its TTL from when the last refresh
        # that answered was sent (the grant's request, ``asked_at``, at first). Past it, with
        # etcd unreachable, the lease may have expired and another holder taken what it
        # guarded (``fresh``).
        self._valid_until = asked_at + ttl
        # A keepalive that crashed refreshes no more: the lease is as good as lost, and its
        # owner must know it (a leader ends its term, an agent registers again).
        self._tasks = TaskSet(f"lease-{lease.id}", on_crash=self._keepalive_crashed)
        self._tasks.spawn("keepalive", self._keepalive())

    @property
    def id(self) -> int:
        return int(self._lease.id)

    @property
    def alive(self) -> bool:
        return self._alive

    @property
    def fresh(self) -> bool:
        """Alive, and refreshed within its TTL: what it guards is certainly still ours. A
        lease cut off from etcd stays ``alive`` (etcd keeps leases across its own restarts
        and extends them on recovery) but not ``fresh``: its holder should not act on it."""
        return self._alive and self._clock.now() < self._valid_until

    async def _keepalive(self) -> None:
        period = max(self.ttl / 3.0, 0.1)
        while self._alive:
            await self._clock.sleep(period)
            sent = self._clock.now()
            try:
                reply = await self._store.call(self._refresh())
            except TemporaryError as exc:
                # The server may be restarting; etcd keeps leases across restarts and
                # extends their TTL on recovery, so keep trying until it answers.
                _log.warning("lease_refresh_failed", lease=self.id, error=str(exc))
                continue
            if reply is None or int(reply.TTL) <= 0:
                _log.warning("lease_lost", lease=self.id)
                self._alive = False
            else:
                self._valid_until = sent + int(reply.TTL)

    async def _refresh(self) -> Any:
        """One keepalive round trip: etcd's reply (its ``TTL``), or None when the stream ended
        without one. The LeaseKeepAlive stream is cancelled once read: aetcd's
        ``refresh_lease`` returns from inside its iteration of the stream, and the call it
        leaves unfinished (with its channel, and the connection to etcd) lived until the
        garbage collector ran, after the client's close (measured: a connection per store
        whose lease was refreshed once, on which etcd's stop then waited ~1.1 s)."""
        client = self._store.client
        await client.connect()
        call = client.leasestub.LeaseKeepAlive(
            iter([rpc.LeaseKeepAliveRequest(ID=self.id)]),
            timeout=self._store._op_timeout,
            metadata=client.metadata,
        )
        try:
            reply = await call.read()
        except rpc.AioRpcError as exc:
            aetcd.exceptions._handle_exception(exc)  # raises aetcd's error for the code
        finally:
            call.cancel()
        return None if reply is grpc.aio.EOF else reply

    def _keepalive_crashed(self, name: str, exc: BaseException) -> None:
        _log.error("lease_keepalive_crashed", lease=self.id, error=repr(exc))
        self._alive = False

    async def revoke(self) -> None:
        self._alive = False
        await self._tasks.close()
        with contextlib.suppress(TemporaryError):
            await self._store.call(self._store.client.revoke_lease(self.id))

    async def stop_keepalive(self) -> None:
        """Stop refreshing without revoking (a crash: the lease expires after its TTL)."""
        self._alive = False
        await self._tasks.close()


class EtcdStore:
    """``StateStore`` on etcd v3, failing over along ``endpoints`` (module docstring)."""

    def __init__(
        self,
        client: aetcd.Client,
        op_timeout: float = 2.0,
        clock: Clock | None = None,
        endpoints: Sequence[str] = (),
        make_client: Callable[[str], aetcd.Client] | None = None,
    ) -> None:
        self.client = client
        self._op_timeout = op_timeout
        self._clock = clock or SystemClock()
        self._leases: list[EtcdLease] = []
        self.endpoints = tuple(endpoints)
        self._clients: dict[str, aetcd.Client] = {self.endpoints[0]: client} if endpoints else {}
        self._make_client = make_client
        self._at = 0  # index of the endpoint in use
        self.failovers = 0  # also the generation of ``client``: one failover per failure

    @property
    def endpoint(self) -> str:
        """The endpoint the calls go to now ("" for a store made from a bare client)."""
        return self.endpoints[self._at] if self.endpoints else ""

    def _failover(self, seen: int, error: Exception) -> None:
        """Move to the next endpoint, once per failure of the client in use: calls that
        failed together on the same client (``seen`` = its generation) move it one step."""
        if len(self.endpoints) < 2 or self._make_client is None or seen != self.failovers:
            return
        old = self.endpoint
        self._at = (self._at + 1) % len(self.endpoints)
        self.failovers += 1
        ep = self.endpoints[self._at]
        if ep not in self._clients:
            self._clients[ep] = self._make_client(ep)
        self.client = self._clients[ep]
        _log.warning("etcd_failover", frm=old, to=ep, error=str(error))

    async def call(self, awaitable: Awaitable[_T]) -> _T:
        """Await one client call with a timeout, converting client errors.

        A failed call's error is in no reference cycle, so that it keeps no gRPC call or
        channel alive: a closed client lets go of its connection to etcd at once, not at the
        next garbage collection (measured: 20 TLS clients closed after a refused call each
        left 20 connections and 26 descriptors; etcd's stop on SIGTERM waited ~1.1 s on
        them)."""
        seen = self.failovers
        try:
            # ``asyncio.timeout``, not ``wait_for``: 3.11's wait_for keeps the call's task in
            # its frame, which the error's traceback holds: a cycle that kept the failed
            # gRPC call, its channel and the connection to etcd until a collection
            async with asyncio.timeout(self._op_timeout):
                return await awaitable
        except Exception as exc:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                # grpc turns our cancellation into an RPC error; never swallow it
                raise asyncio.CancelledError from exc
            raise self._raised(exc, seen)  # noqa: B904 (its cause is set there)

    def _raised(self, exc: Exception, seen: int | None) -> Exception:
        """What to raise for client error ``exc``: our error for it, ``exc`` its cause, or
        ``exc`` itself when it is no client error (never its own cause); an unavailable
        member is failed over from when ``seen`` (the failover count the call began at) is
        given. Returned, not bound in the raising frame: that frame is in the error's
        traceback, and a local holding the error would be a cycle keeping the failed gRPC
        call, its channel and the connection until a collection."""
        err = self._convert(exc)
        if err is exc:
            return exc
        if seen is not None and isinstance(err, UnavailableError):
            self._failover(seen, err)
        err.__cause__ = exc  # as ``raise err from exc``
        return err

    @staticmethod
    def _convert(exc: Exception) -> Exception:
        if isinstance(exc, TimeoutError | aetcd.exceptions.ConnectionTimeoutError):
            # our deadline or gRPC's (DEADLINE_EXCEEDED): the member did not answer in time
            return UnavailableError("etcd call timed out")
        if isinstance(exc, aetcd.exceptions.ConnectionFailedError):
            return UnavailableError("etcd unavailable", error=str(exc))
        if isinstance(exc, aetcd.exceptions.UnauthenticatedError) or (
            isinstance(exc, aetcd.exceptions.ClientError)
            and "permission denied" in str(exc).lower()
        ):
            # RBAC refused this identity: retrying cannot help
            return PermanentError("etcd permission denied", error=str(exc))
        if isinstance(exc, aetcd.exceptions.ClientError):
            return TemporaryError("etcd error", error=repr(exc))
        return exc

    async def get(self, key: str) -> KeyValue | None:
        item = await self.call(self.client.get(key.encode()))
        return None if item is None else _kv(item)

    async def get_prefix(self, prefix: str) -> list[KeyValue]:
        items = await self.call(self.client.get_prefix(prefix.encode()))
        return [_kv(i) for i in items]

    async def get_prefix_at(self, prefix: str) -> tuple[int, list[KeyValue]]:
        """Every key under ``prefix`` and the store revision they were read at (one range)."""
        items = await self.call(self.client.get_prefix(prefix.encode()))
        return int(items.header.revision), [_kv(i) for i in items]

    async def prefix_fingerprint(self, prefix: str) -> tuple[int, int]:
        """(number of keys, highest mod revision) under ``prefix``, in one cheap range call.

        A copy of the prefix that stopped at some revision (it lacks every change after
        it: a stalled watch) differs from this whenever its keys do: a put since leaves a
        key newer than any the copy holds, and with no put since only deletes are missing,
        leaving the copy keys too many. A copy that dropped a change but applied a later
        one may not differ: a key dropped from a transaction that wrote two (same revision,
        same count), or a put on an existing key followed by any later change. It tells a
        stalled copy, not a faulty one.
        """
        req = rpc.RangeRequest(
            key=prefix.encode(),
            range_end=aetcd.utils.prefix_range_end(prefix.encode()),
            limit=1,
            sort_order=rpc.RangeRequest.DESCEND,
            sort_target=rpc.RangeRequest.MOD,
            keys_only=True,
        )

        async def _range() -> Any:
            await self.client.connect()
            try:
                return await self.client.kvstub.Range(
                    req, timeout=self._op_timeout, metadata=self.client.metadata
                )
            except rpc.AioRpcError as exc:
                aetcd.exceptions._handle_exception(exc)  # raises aetcd's error for the code

        resp = await self.call(_range())
        top = int(resp.kvs[0].mod_revision) if resp.kvs else 0
        return int(resp.count), top

    async def watch_prefix(
        self, prefix: str, start_revision: int
    ) -> AsyncGenerator[tuple[str, KeyValue | None, int], None]:
        """Changes under ``prefix`` from ``start_revision`` on, in order: (key, kv or None
        for a delete, revision). Ends by raising TemporaryError when the watch breaks (or a
        compaction removed revisions it needed); the caller re-reads and watches again. A
        stream that stops silently (aetcd does not report every etcd restart) is the caller's
        to notice, e.g. with ``prefix_fingerprint``.
        """
        # Not under ``call``'s wait_for: cancelling a watch while aetcd creates it lets the
        # server's reply be matched to the *next* watch created on the shared stream (seen
        # under load: a mirror of ckpt/ received status/ keys). aetcd bounds the creation
        # with the client timeout itself (WatchTimeoutError).
        seen = self.failovers
        try:
            watch = await self.client.watch_prefix(prefix.encode(), start_revision=start_revision)
        except Exception as exc:
            _untangle(exc)
            raise self._raised(exc, seen)  # noqa: B904 (its cause is set there)
        try:
            async for ev in watch:
                key = ev.kv.key.decode()
                rev = int(ev.kv.mod_revision)
                if ev.kind == "DELETE":
                    yield key, None, rev
                else:
                    yield key, _kv(ev.kv), rev
        except Exception as exc:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise
            raise self._raised(exc, None)  # noqa: B904 (its cause is set there)
        finally:
            with contextlib.suppress(Exception):  # bounded whatever the stream does
                await within(watch.cancel(), self._op_timeout, "etcd watch cancel")

    async def put(self, key: str, value: bytes, lease: Any = None) -> int:
        resp = await self.call(
            self.client.put(key.encode(), value, lease=None if lease is None else lease.id)
        )
        return int(resp.header.revision)

    async def _txn(self, compare: list[Any], success: list[Any]) -> tuple[bool, int]:
        """One transaction (no failure branch): (succeeded, the store revision after it).

        aetcd's ``transaction`` drops the response header, so the Txn RPC is called here
        directly: the revision comes from the same response that says the write happened,
        never from a second call that could fail after the write succeeded.
        """
        req = rpc.TxnRequest(
            compare=[c.build_message() for c in compare],
            success=self.client._ops_to_requests(success),
            failure=[],
        )

        async def _call() -> Any:
            await self.client.connect()
            try:
                return await self.client.kvstub.Txn(
                    req, timeout=self._op_timeout, metadata=self.client.metadata
                )
            except rpc.AioRpcError as exc:
                aetcd.exceptions._handle_exception(exc)  # raises aetcd's error for the code

        resp = await self.call(_call())
        return bool(resp.succeeded), int(resp.header.revision)

    async def put_guarded(
        self, key: str, value: bytes, guard_key: str, epoch: int, lease: Any = None
    ) -> int:
        tx = self.client.transactions
        ok, revision = await self._txn(
            [tx.create(guard_key.encode()) == epoch],
            [tx.put(key.encode(), value, None if lease is None else lease.id)],
        )
        if not ok:
            raise FencedError("guarded write refused", key=key, epoch=epoch)
        return revision

    async def put_all_guarded(
        self,
        items: Sequence[tuple[str, bytes]],
        guard_key: str,
        epoch: int,
        delete: Sequence[str] = (),
        expect: Mapping[str, int] | None = None,
        marks: Sequence[str] = (),
        lease: Any = None,
    ) -> int:
        """Write every (key, value) of ``items`` and delete ``delete`` in one transaction,
        only if ``guard_key`` still has create revision ``epoch`` (all or nothing), and each
        key of ``expect`` still has its mod revision there (0: absent). ``marks``: empty
        keys written in the same transaction, bound to ``lease`` (a trace of the
        transaction that outlives a lost answer). Refused, the guard key is read again to
        tell which: ``FencedError`` (no longer the leader) or ``ChangedError`` (an expected
        key changed: an operator withdrew its request)."""
        if marks and lease is None:
            raise ValueError(f"marks {list(marks)} need a lease, got lease=None")
        tx = self.client.transactions
        expected = sorted((expect or {}).items())
        ok, revision = await self._txn(
            [tx.create(guard_key.encode()) == epoch]
            + [tx.mod(k.encode()) == rev for k, rev in expected],
            [tx.put(k.encode(), v, None) for k, v in items]
            + [tx.put(k.encode(), b"", lease.id) for k in marks]
            + [tx.delete(k.encode()) for k in delete],
        )
        if not ok:
            keys = ",".join([*(k for k, _ in items), *marks, *delete])
            guard = await self.get(guard_key) if expected else None
            if guard is not None and guard.create_revision == epoch:
                raise ChangedError("write refused: a compared key changed", key=keys)
            raise FencedError("guarded write refused", key=keys, epoch=epoch)
        return revision

    async def delete(self, key: str) -> None:
        """Delete ``key`` (absent: nothing to do). Unguarded: for a key its writer owns, such
        as an operator's own request."""
        await self.call(self.client.delete(key.encode()))

    async def delete_unchanged(self, key: str, mod_revision: int) -> bool:
        """Delete ``key`` only if its mod revision is still ``mod_revision`` (one
        transaction); whether it was deleted. Unguarded: an operator withdrawing its own
        request, which a leader may have taken (deleted) meanwhile."""
        tx = self.client.transactions
        ok, _ = await self._txn([tx.mod(key.encode()) == mod_revision], [tx.delete(key.encode())])
        return ok

    async def put_witnessed(self, key: str, value: bytes, witness: str, lease: Any) -> int | None:
        """Write ``key`` and ``witness`` (empty, bound to ``lease``) in one transaction, only
        while ``witness`` does not exist; the transaction's revision, or None when the
        witness exists. A write whose answer was lost is tried again so: None says the lost
        one committed (the witness's mod revision is its revision, ``key``'s too), even when
        ``key`` went since (an operator's request a leader took and deleted); it is never
        written twice while the lease lives."""
        tx = self.client.transactions
        ok, revision = await self._txn(
            [tx.create(witness.encode()) == 0],
            [tx.put(key.encode(), value, None), tx.put(witness.encode(), b"", lease.id)],
        )
        return revision if ok else None

    async def delete_guarded(self, key: str, guard_key: str, epoch: int) -> None:
        tx = self.client.transactions
        ok, _ = await self._txn([tx.create(guard_key.encode()) == epoch], [tx.delete(key.encode())])
        if not ok:
            raise FencedError("guarded delete refused", key=key, epoch=epoch)

    async def claim(self, key: str, value: bytes, lease: Any) -> KeyValue | None:
        """Write ``key`` bound to ``lease`` only while no other lease holds it: absent, or
        held under ``lease`` itself (a write of ours whose answer was lost, or a write
        again). None once written; else the record that holds it under another lease
        (unchanged). Each branch is one transaction: a holder whose lease lapses meanwhile
        is found absent at the next try (``TemporaryError`` if it keeps changing)."""
        tx = self.client.transactions
        put = [tx.put(key.encode(), value, lease.id)]
        for _ in range(3):
            ok, _rev = await self._txn([tx.create(key.encode()) == 0], put)
            if ok:
                return None
            held = await self.get(key)
            if held is None:
                continue  # its lease lapsed since
            if held.lease != lease.id:
                return held
            ok, _rev = await self._txn([tx.mod(key.encode()) == held.mod_revision], put)
            if ok:
                return None
        raise TemporaryError("key changing under a claim", key=key, retry_after=0.3)

    async def create_if_absent(self, key: str, value: bytes, lease: Any) -> KeyValue | None:
        tx = self.client.transactions
        await self.call(
            self.client.transaction(
                compare=[tx.create(key.encode()) == 0],
                success=[tx.put(key.encode(), value, lease.id)],
                failure=[],
            )
        )
        return await self.get(key)

    async def lease(self, ttl: int) -> EtcdLease:
        asked_at = self._clock.now()
        granted = await self.call(self.client.lease(ttl))
        lease = EtcdLease(self, granted, ttl, self._clock, asked_at)
        # revoked, stopped and lost leases are done: a standby campaigning every second
        # grants a lease each time (kept forever, ~59 MB a day)
        self._leases = [x for x in self._leases if x.alive]
        self._leases.append(lease)
        return lease

    async def lease_ttl(self, lease_id: int) -> tuple[int, int] | None:
        """(remaining, granted) seconds of lease ``lease_id`` as etcd holds it; None when it
        is gone. ``granted`` is what etcd gave, which may exceed what was asked: etcd raises
        every lease to its minimum TTL (1.5 election timeouts; 8 s with an election timeout
        of 5 s, a WAN setting)."""
        reply = await self.call(self.client.get_lease_info(lease_id, keys=False))
        remaining = int(reply.TTL)
        if remaining <= 0:  # -1: expired or revoked
            return None
        return remaining, int(reply.grantedTTL)

    async def revision(self) -> int:
        resp = await self.call(self.client.get_prefix(b"/sailor/\x00revision-probe"))
        return int(resp.header.revision)

    async def close(self) -> None:
        for lease in self._leases:
            await lease.stop_keepalive()
        self._leases.clear()
        clients = list(self._clients.values()) or [self.client]
        for client in clients:
            # ``within``, not ``wait_for``: a close that swallows the cancellation or hangs
            # on its way out (a gRPC channel's) held wait_for, and the daemon's shutdown
            # with it, without bound
            with contextlib.suppress(Exception):
                await within(client.close(), self._op_timeout, "etcd close")


def _untangle(exc: BaseException) -> None:
    """Drop the tracebacks of the gRPC errors in ``exc``'s chain (its causes and contexts).

    aetcd's ``Watcher.add_callback`` raises the error its ``WatcherCallback`` holds, so the
    error's traceback holds the frame that holds the callback that holds the error: a
    cycle, in which the failed gRPC call and its channel lived on after the store's close
    until a collection (a watch made while etcd was down: tests/unit/test_etcd_store_release.py).
    The chain's messages and our own frames are kept."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        cur = todo.pop()
        if cur is None or id(cur) in seen:
            continue
        seen.add(id(cur))
        if isinstance(cur, grpc.aio.AioRpcError):
            cur.__traceback__ = None
        todo += [cur.__cause__, cur.__context__]


async def connect_etcd(
    endpoint: str | Sequence[str],
    op_timeout: float = 2.0,
    clock: Clock | None = None,
    security: SecurityConfig | None = None,
) -> EtcdStore:
    """Connect to ``host:port``, or to the first of a list of members that answers (the
    store then fails over along the list). Connecting is lazy in grpc; a call proves it.

    With ``security``: TLS verified against its CA, with our client certificate (whose common
    name is our etcd user when the server runs with ``--client-cert-auth`` and RBAC).
    """
    endpoints = (endpoint,) if isinstance(endpoint, str) else tuple(endpoint)
    if not endpoints:
        raise PermanentError("no etcd endpoint given")
    pem = None
    if security is not None:
        try:
            pem = security.grpc_pem()
        except OSError as exc:
            raise PermanentError("bad etcd security settings", error=str(exc)) from None

    def make(ep: str) -> aetcd.Client:
        host, _, port = ep.rpartition(":")
        kwargs: dict[str, Any] = {
            "host": (host or "127.0.0.1").strip("[]"),
            "port": int(port),
            "timeout": int(max(1, op_timeout)),
            "options": dict(_GRPC_OPTIONS),
        }
        if pem is None:
            return aetcd.Client(**kwargs)
        ca, key, cert = pem
        return TlsClient(ca_pem=ca, key_pem=key, cert_pem=cert, **kwargs)

    store = EtcdStore(
        make(endpoints[0]),
        op_timeout=op_timeout,
        clock=clock,
        endpoints=endpoints,
        make_client=make,
    )
    for tries_left in range(len(endpoints) - 1, -1, -1):
        try:
            await store.revision()  # an unavailable member moves the store to the next
            return store
        except UnavailableError:
            if tries_left == 0:
                await store.close()
                raise
        except Exception:
            await store.close()
            raise
    raise AssertionError("unreachable")
