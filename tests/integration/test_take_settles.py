"""How a leader settles its takes of operators' requests when etcd fails around them: each
request audited once, by what its take's transaction left (its mark), and no mark kept
past what it is needed for.

Over a real etcd and NATS (``module_plain_servers``). An etcd failure is a store call that
raises ``TemporaryError`` before it reaches etcd (not committed) or after it committed (the
answer lost, as an etcd restart between its commit and its answer does).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from sailor.controller.decide import decide
from sailor.controller.decision_types import Observed
from sailor.controller.take_marks import mark_value
from sailor.coordination import KeyValue, TemporaryError
from sailor.localservers import LocalServers
from sailor.schemas.runtime import ClearBadRequest, DesiredState, ReadmitRequest
from tests.integration.test_controller_executor import Rig, _records, executor_on
from tests.integration.test_operator_requests import CFG, _pass, _seeded
from tests.integration.test_take_marks import _next_term

pytestmark = pytest.mark.usefixtures("no_task_leak")


async def _readmit_n1(rig: Rig, rid: str) -> KeyValue:
    """``readmit n1`` as its command writes it (request ``rid``), as the leader reads it."""
    body = ReadmitRequest(nodes=("n1",), who="op", time=time.time())
    await rig.store.put(rig.ex.keys.readmit(rid), body.model_dump_json().encode())
    seen = await rig.store.get(rig.ex.keys.readmit(rid))
    assert seen is not None
    return seen


async def _uncommitted(rig: Rig, seen: KeyValue, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pass whose write taking ``seen`` does not commit, and the settle after it, whose
    read of ``seen``'s key fails: the write stays the settle's (``uncommitted``)."""
    real_put, real_get = rig.store.put_all_guarded, rig.store.get

    async def refused(*a: Any, **k: Any) -> int:
        raise TemporaryError("etcd unavailable")

    async def get_flaky(key: str) -> Any:
        if key == seen.key:
            raise TemporaryError("etcd blipped")
        return await real_get(key)

    monkeypatch.setattr(rig.store, "put_all_guarded", refused)
    with pytest.raises(TemporaryError):
        await _pass(rig, seen)
    monkeypatch.setattr(rig.store, "put_all_guarded", real_put)
    rig.ex.settle_lost(DesiredState.model_validate_json(await rig.desired()))
    monkeypatch.setattr(rig.store, "get", get_flaky)
    await rig.ex.settle_lost_takes()
    monkeypatch.setattr(rig.store, "get", real_get)
    assert rig.ex.uncommitted is not None


async def _settle(rig: Rig) -> None:
    """The daemon's settle after an etcd error: the state read back, then the takes."""
    rig.ex.settle_lost(DesiredState.model_validate_json(await rig.desired()))
    await rig.ex.settle_lost_takes()


async def test_a_mark_whose_delete_failed_goes_at_the_next_pass(
    module_plain_servers: LocalServers, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``clear-bad 14`` applied and audited; the delete of its take's mark fails (an etcd
    blip, no error raised by the pass). The next pass, a healthy one, deletes it, and a
    later term finds no mark to audit again: one ``clear_bad`` record. Before, the delete
    was tried again only at a settle, which follows a pass that raised: the mark stayed
    the term out and the next leader audited the take a second time."""
    async with executor_on(module_plain_servers, tmp_path, None) as rig:
        keys = rig.ex.keys
        await rig.ex.write_desired(_seeded(rig.ex.epoch), "test")
        req = ClearBadRequest(steps=(14,), who="op", time=time.time())
        await rig.store.put(keys.clear_bad("r1"), req.model_dump_json().encode())
        seen = await rig.store.get(keys.clear_bad("r1"))
        assert seen is not None
        real = rig.store.put_all_guarded

        async def unmark_fails(items: Any, *a: Any, **k: Any) -> int:
            if not items:  # the mark's delete (nothing written)
                raise TemporaryError("etcd blipped")
            return await real(items, *a, **k)

        monkeypatch.setattr(rig.store, "put_all_guarded", unmark_fails)
        await _pass(rig, seen)  # applied and audited, the mark left
        monkeypatch.setattr(rig.store, "put_all_guarded", real)
        assert rig.ex.marks_left == {keys.taken(seen.key)}
        assert await rig.store.get(keys.taken(seen.key)) is not None
        d = DesiredState.model_validate_json(await rig.desired())
        await rig.ex.apply(decide(d, Observed(now=time.time(), nodes={}, status={}), CFG), d)
        assert await rig.store.get(keys.taken(seen.key)) is None
        assert rig.ex.marks_left == set()
        (rec,) = _records(rig.audit, "clear_bad")
        assert rec["request_id"] == "r1" and rec["cleared"] == [14]
        async with _next_term(rig, tmp_path) as ex:
            assert await ex.settle_orphan_marks() == ()
            assert _records(ex.audit, "clear_bad") == []


async def test_a_request_a_lost_answer_applied_is_not_settled_again_from_an_earlier_write(
    module_plain_servers: LocalServers, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``readmit n1``: the first write taking it does not commit and its settle cannot read
    etcd (kept for a later settle); the next pass takes it again, committed, its answer
    lost. The settle audits it applied (``answer_lost``), once: no second ``readmit``
    record, no ``request_withdrawn`` for the first write. Before, the first write's settle
    found the key gone and audited the request a second time."""
    async with executor_on(module_plain_servers, tmp_path, None) as rig:
        await rig.ex.write_desired(_seeded(rig.ex.epoch), "test")
        seen = await _readmit_n1(rig, "r1")
        await _uncommitted(rig, seen, monkeypatch)
        real_put = rig.store.put_all_guarded

        async def committed(*a: Any, **k: Any) -> int:
            await real_put(*a, **k)
            raise TemporaryError("etcd restarted before it answered")

        monkeypatch.setattr(rig.store, "put_all_guarded", committed)
        with pytest.raises(TemporaryError):
            await _pass(rig, seen)
        monkeypatch.setattr(rig.store, "put_all_guarded", real_put)
        await _settle(rig)
        await _settle(rig)  # nothing more
        assert "n1" not in DesiredState.model_validate_json(await rig.desired()).node_health
        (applied,) = _records(rig.audit, "request_applied")
        assert applied["keys"] == [seen.key] and applied["answer_lost"] is True
        assert [r["request_id"] for r in _records(rig.audit, "readmit")] == ["r1"]
        assert _records(rig.audit, "request_withdrawn") == []
        assert rig.ex.uncommitted is None
        assert await rig.store.get_prefix(rig.ex.keys.takens) == []


async def test_a_withdrawn_request_is_not_applied_by_a_later_write_of_the_same_state(
    module_plain_servers: LocalServers, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``readmit n1`` (r1): its write does not commit and the settle cannot read etcd; the
    command withdraws r1 ("withdrawn"), the operator asks again (r2) and r2's write
    commits: the very state r1's would have written. The next settle audits r1 withdrawn
    (no mark of its take), r2 applied once. Before, r1 gone and the desired state equal
    to its write's, it was audited applied: a request its command reported withdrawn."""
    async with executor_on(module_plain_servers, tmp_path, None) as rig:
        await rig.ex.write_desired(_seeded(rig.ex.epoch), "test")
        seen = await _readmit_n1(rig, "r1")
        await _uncommitted(rig, seen, monkeypatch)
        await rig.store.delete(seen.key)  # the command's withdrawal
        seen2 = await _readmit_n1(rig, "r2")
        await _pass(rig, seen2)  # applied, answered
        await _settle(rig)  # after a later etcd error
        (withdrawn,) = _records(rig.audit, "request_withdrawn")
        assert withdrawn["keys"] == [seen.key] and withdrawn["answer_lost"] is True
        assert _records(rig.audit, "request_applied") == []
        assert [r["request_id"] for r in _records(rig.audit, "readmit")] == ["r2"]


async def test_a_write_that_committed_after_its_read_back_is_settled_by_its_mark(
    module_plain_servers: LocalServers, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The write taking ``readmit n1`` read back as not committed, then found committed at
    the next settle (its request gone, its mark there, written by this term): audited as
    applied with the write's phase record (``answer_lost``), once, and its mark deleted.
    The commit after the read-back is made here by the transaction's own writes."""
    async with executor_on(module_plain_servers, tmp_path, None) as rig:
        keys = rig.ex.keys
        await rig.ex.write_desired(_seeded(rig.ex.epoch), "test")
        seen = await _readmit_n1(rig, "r1")
        await _uncommitted(rig, seen, monkeypatch)
        lost = rig.ex.uncommitted
        assert lost is not None
        (take,) = lost.take
        await rig.store.put_all_guarded(
            [
                (keys.desired, lost.state.model_dump_json().encode()),
                (keys.taken(seen.key), mark_value(take, rig.ex.epoch)),
            ],
            keys.leader,
            rig.ex.epoch,
            delete=(seen.key,),
        )
        assert await rig.ex.settle_lost_takes() == (seen.key,)
        assert await rig.ex.settle_lost_takes() == ()  # once
        (applied,) = _records(rig.audit, "request_applied")
        assert applied["keys"] == [seen.key] and applied["answer_lost"] is True
        (rec,) = _records(rig.audit, "readmit")
        assert rec["request_id"] == "r1" and rec["reason"] == take.reason
        assert [r for r in _records(rig.audit, "phase") if r.get("answer_lost")] != []
        assert _records(rig.audit, "request_withdrawn") == []
        assert await rig.store.get_prefix(keys.takens) == []


async def test_a_mark_naming_fields_the_settle_sets_is_audited_bad_not_raised(
    module_plain_servers: LocalServers, tmp_path: Path
) -> None:
    """A mark an earlier term left whose record names ``taken_epoch`` and ``kind`` (no
    release writes such a record): the next leader audits the take as applied, with a
    ``take_mark_bad`` record holding the record as found, and deletes the mark. Before,
    the record's fields were passed on beside the settle's own: ``TypeError``, raised in
    every leader in turn while the mark stayed."""
    async with executor_on(module_plain_servers, tmp_path, None) as rig:
        keys = rig.ex.keys
        record = {"request_id": "r9", "reason": "x", "taken_epoch": 1, "kind": "phase"}
        mark = {"epoch": 1, "kind": "readmit", "record": record}
        await rig.store.put(keys.taken(keys.readmit("r9")), json.dumps(mark).encode())
        assert await rig.ex.settle_orphan_marks() == (keys.readmit("r9"),)
        (applied,) = _records(rig.audit, "request_applied")
        assert applied["keys"] == [keys.readmit("r9")] and applied["taken_epoch"] == 1
        (bad,) = _records(rig.audit, "take_mark_bad")
        assert bad["record"] == record and "kind, taken_epoch" in bad["cause"], bad
        assert _records(rig.audit, "readmit") == []
        assert await rig.store.get_prefix(keys.takens) == []
