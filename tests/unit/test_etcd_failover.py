"""``EtcdStore`` failover along its endpoint list, without servers (issue 18, item 9).

Calls that fail together as unavailable move the store one endpoint on, not one per call;
other errors do not move it; one client per endpoint, reused when the list wraps around.
The loopback clusters are tests/integration/test_runtime_clusters.py.
"""

from __future__ import annotations

import asyncio

import aetcd.exceptions
import pytest

from sailor.coordination import TemporaryError, UnavailableError
from sailor.coordination.etcd_store import EtcdStore


class _Client:
    """An endpoint's client, never called: the failures are injected as the calls' own
    awaitables (``_fail``), so that five calls fail together on one client, in the order the
    test sets. Kept instead of a real etcd cluster, where calls fail with the timing of
    real disconnects and cannot be made to fail together, once, or with a given error; the
    real failover is tests/integration/test_runtime_clusters.py."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint

    async def close(self) -> None:
        pass


def _store(endpoints: tuple[str, ...]) -> tuple[EtcdStore, list[str]]:
    made: list[str] = []

    def make(ep: str) -> _Client:
        made.append(ep)
        return _Client(ep)

    return EtcdStore(make(endpoints[0]), endpoints=endpoints, make_client=make), made


async def _fail(exc: Exception) -> None:
    await asyncio.sleep(0)
    raise exc


async def test_concurrent_failures_move_one_endpoint_on() -> None:
    store, made = _store(("a:1", "b:1", "c:1"))
    down = aetcd.exceptions.ConnectionFailedError("connection refused")
    results = await asyncio.gather(
        *(store.call(_fail(down)) for _ in range(5)), return_exceptions=True
    )
    assert all(isinstance(r, UnavailableError) for r in results)
    assert store.endpoint == "b:1" and store.client.endpoint == "b:1" and store.failovers == 1
    with pytest.raises(UnavailableError):
        await store.call(_fail(down))
    with pytest.raises(UnavailableError):
        await store.call(_fail(down))
    assert store.endpoint == "a:1" and made == ["a:1", "b:1", "c:1"]  # wrapped, client reused


async def test_other_errors_and_single_endpoints_do_not_move() -> None:
    store, _ = _store(("a:1", "b:1"))
    with pytest.raises(TemporaryError):
        await store.call(_fail(aetcd.exceptions.ClientError("etcdserver: too many requests")))
    assert store.endpoint == "a:1" and store.failovers == 0
    single, _ = _store(("a:1",))
    with pytest.raises(UnavailableError):
        await single.call(_fail(aetcd.exceptions.ConnectionFailedError("refused")))
    assert single.endpoint == "a:1" and single.failovers == 0


class _StuckClient(_Client):
    """A client whose close swallows its cancellations and goes on (a gRPC channel's close
    that hangs on its way out) until the test lets it end."""

    def __init__(self, endpoint: str) -> None:
        super().__init__(endpoint)
        self.release = asyncio.Event()

    async def close(self) -> None:
        while True:
            try:
                await self.release.wait()
                return
            except asyncio.CancelledError:
                continue


async def test_close_is_bounded_whatever_a_client_does() -> None:
    """``wait_for`` cancels once and then waits without bound: a daemon's shutdown (a
    controller's, in a CI run) waited on a client's close for ever. Now its op timeout plus
    ``within``'s grace (2 s) at most."""
    client = _StuckClient("a:1")
    store = EtcdStore(client, op_timeout=0.2, endpoints=("a:1",))  # type: ignore[arg-type]
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    try:
        await asyncio.wait_for(store.close(), 10)  # the test's own bound: wait_for hung here
        assert loop.time() - t0 < 3.0
    finally:
        client.release.set()  # the abandoned close ends, so the loop can
        await asyncio.sleep(0.01)
