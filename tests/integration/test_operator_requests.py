"""``sailor node readmit`` and ``sailor checkpoint clear-bad`` when ``--wait`` runs out.

The command withdraws its request and used to report failure (exit status 1), but a leader
may have read the request just before and apply it all the same: the operator was told
nothing happened while it did. Now the desired state is read again after the withdrawal,
and the request counts as applied when what it asked for holds.

Over a real etcd (plain, shared by the module, a job of its own per test: the secure
servers fix the jobs at start; etcd's RBAC has tests of its own). :func:`_leader` plays a
leader that applies the request as soon as it reads it and never deletes the key (its
delete came after the withdrawal); without it no leader runs. Each test fails on the code
before.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import pytest

from sailor.controller import status
from sailor.coordination import EtcdStore, Keys, connect_etcd
from sailor.localservers import LocalServers
from sailor.schemas.runtime import DesiredState, NodeHealth

WAIT_S = 0.5
"""The command's ``--wait``: the leader below answers a request in milliseconds."""

Apply = Callable[[DesiredState], DesiredState]

_jobs = itertools.count()


async def _requests(store: EtcdStore, keys: Keys) -> list[str]:
    """The job's readmit and clear-bad requests in etcd."""
    return [kv.key for p in (keys.readmits, keys.clear_bads) for kv in await store.get_prefix(p)]


async def _leader(store: EtcdStore, keys: Keys, apply: Apply, seen: list[str]) -> None:
    """Poll the job's requests; at the first one, write the desired state ``apply`` makes
    of etcd's (read after the request was), and leave the request where it is."""
    while True:
        found = await _requests(store, keys)
        if found:
            kv = await store.get(keys.desired)
            assert kv is not None
            after = apply(DesiredState.model_validate_json(kv.value))
            await store.put(keys.desired, after.model_dump_json().encode())
            seen.extend(found)
            return
        await asyncio.sleep(0.01)


@asynccontextmanager
async def _job(
    servers: LocalServers, desired: DesiredState, apply: Apply | None
) -> AsyncIterator[tuple[str, EtcdStore, list[str]]]:
    """A job of its own whose desired state is ``desired``, with a leader applying requests
    by ``apply`` (None: no leader). Yields the job, a store, and the requests the leader saw."""
    job = f"op{next(_jobs)}"
    keys = Keys(job=job)
    store = await connect_etcd(servers.etcd_endpoint)
    seen: list[str] = []
    leader = None
    try:
        await store.put(keys.desired, desired.model_dump_json().encode())
        if apply is not None:
            leader = asyncio.create_task(_leader(store, keys, apply, seen), name="test-leader")
        yield job, store, seen
        if leader is not None:
            assert leader.done(), "the leader saw no request"
            await leader  # its errors, if any
    finally:
        if leader is not None and not leader.done():
            leader.cancel()
            await asyncio.gather(leader, return_exceptions=True)
        await store.close()


HELD = NodeHealth(failures=2, generation=3, exclusions=1, excluded_until=1e12, cause="x")
MARKED = DesiredState(epoch=1, generation=3, bad_checkpoints=(7, 14))


@pytest.mark.parametrize("leader", [True, False])
async def test_a_readmit_the_leader_applied_as_it_was_withdrawn_is_reported_applied(
    module_plain_servers: LocalServers, leader: bool
) -> None:
    d = DesiredState(epoch=1, generation=3, node_health={"n1": HELD, "n2": HELD})
    forget = (lambda s: s.model_copy(update={"node_health": {"n2": HELD}})) if leader else None
    ep = module_plain_servers.etcd_endpoint
    async with _job(module_plain_servers, d, forget) as (job, store, seen):
        rid, done, unknown = await status.request_readmit(
            ep, job, ["n1"], False, "op", None, WAIT_S
        )
        assert rid and unknown == () and done is leader
        assert seen == ([Keys(job=job).readmit(rid)] if leader else [])
        assert await _requests(store, Keys(job=job)) == []  # withdrawn either way


@pytest.mark.parametrize("leader", [True, False])
async def test_a_clear_bad_the_leader_applied_as_it_was_withdrawn_is_reported_applied(
    module_plain_servers: LocalServers, leader: bool
) -> None:
    clear = (lambda s: s.model_copy(update={"bad_checkpoints": (7,)})) if leader else None
    ep = module_plain_servers.etcd_endpoint
    async with _job(module_plain_servers, MARKED, clear) as (job, store, seen):
        rid, done, unknown = await status.request_clear_bad(
            ep, job, [14], False, "op", None, WAIT_S
        )
        assert rid and unknown == () and done is leader
        assert seen == ([Keys(job=job).clear_bad(rid)] if leader else [])
        assert await _requests(store, Keys(job=job)) == []


async def test_everything_counts_as_applied_only_when_nothing_is_left(
    module_plain_servers: LocalServers,
) -> None:
    ep = module_plain_servers.etcd_endpoint
    d = DesiredState(epoch=1, generation=3, node_health={"n1": HELD}, job_health=HELD)

    def forget(s: DesiredState) -> DesiredState:
        return s.model_copy(update={"node_health": {}})  # the job's is left

    async with _job(module_plain_servers, d, forget) as (job, _, seen):
        assert (await status.request_readmit(ep, job, [], True, "op", None, WAIT_S))[1] is False
        assert seen

    def clear(s: DesiredState) -> DesiredState:
        return s.model_copy(update={"bad_checkpoints": ()})

    async with _job(module_plain_servers, MARKED, clear) as (job, _, seen):
        assert (await status.request_clear_bad(ep, job, [], True, "op", None, WAIT_S))[1] is True
        assert seen
