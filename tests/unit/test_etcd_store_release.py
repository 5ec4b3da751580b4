"""A store's failed calls keep no gRPC call or channel alive once it is closed, with the
garbage collector off: etcd down (nothing listens on the port), a read and a watch refused.

Each kind sat in a reference cycle with its gRPC call, which holds its channel (and, against
a live etcd, the connection: tests/integration/test_security_etcd.py): the read in 3.11's
``asyncio.wait_for``, the watch in aetcd's ``Watcher.add_callback``, which raises the error
its callback holds.
"""

from __future__ import annotations

import asyncio
import gc

import aetcd
import pytest

from sailor.coordination import UnavailableError
from sailor.coordination.etcd_store import EtcdStore
from sailor.localnet import free_port


def _grpc_objects() -> int:
    return sum(1 for o in gc.get_objects() if type(o).__name__ in ("_AioCall", "AioChannel"))


async def test_calls_refused_while_etcd_is_down_leave_nothing_after_close() -> None:
    port = free_port()  # nothing listens: the member is down
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        before = _grpc_objects()
        for _ in range(3):
            client = aetcd.Client(host="127.0.0.1", port=port, timeout=1)
            store = EtcdStore(client, op_timeout=1.0)
            with pytest.raises(UnavailableError):
                await store.get("/x")
            with pytest.raises(UnavailableError):
                async for _ in store.watch_prefix("/x/", 1):
                    pass
            await store.close()
            del store, client
        await asyncio.sleep(0.01)
        assert _grpc_objects() == before
    finally:
        if was_enabled:
            gc.enable()
