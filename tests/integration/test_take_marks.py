"""A leader's take of an operator's request whose answer etcd lost, its term over before it
settled it: the take's mark outlives the term and the next leader audits the take from it.

A take (a request deleted, with a desired state or without one) writes its mark in its
transaction (``taken/<kind>/<id>``, ``controller/take_marks.py``). Bound to the leader's
lease, as it was, the mark went with the term: a leader deposed between a lost answer and
its settle wrote no record of the take, and no other leader could. Over a real etcd and
NATS (``module_plain_servers``); the lost answer is a commit whose answer the store's call
then drops, as an etcd restart between its commit and its answer does.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from sailor.controller.audit import AuditLog, read_records
from sailor.controller.daemon import Controller
from sailor.controller.decision_types import ClearReadmit
from sailor.controller.executor import Executor
from sailor.controller.take_marks import mark_value, read_mark
from sailor.coordination import (
    Keys,
    SystemClock,
    TaskSet,
    TemporaryError,
    campaign,
    connect_etcd,
)
from sailor.localservers import LocalServers
from sailor.schemas.runtime import ClearBadRequest, DesiredState, ReadmitRequest
from tests.integration.cluster_kit import Cluster, until
from tests.integration.test_controller_executor import LEASE_TTL, Rig, _records, executor_on
from tests.integration.test_operator_requests import _lost_repoint_take, _pass, _seeded

pytestmark = pytest.mark.usefixtures("no_task_leak")


@asynccontextmanager
async def _next_term(rig: Rig, tmp_path: Path) -> AsyncIterator[Executor]:
    """The rig's term ended (its lease revoked, as when its leader dies), and a new leader
    elected for the job, with an executor and an audit log of its own."""
    await rig.store.call(rig.store.client.revoke_lease(rig.lead.lease.id))
    lead = await campaign(rig.store, rig.ex.keys.leader, "c2", LEASE_TTL, timeout=10)
    tasks = TaskSet("test-next-term")
    audit = AuditLog(tmp_path / "audit-c2.jsonl")
    try:
        yield Executor(
            rig.store,
            rig.ex.commands,
            rig.ex.keys,
            audit,
            lead,
            None,  # type: ignore[arg-type]
            SystemClock(),
            tasks,
            lambda urgent: None,
        )
    finally:
        await tasks.close()
        await lead.resign()
        audit.close()


async def test_a_take_lost_as_its_term_ended_is_audited_by_the_next_leader(
    module_plain_servers: LocalServers, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``clear-bad 300 --repoint`` taken without a desired state (the record re-pointed),
    the answer lost; the leader's term ends before any settle. Its mark is still there, and
    the next leader, at its start, audits the take as applied (``taken_epoch``: the old
    term's) with the request's own record, what it re-pointed included, once; the mark
    goes. Before, the mark went with the old lease and no record of the take was written."""
    async with executor_on(module_plain_servers, tmp_path, None) as rig:
        keys = rig.ex.keys
        seen, _ = await _lost_repoint_take(rig, monkeypatch, committed=True)
        old_epoch = rig.ex.epoch
        async with _next_term(rig, tmp_path) as ex:
            mark = await rig.store.get(keys.taken(seen.key))
            assert mark is not None, "the take's mark went with the old term's lease"
            assert read_mark(mark.value).epoch == old_epoch
            assert await ex.settle_orphan_marks() == (seen.key,)
            assert ex.orphans_settled and await ex.settle_orphan_marks() == ()  # once
            (applied,) = _records(ex.audit, "request_applied")
            assert applied["keys"] == [seen.key] and applied["taken_epoch"] == old_epoch
            assert applied["epoch"] == ex.epoch and applied["answer_lost"] is True
            (rec,) = _records(ex.audit, "clear_bad")
            assert rec["request_id"] == "r1" and rec["repointed"] == [300]
            assert rec["repointed_from"] == ["/old"] and rec["directory"] == "/ck"
            assert await rig.store.get_prefix(keys.takens) == []
        assert _records(rig.audit, "clear_bad") == []  # the old term wrote none


async def test_a_write_lost_as_its_term_ended_has_its_requests_audited_by_the_next_leader(
    module_plain_servers: LocalServers, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``readmit n1`` applied by a desired state whose answer etcd lost; the term ends
    before the read-back. The next leader audits the readmit (with its reason) from the
    write's mark. Before, neither leader wrote a ``readmit`` record: the new one did not
    know which requests that write took."""
    async with executor_on(module_plain_servers, tmp_path, None) as rig:
        keys = rig.ex.keys
        await rig.ex.write_desired(_seeded(rig.ex.epoch), "test")
        body = ReadmitRequest(nodes=("n1",), who="op", time=time.time())
        await rig.store.put(keys.readmit("r1"), body.model_dump_json().encode())
        seen = await rig.store.get(keys.readmit("r1"))
        assert seen is not None
        real = rig.store.put_all_guarded

        async def lossy(*a: Any, **k: Any) -> int:
            await real(*a, **k)
            raise TemporaryError("etcd restarted before it answered")

        monkeypatch.setattr(rig.store, "put_all_guarded", lossy)
        with pytest.raises(TemporaryError):
            await _pass(rig, seen)
        monkeypatch.setattr(rig.store, "put_all_guarded", real)
        held = DesiredState.model_validate_json(await rig.desired())
        assert "n1" not in held.node_health  # committed
        async with _next_term(rig, tmp_path) as ex:
            assert await ex.settle_orphan_marks() == (seen.key,)
            (rec,) = _records(ex.audit, "readmit")
            assert rec["request_id"] == "r1" and "n1" in rec["reason"], rec
            assert rec["taken_epoch"] == rig.ex.epoch
            assert await rig.store.get_prefix(keys.takens) == []
        assert _records(rig.audit, "readmit") == []


async def test_an_answered_take_leaves_no_mark_for_the_next_term(
    module_plain_servers: LocalServers, tmp_path: Path
) -> None:
    """Takes that answered, with a desired state and without: each audited once by its
    leader, its mark deleted; the next leader finds none and audits nothing again."""
    async with executor_on(module_plain_servers, tmp_path, None) as rig:
        keys = rig.ex.keys
        await rig.ex.write_desired(_seeded(rig.ex.epoch), "test")
        for rid, steps in (("r1", (14,)), ("r2", (99,))):  # 99: no mark, taken alone
            req = ClearBadRequest(steps=steps, who="op", time=time.time())
            await rig.store.put(keys.clear_bad(rid), req.model_dump_json().encode())
            seen = await rig.store.get(keys.clear_bad(rid))
            assert seen is not None
            await _pass(rig, seen)
        assert [r["request_id"] for r in _records(rig.audit, "clear_bad")] == ["r1", "r2"]
        assert await rig.store.get_prefix(keys.takens) == []
        async with _next_term(rig, tmp_path) as ex:
            assert await ex.settle_orphan_marks() == ()
            assert _records(ex.audit, "request_applied") == []


async def test_a_controller_audits_the_marks_an_earlier_term_left_as_it_starts(
    tmp_path: Path, servers: LocalServers
) -> None:
    """The daemon's wiring: a mark an earlier term left (a readmit of epoch 1 it took, its
    term over) is audited by the controller that leads next, in its first pass, and
    deleted."""

    cfg = Cluster(tmp_path, servers).ctl_config("c1")
    keys = Keys(job=cfg.job)
    sec = servers.security("c1")
    store = await connect_etcd(servers.etcd_endpoint, security=sec)
    request = keys.readmit("r9")
    try:
        value = mark_value(ClearReadmit("r9", "forgot n4"), epoch=1)
        await store.put(keys.taken(request), value)
        ctl = Controller(cfg)
        task = asyncio.create_task(ctl.run(), name="test-ctl-c1")
        try:

            def audited() -> bool:
                return any(
                    r["kind"] == "readmit" and r.get("request_id") == "r9"
                    for r in read_records([cfg.audit_log])
                )

            await until(audited, 20, "the orphan take audited")
        finally:
            ctl.stopping.set()
            ctl.wake()
            await asyncio.wait_for(task, 15)
        assert await store.get(keys.taken(request)) is None
    finally:
        await store.close()
    records = read_records([cfg.audit_log])
    (applied,) = [r for r in records if r["kind"] == "request_applied"]
    assert applied["keys"] == [request] and applied["taken_epoch"] == 1
    (rec,) = [r for r in records if r["kind"] == "readmit"]
    assert rec["reason"] == "forgot n4" and rec["answer_lost"] is True
