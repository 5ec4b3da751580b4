"""etcd over a WAN link: a client in another region reaches the store through a path of
~250 ms round trip, where a TLS connection takes three round trips before its first answer.

A delaying TCP relay (in-process, one per test) stands for the link: every chunk is held
``ONE_WAY_S`` in each direction, in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest

from sailor.coordination.etcd_store import connect_etcd
from sailor.localservers import LocalServers

pytestmark = pytest.mark.asyncio

ONE_WAY_S = 0.125


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy ``reader`` to ``writer``, each chunk delivered ``ONE_WAY_S`` after it arrived."""
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def deliver() -> None:
        while True:
            due, chunk = await queue.get()
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            if not chunk:
                writer.close()
                return
            writer.write(chunk)
            await writer.drain()

    sender = asyncio.create_task(deliver())
    try:
        while True:
            chunk = await reader.read(65536)
            await queue.put((time.monotonic() + ONE_WAY_S, chunk))
            if not chunk:
                break
        await sender
    except (ConnectionError, OSError):
        pass
    finally:
        sender.cancel()
        with contextlib.suppress(BaseException):
            await sender
        writer.close()


@contextlib.asynccontextmanager
async def _delaying_relay(target: str) -> AsyncIterator[str]:
    host, _, port = target.rpartition(":")
    tasks: set[asyncio.Task[None]] = set()

    async def handle(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        try:
            sr, sw = await asyncio.open_connection(host, int(port))
        except OSError:
            cw.close()
            return
        both = asyncio.gather(_pipe(cr, sw), _pipe(sr, cw))
        try:
            await both
        finally:
            both.cancel()

    def track(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        task = asyncio.ensure_future(handle(cr, cw))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    server = await asyncio.start_server(track, "127.0.0.1", 0)
    relay_port = server.sockets[0].getsockname()[1]
    try:
        yield f"127.0.0.1:{relay_port}"
    finally:
        server.close()
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_store_across_a_wan_link_answers_its_first_call(servers: LocalServers) -> None:
    """The first call waits for the connection (TCP, TLS, HTTP/2 settings: ~3 round trips,
    0.75 s here) within its own deadline: a connection attempt is not cut short before it
    (gRPC's minimum connect timeout is ``grpc.min_reconnect_backoff_ms``; at 100 ms every
    attempt over this link failed and so did the call)."""
    async with _delaying_relay(servers.etcd_endpoint) as relay:
        t0 = time.monotonic()
        store = await connect_etcd(relay, op_timeout=3.0, security=servers.security("c1"))
        try:
            assert time.monotonic() - t0 >= 2 * ONE_WAY_S  # the relay did hold it
            assert await store.revision() > 0
        finally:
            await store.close()
