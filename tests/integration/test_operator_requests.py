"""What ``sailor node readmit`` and ``sailor checkpoint clear-bad`` answer: what happened.

A leader applies a request and deletes its key in one transaction, only while the key is
as it observed it (``Executor.write_desired``); a command that gave up withdraws its
request by a delete that holds only while the key is as written (``status._ask``). Before,
the command deleted the key and read the desired state once more: a leader that had read
the request just before wrote its state right after that read, and the operator was told
"not applied" of a request that was; and it counted a request applied whenever the state
no longer held what it named (records that went for another reason, or none held at all:
``readmit --all`` with no controller said "readmitted every node and the job").

Over a real etcd and NATS shared by the module (``module_plain_servers``), a job of its
own per test. The leader is the controller's real ``Executor`` (elected with
``campaign``) applying the real ``decide``'s actions; the test says when it reads the
request and when it writes, to place its pass on either side of the withdrawal.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from sailor.cli.main import app
from sailor.controller import daemon, status
from sailor.controller.audit import read_records
from sailor.controller.config import ControllerConfig
from sailor.controller.decide import decide
from sailor.controller.decision_types import DecideConfig, Observed
from sailor.coordination import EtcdStore, Keys, KeyValue, TemporaryError, connect_etcd
from sailor.localnet import free_port
from sailor.localservers import LocalServers
from sailor.schemas.runtime import (
    ClearBadRequest,
    CommitRecord,
    DesiredState,
    NodeHealth,
    ReadmitRequest,
)
from tests.integration.test_controller_executor import Rig, _records, executor_on

WAIT_S = 0.6
"""The command's ``--wait``."""

HELD = NodeHealth(failures=2, generation=3, exclusions=1, excluded_until=1e12, cause="x")
CFG = DecideConfig(checkpoint_dir="/ck")


async def _request(store: EtcdStore, prefix: str, timeout: float = 5.0) -> KeyValue:
    """The first request under ``prefix``, once written."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        found = await store.get_prefix(prefix)
        if found:
            return found[0]
        await asyncio.sleep(0.01)
    raise AssertionError(f"no request under {prefix}")


async def _pass(rig: Rig, seen: KeyValue) -> None:
    """One leader pass that read the request ``seen`` (its key, value and revision, as the
    daemon's mirror holds them) and the desired state as etcd holds it now."""
    keys = rig.ex.keys
    d = DesiredState.model_validate_json(await rig.desired())
    rid = seen.key.rsplit("/", 1)[1]
    if seen.key.startswith(keys.readmits):
        o = Observed(
            now=time.time(),
            nodes={},
            status={},
            readmit={rid: ReadmitRequest.model_validate_json(seen.value)},
        )
    else:
        o = Observed(
            now=time.time(),
            nodes={},
            status={},
            clear_bad={rid: ClearBadRequest.model_validate_json(seen.value)},
        )
    rig.ex.request_revisions = {seen.key: seen.mod_revision}
    await rig.ex.apply(decide(d, o, CFG), d)


def _ask(rig: Rig, ep: str, kind: str, wait_s: float = WAIT_S) -> Any:
    """The command's request (readmit n1, or clear-bad step 14) as a task."""
    job = rig.ex.keys.job
    if kind == "readmit":
        coro = status.request_readmit(ep, job, ["n1"], False, "op", None, wait_s)
    else:
        coro = status.request_clear_bad(ep, job, [14], False, "op", None, wait_s)
    return asyncio.create_task(coro, name=f"test-{kind}")


def _seeded(epoch: int) -> DesiredState:
    return DesiredState(
        epoch=epoch, generation=3, node_health={"n1": HELD, "n2": HELD}, bad_checkpoints=(7, 14)
    )


@pytest.mark.parametrize("kind", ["readmit", "clear-bad"])
async def test_a_request_withdrawn_after_the_leader_read_it_is_not_applied(
    module_plain_servers: LocalServers, tmp_path: Path, kind: str
) -> None:
    """The leader reads the request, the command gives up and withdraws it, then the
    leader's pass writes: refused, so "withdrawn" is the truth. Before, the leader's
    write went through after the command's last read and the request it reported not
    applied was applied."""
    ep = module_plain_servers.etcd_endpoint
    async with executor_on(module_plain_servers, tmp_path, None) as rig:
        await rig.ex.write_desired(_seeded(rig.ex.epoch), "test")
        prefix = rig.ex.keys.readmits if kind == "readmit" else rig.ex.keys.clear_bads
        asked = _ask(rig, ep, kind)
        seen = await _request(rig.store, prefix)
        answer = await asyncio.wait_for(asked, 10)
        await _pass(rig, seen)  # the leader's write, after the withdrawal
        d = DesiredState.model_validate_json(await rig.desired())
        assert "n1" in d.node_health and d.bad_checkpoints == (7, 14)  # nothing applied
        assert answer.outcome == "withdrawn"
        assert await rig.store.get_prefix(prefix) == []
        assert [r["keys"] for r in _records(rig.audit, "request_withdrawn")] == [[seen.key]]
        assert _records(rig.audit, "readmit") == _records(rig.audit, "clear_bad") == []


@pytest.mark.parametrize("kind", ["readmit", "clear-bad"])
async def test_a_request_the_leader_takes_in_time_says_what_it_ended(
    module_plain_servers: LocalServers, tmp_path: Path, kind: str
) -> None:
    ep = module_plain_servers.etcd_endpoint
    async with executor_on(module_plain_servers, tmp_path, None) as rig:
        await rig.ex.write_desired(_seeded(rig.ex.epoch), "test")
        prefix = rig.ex.keys.readmits if kind == "readmit" else rig.ex.keys.clear_bads
        asked = _ask(rig, ep, kind, wait_s=10)
        await _pass(rig, await _request(rig.store, prefix))
        answer = await asyncio.wait_for(asked, 10)
        d = DesiredState.model_validate_json(await rig.desired())
        assert answer.outcome == "applied" and answer.again == ()
        if kind == "readmit":
            assert answer.done == ("n1",) and set(d.node_health) == {"n2"}
        else:
            assert answer.done == ("14",) and d.bad_checkpoints == (7,)
        assert await rig.store.get_prefix(prefix) == []


def _config(tmp_path: Path, ep: str, job: str) -> Path:
    cfg = tmp_path / "controller.yaml"
    cfg.write_text(f"etcd_endpoints: [{ep}]\njob: {job}\ncheckpoint_dir: /ck\n")
    return cfg


async def _cli(*args: str) -> Any:
    """The command line in a thread: it runs its own event loop (``asyncio.run``)."""
    return await asyncio.to_thread(CliRunner().invoke, app, list(args))


async def test_readmit_says_nothing_to_readmit_or_no_controller_answered(
    module_plain_servers: LocalServers, tmp_path: Path
) -> None:
    """No controller runs. ``--all`` with no record held writes no request and says so
    (before: "readmitted every node and the job", exit status 0); a record that goes
    while the command waits (forgotten, not by this request) is no answer either (before:
    "readmitted n1")."""
    ep = module_plain_servers.etcd_endpoint
    job = f"op-{tmp_path.name}"[:40]
    keys = Keys(job=job)
    cfg = _config(tmp_path, ep, job)
    store = await connect_etcd(ep)
    try:
        await store.put(keys.desired, DesiredState(epoch=1).model_dump_json().encode())
        res = await _cli("node", "readmit", "--all", "--config", str(cfg), "--wait", "0.5")
        assert res.exit_code == 1, res.output
        assert "nothing to readmit: no node is excluded or failing" in res.output
        assert await store.get_prefix(keys.readmits) == []
        held = DesiredState(epoch=1, node_health={"n1": HELD})
        await store.put(keys.desired, held.model_dump_json().encode())
        cli = asyncio.create_task(
            _cli("node", "readmit", "n1", "--config", str(cfg), "--wait", "1"), name="test-cli"
        )
        await _request(store, keys.readmits)
        await store.put(keys.desired, DesiredState(epoch=1).model_dump_json().encode())
        res = await cli
        assert res.exit_code == 1, res.output
        assert "no controller answered within 1 s" in res.output
        assert "nothing was readmitted" in res.output
        assert await store.get_prefix(keys.readmits) == []
    finally:
        await store.close()


class _LostAnswers:
    """Connects the controller's store as ``connect_etcd`` does, and makes etcd's answer to
    the first ``lose`` combined writes that take an operator's request lost: the
    transaction commits in the real etcd, then the call raises ``TemporaryError``, as when
    etcd restarts between its commit and its answer (a restart cannot be placed there on
    purpose)."""

    def __init__(self, lose: int = 1) -> None:
        self.lose = lose
        self.lost: list[tuple[str, ...]] = []

    async def __call__(self, *args: Any, **kw: Any) -> EtcdStore:
        store = await connect_etcd(*args, **kw)
        real = store.put_all_guarded

        async def put_all_guarded(*a: Any, **k: Any) -> int:
            revision = await real(*a, **k)
            if k.get("delete") and len(self.lost) < self.lose:
                self.lost.append(tuple(k["delete"]))
                raise TemporaryError("etcd restarted before it answered")
            return revision

        store.put_all_guarded = put_all_guarded  # type: ignore[method-assign]
        return store


def _controller(servers: LocalServers, tmp_path: Path, job: str) -> ControllerConfig:
    return ControllerConfig(
        job=job,
        identity="c1",
        nats_url=servers.nats_url,
        etcd_endpoint=servers.etcd_endpoint,
        audit_log=tmp_path / "audit-c1.jsonl",
        checkpoint_dir="/ck",
        lease_ttl_s=2,
        resync_s=0.3,
        debounce_s=0.0,
        planner="data_parallel",
        global_batch_size=8,
    )


async def _gone(store: EtcdStore, prefix: str, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while await store.get_prefix(prefix):
        assert time.monotonic() < end, f"a request under {prefix} was never taken"
        await asyncio.sleep(0.05)


async def test_a_readmit_whose_answer_etcd_lost_is_not_undone_by_the_next_pass(
    module_plain_servers: LocalServers, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real controller applies ``readmit n1``: its state without n1's record and the
    delete of the request commit, but the answer is lost (``TemporaryError``). Its next
    write (a clear of step 14's mark) keeps n1 forgotten: after the error the leader
    decides from the state etcd holds. Before, it kept the state its pass had started
    from, and the clear's write put n1's record back, the request gone and the command
    told "readmitted n1"."""
    lossy = _LostAnswers()
    monkeypatch.setattr(daemon, "connect_etcd", lossy)
    ep = module_plain_servers.etcd_endpoint
    job = f"lost-{tmp_path.name}"[:40]
    keys = Keys(job=job)
    store = await connect_etcd(ep)
    ctl = daemon.Controller(_controller(module_plain_servers, tmp_path, job))
    await store.put(keys.desired, _seeded(1).model_dump_json().encode())  # before it leads
    run = asyncio.create_task(ctl.run(), name="test-controller")
    try:
        while ctl.leadership is None:
            await asyncio.sleep(0.05)
        answer = await status.request_readmit(ep, job, ["n1"], False, "op", None, 10)
        assert answer.outcome == "applied" and answer.done == ("n1",)
        assert lossy.lost and lossy.lost[0][0].startswith(keys.readmits)
        rid = answer.request_id
        answer = await status.request_clear_bad(ep, job, [14], False, "op", None, 10)
        assert answer.outcome == "applied"
        await _gone(store, keys.clear_bads)
        kv = await store.get(keys.desired)
        assert kv is not None
        d = DesiredState.model_validate_json(kv.value)
        assert d.bad_checkpoints == (7,)
        assert set(d.node_health) == {"n2"}  # n1's record stays forgotten
        assert ctl.desired is not None and "n1" not in ctl.desired.node_health
        ctl.audit.sync()
        audit = tmp_path / "audit-c1.jsonl"
        assert [r["cause"] for r in _records_of(audit, "desired_reread")]
        # the audit says the readmit was applied, its answer lost, and never that it was
        # withdrawn (a stale mirror's next take of the gone key said so, the command having
        # answered "readmitted n1")
        applied = _records_of(audit, "request_applied")
        assert [r["keys"] for r in applied] == [list(lossy.lost[0])]
        assert applied[0]["answer_lost"] is True
        withdrawn = [k for r in _records_of(audit, "request_withdrawn") for k in r["keys"]]
        assert not set(withdrawn) & set(lossy.lost[0])
        # and the readmit's own record, once, as a write that answered writes it (before,
        # none: the audit showed the request applied but not what it forgot)
        readmits = _records_of(audit, "readmit")
        assert [(r["request_id"], r["reason"]) for r in readmits] == [(rid, "forgot n1")]
        assert readmits[0]["answer_lost"] is True
    finally:
        ctl.stopping.set()
        ctl.wake()
        await asyncio.wait_for(run, 15)
        await store.close()


async def test_a_repoint_whose_delete_lost_its_answer_is_audited_by_the_leader(
    module_plain_servers: LocalServers, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real controller takes ``clear-bad 900 --repoint`` (step 900 recorded under /old,
    no mark): no desired state, the request's delete and the re-pointed record in one
    transaction, whose answer is lost. After the error the leader finds the key gone and
    audits the request applied, once, with what it re-pointed and from where. Before, the
    command said "re-pointed" and the audit had no record of the request."""
    lossy = _LostAnswers()
    monkeypatch.setattr(daemon, "connect_etcd", lossy)
    ep = module_plain_servers.etcd_endpoint
    job = f"take-{tmp_path.name}"[:40]
    keys = Keys(job=job)
    store = await connect_etcd(ep)
    ctl = daemon.Controller(_controller(module_plain_servers, tmp_path, job))
    await store.put(keys.desired, DesiredState(epoch=1, generation=3).model_dump_json().encode())
    old = CommitRecord(step=900, directory="/old")
    await store.put(keys.checkpoint(900), old.model_dump_json().encode())
    run = asyncio.create_task(ctl.run(), name="test-controller")
    try:
        while ctl.leadership is None:
            await asyncio.sleep(0.05)
        answer = await status.request_clear_bad(ep, job, [900], False, "op", None, 10, "/ck")
        assert answer.outcome == "applied" and answer.moved == ("900",), answer
        assert lossy.lost and lossy.lost[0][0].startswith(keys.clear_bads)
        audit = tmp_path / "audit-c1.jsonl"

        def records() -> list[dict[str, Any]]:
            ctl.audit.sync()
            return _records_of(audit, "clear_bad")

        end = time.monotonic() + 5
        while not records() and time.monotonic() < end:
            await asyncio.sleep(0.05)
        (rec,) = records()
        assert rec["request_id"] == answer.request_id and rec["answer_lost"] is True
        assert rec["repointed"] == [900] and rec["repointed_from"] == ["/old"]
        applied = _records_of(audit, "request_applied")
        assert [r["keys"] for r in applied] == [list(lossy.lost[0])]
        withdrawn = [k for r in _records_of(audit, "request_withdrawn") for k in r["keys"]]
        assert not set(withdrawn) & set(lossy.lost[0])
    finally:
        ctl.stopping.set()
        ctl.wake()
        await asyncio.wait_for(run, 15)
        await store.close()


def _records_of(path: Path, kind: str) -> list[dict[str, Any]]:
    return [r for r in read_records([path]) if r["kind"] == kind]


async def _put_readmit(store: EtcdStore, keys: Keys, rid: str, node: str) -> KeyValue:
    req = ReadmitRequest(nodes=(node,), who="op", time=time.time())
    await store.put(keys.readmit(rid), req.model_dump_json().encode())
    kv = await store.get(keys.readmit(rid))
    assert kv is not None
    return kv


def _readmits(*seen: KeyValue) -> Observed:
    return Observed(
        now=time.time(),
        nodes={},
        status={},
        readmit={
            kv.key.rsplit("/", 1)[1]: ReadmitRequest.model_validate_json(kv.value) for kv in seen
        },
    )


async def test_a_withdrawn_request_bundled_with_another_is_the_only_one_audited_withdrawn(
    module_plain_servers: LocalServers, tmp_path: Path
) -> None:
    """Two readmits (n1, n2) applied by one state; n2's operator withdraws it after the
    leader read both: the write is refused, only n2's key is audited withdrawn and kept out
    of the next passes while the mirror still shows it, no follow-up pass is asked for
    (``progressed``), and the next pass applies n1's. Before, both keys were audited
    withdrawn (n1's was applied the next pass), and the loop ran again at once, deciding
    the same refused write until the mirror saw the delete."""
    async with executor_on(module_plain_servers, tmp_path, None) as rig:
        keys = rig.ex.keys
        await rig.ex.write_desired(_seeded(rig.ex.epoch), "test")
        r1 = await _put_readmit(rig.store, keys, "r1", "n1")
        r2 = await _put_readmit(rig.store, keys, "r2", "n2")
        rig.ex.request_revisions = {r1.key: r1.mod_revision, r2.key: r2.mod_revision}
        await rig.store.delete(r2.key)  # the command gave up
        d = DesiredState.model_validate_json(await rig.desired())
        await rig.ex.apply(decide(d, _readmits(r1, r2), CFG), d)
        assert not rig.ex.progressed
        assert [r["keys"] for r in _records(rig.audit, "request_withdrawn")] == [[r2.key]]
        assert rig.ex.withdrawn == {r2.key: r2.mod_revision}
        assert DesiredState.model_validate_json(await rig.desired()) == d  # nothing applied
        await rig.ex.apply(decide(d, _readmits(r1), CFG), d)
        assert set(DesiredState.model_validate_json(await rig.desired()).node_health) == {"n2"}
        assert await rig.store.get_prefix(keys.readmits) == []
        assert len(_records(rig.audit, "request_withdrawn")) == 1


async def test_a_request_taken_without_an_observed_revision_is_not_applied(
    module_plain_servers: LocalServers, tmp_path: Path
) -> None:
    """A pass that takes a request whose revision it did not observe (no entry in
    ``request_revisions``) treats it as changed: nothing applied, the request left for a
    pass that observed it. Before, its delete compared nothing: a request withdrawn
    meanwhile was applied after its command said "withdrawn"."""
    async with executor_on(module_plain_servers, tmp_path, None) as rig:
        keys = rig.ex.keys
        await rig.ex.write_desired(_seeded(rig.ex.epoch), "test")
        r1 = await _put_readmit(rig.store, keys, "r1", "n1")
        rig.ex.request_revisions = {}
        d = DesiredState.model_validate_json(await rig.desired())
        await rig.ex.apply(decide(d, _readmits(r1), CFG), d)
        assert "n1" in DesiredState.model_validate_json(await rig.desired()).node_health
        assert await rig.store.get(r1.key) is not None
        assert _records(rig.audit, "readmit") == []
        assert [r["keys"] for r in _records(rig.audit, "request_withdrawn")] == [[r1.key]]


async def test_the_command_waits_and_withdraws_through_an_etcd_restart(
    module_plain_servers: LocalServers, tmp_path: Path
) -> None:
    """No controller runs; etcd restarts while ``readmit n1`` waits: the command goes on
    waiting, withdraws its request once etcd is back and says so, the key gone. Before, the
    wait's read raised ``TemporaryError``: a traceback, and the request left in etcd for any
    later leader to apply."""
    ep = module_plain_servers.etcd_endpoint
    job = f"restart-{tmp_path.name}"[:40]
    keys = Keys(job=job)
    store = await connect_etcd(ep)
    try:
        await store.put(keys.desired, _seeded(1).model_dump_json().encode())
        asked = asyncio.create_task(
            status.request_readmit(ep, job, ["n1"], False, "op", None, 3.0), name="test-readmit"
        )
        await _request(store, keys.readmits)
        await asyncio.to_thread(module_plain_servers.etcd.restart, 1.0)
        answer = await asyncio.wait_for(asked, 60)
        assert answer.outcome == "withdrawn"
        end = time.monotonic() + 20
        while True:  # the test's own client reconnects too
            try:
                assert await store.get_prefix(keys.readmits) == []
                break
            except TemporaryError:
                assert time.monotonic() < end
                await asyncio.sleep(0.2)
    finally:
        await store.close()


async def _answering(ep: str, timeout: float = 20.0) -> None:
    """Until a new client's read of etcd at ``ep`` answers."""
    end = time.monotonic() + timeout
    while True:
        try:
            probe = await connect_etcd(ep)
            try:
                await probe.get("/probe")
                return
            finally:
                await probe.close()
        except TemporaryError:
            assert time.monotonic() < end, f"etcd at {ep} does not answer"
            await asyncio.sleep(0.3)


@pytest.mark.parametrize("kind", ["readmit", "clear-bad"])
async def test_an_applied_request_whose_result_etcd_fails_to_read_back_says_applied(
    module_plain_servers: LocalServers,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    kind: str,
) -> None:
    """A leader takes the request (its key deleted); etcd stops before the command reads
    the desired state back and stays down past the read's retries. The command says the
    request was applied, that etcd failed while its result was read back (which etcd, its
    error) and where to look, exit status 0. Before: "temporary: retry", exit status 1,
    and an operator who retried asked again for what was done."""
    servers = module_plain_servers
    ep = servers.etcd_endpoint
    job = f"unread-{kind}-{tmp_path.name}"[:40]
    keys = Keys(job=job)
    cfg = _config(tmp_path, ep, job)
    real_ask = status._ask

    async def ask_then_etcd_stops(*a: Any, **k: Any) -> Any:
        got = await real_ask(*a, **k)
        if got == "applied":
            servers.etcd.stop()
        return got

    monkeypatch.setattr(status, "_ask", ask_then_etcd_stops)
    monkeypatch.setattr(status, "WITHDRAW_RETRY_S", 1.0)
    store = await connect_etcd(ep)
    try:
        await store.put(keys.desired, _seeded(1).model_dump_json().encode())
        if kind == "readmit":
            args, prefix = ["node", "readmit", "n1"], keys.readmits
        else:
            args, prefix = ["checkpoint", "clear-bad", "14"], keys.clear_bads
        cli = asyncio.create_task(
            _cli(*args, "--config", str(cfg), "--wait", "5"), name=f"test-cli-{kind}"
        )
        seen = await _request(store, prefix)
        await store.delete(seen.key)  # a leader's take
        res = await asyncio.wait_for(cli, 60)
    finally:
        if not servers.etcd.running:
            await asyncio.to_thread(servers.etcd.start)
            await _answering(ep)  # the module's etcd, for the tests after this one
        await store.close()
    assert res.exit_code == 0, res.output
    assert "temporary: retry" not in res.output
    assert "applied: the leader took request" in res.output, res.output
    assert f"etcd at {ep} failed while its result was read back" in res.output, res.output
    assert "is not known: see `sailor status`" in res.output


async def test_a_takeover_write_that_etcd_does_not_take_is_retried(
    module_plain_servers: LocalServers, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new leader's first write (its epoch on the state it takes over) met an etcd that
    did not answer (``TemporaryError``, as during a restart): the error ended the
    controller (systemd restarted it). Now it is retried, and the controller leads."""
    failed: list[str] = []

    async def flaky(*args: Any, **kw: Any) -> EtcdStore:
        store = await connect_etcd(*args, **kw)
        real = store.put_guarded

        async def put_guarded(*a: Any, **k: Any) -> int:
            if len(failed) < 2:
                failed.append(str(a[0]))
                raise TemporaryError("etcd restarting")
            return await real(*a, **k)

        store.put_guarded = put_guarded  # type: ignore[method-assign]
        return store

    monkeypatch.setattr(daemon, "connect_etcd", flaky)
    job = f"adopt-{tmp_path.name}"[:40]
    keys = Keys(job=job)
    store = await connect_etcd(module_plain_servers.etcd_endpoint)
    ctl = daemon.Controller(_controller(module_plain_servers, tmp_path, job))
    await store.put(keys.desired, _seeded(1).model_dump_json().encode())  # before it leads
    run = asyncio.create_task(ctl.run(), name="test-controller")
    try:
        async with asyncio.timeout(20):
            while ctl.leadership is None:
                assert not run.done(), run.exception() if run.done() else None
                await asyncio.sleep(0.05)
        assert failed and all(k == keys.desired for k in failed)
        kv = await store.get(keys.desired)
        assert kv is not None
        assert DesiredState.model_validate_json(kv.value).epoch == ctl.leadership.epoch
    finally:
        ctl.stopping.set()
        ctl.wake()
        await asyncio.wait_for(run, 15)
        await store.close()


async def test_a_desired_state_gone_after_an_etcd_error_fails_the_controller(
    module_plain_servers: LocalServers, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a pass that an etcd error cut short the leader reads its state back; if the
    key is gone (deleted by hand, a wrong restore) it fails loudly. Taking that for a fence
    ended the term quietly, and the next term, finding no state, led from a blank one
    (generations from 0), which the takeover refuses."""
    job = f"gone-{tmp_path.name}"[:40]
    keys = Keys(job=job)

    async def cut(*args: Any, **kw: Any) -> EtcdStore:
        store = await connect_etcd(*args, **kw)
        real = store.put_all_guarded

        async def put_all_guarded(*a: Any, **k: Any) -> int:
            if k.get("delete"):  # the readmit's write: the state is deleted, no answer
                await store.delete(keys.desired)
                raise TemporaryError("etcd restarted before it answered")
            return await real(*a, **k)

        store.put_all_guarded = put_all_guarded  # type: ignore[method-assign]
        return store

    monkeypatch.setattr(daemon, "connect_etcd", cut)
    store = await connect_etcd(module_plain_servers.etcd_endpoint)
    await store.put(keys.desired, _seeded(1).model_dump_json().encode())
    ctl = daemon.Controller(_controller(module_plain_servers, tmp_path, job))
    run = asyncio.create_task(ctl.run(), name="test-controller")
    try:
        async with asyncio.timeout(20):
            while ctl.leadership is None:
                await asyncio.sleep(0.05)
        await store.put(
            keys.readmit("r1"), ReadmitRequest(nodes=("n1",)).model_dump_json().encode()
        )
        async with asyncio.timeout(20):
            while ctl.failure is None:
                await asyncio.sleep(0.05)
        assert "gone" in ctl.failure
    finally:
        ctl.stopping.set()
        ctl.wake()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(run, 15)
        await store.close()


class _LostWrite:
    """Connects the command's store as ``connect_etcd`` does, and makes etcd's answer to
    the command's first write of its request lost: the write commits in the real etcd, the
    test's ``meanwhile`` runs (a leader's pass, say), then the call raises
    ``TemporaryError``, as when etcd restarts between its commit and its answer. Both
    writes a command has used are wrapped: ``put_witnessed`` (the request and its witness)
    and a bare ``put``."""

    def __init__(self, meanwhile: Any = None) -> None:
        self.meanwhile = meanwhile
        self.lost: list[str] = []

    async def __call__(self, *args: Any, **kw: Any) -> EtcdStore:
        store = await connect_etcd(*args, **kw)
        for name in ("put", "put_witnessed"):
            real = getattr(store, name, None)
            if real is not None:
                setattr(store, name, self._lossy(real))
        return store

    def _lossy(self, real: Any) -> Any:
        async def write(key: str, *a: Any, **k: Any) -> Any:
            got = await real(key, *a, **k)
            if not self.lost:
                self.lost.append(key)
                if self.meanwhile is not None:
                    await self.meanwhile(key)
                raise TemporaryError("etcd restarted before it answered")
            return got

        return write


@pytest.mark.parametrize("kind", ["readmit", "clear-bad"])
async def test_a_request_whose_write_lost_its_answer_is_found_and_answered(
    module_plain_servers: LocalServers,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    kind: str,
) -> None:
    """The command's write of its request commits, its answer is lost, and a leader takes
    the request before the command looks again: the command learns from the request's
    witness that its write committed and answers "applied", with what the request ended.
    Before, the lost answer ended the command (``TemporaryError``: "temporary: retry")
    while the leader applied the request: the operator could not tell it happened, and a
    retry would ask again."""
    ep = module_plain_servers.etcd_endpoint
    async with executor_on(module_plain_servers, tmp_path, None) as rig:
        await rig.ex.write_desired(_seeded(rig.ex.epoch), "test")
        prefix = rig.ex.keys.readmits if kind == "readmit" else rig.ex.keys.clear_bads

        async def leader_takes(key: str) -> None:
            await _pass(rig, await _request(rig.store, prefix))
            assert await rig.store.get(key) is None  # taken: the key is gone

        lossy = _LostWrite(leader_takes)
        monkeypatch.setattr(status, "connect_etcd", lossy)
        answer = await asyncio.wait_for(_ask(rig, ep, kind, wait_s=10), 30)
        assert lossy.lost and lossy.lost[0].startswith(prefix)
        assert answer.outcome == "applied"
        assert answer.done == (("n1",) if kind == "readmit" else ("14",))
        assert await rig.store.get_prefix(prefix) == []
        assert await rig.store.get_prefix(rig.ex.keys.asked) == []  # the witness went too
        record = "readmit" if kind == "readmit" else "clear_bad"
        assert [r["request_id"] for r in _records(rig.audit, record)] == [answer.request_id]


async def test_readmit_whose_write_lost_its_answer_withdraws_it_with_no_controller(
    module_plain_servers: LocalServers, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No controller runs; the command's write commits and its answer is lost. The command
    finds its request there, waits, withdraws it and says so (exit status 1), the key and
    its witness gone. Before: ``error: etcd restarted before it answered: temporary:
    retry``, and the request left in etcd for the next leader to apply."""
    lossy = _LostWrite()
    monkeypatch.setattr(status, "connect_etcd", lossy)
    ep = module_plain_servers.etcd_endpoint
    job = f"lostput-{tmp_path.name}"[:40]
    keys = Keys(job=job)
    store = await connect_etcd(ep)
    try:
        await store.put(keys.desired, _seeded(1).model_dump_json().encode())
        cfg = _config(tmp_path, ep, job)
        res = await _cli("node", "readmit", "n1", "--config", str(cfg), "--wait", "1")
        assert lossy.lost, "the command wrote no request"
        assert res.exit_code == 1, res.output
        assert "no controller answered within 1 s" in res.output
        assert "nothing was readmitted" in res.output
        assert "temporary" not in res.output and "Traceback" not in res.output
        assert await store.get_prefix(keys.readmits) == []
        assert await store.get_prefix(keys.asked) == []
    finally:
        await store.close()


async def test_the_command_writes_its_request_through_an_etcd_restart(
    module_plain_servers: LocalServers, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """etcd goes down just as ``readmit n1`` writes its request (no controller runs) and
    comes back a second later: the write is tried again within the command's wait, and the
    command then waits and withdraws as ever (``withdrawn``, the key gone). Before, the
    write's ``UnavailableError`` ended the command."""
    servers = module_plain_servers
    down: list[asyncio.Task[None]] = []

    async def flaky(*args: Any, **kw: Any) -> EtcdStore:
        store = await connect_etcd(*args, **kw)
        for name in ("put", "put_witnessed"):
            real = getattr(store, name, None)
            if real is not None:
                setattr(store, name, _after_a_restart(real))
        return store

    def _after_a_restart(real: Any) -> Any:
        async def write(*a: Any, **k: Any) -> Any:
            if not down:
                await asyncio.to_thread(servers.etcd.stop)
                down.append(
                    asyncio.create_task(
                        asyncio.to_thread(_start_later, servers, 1.0), name="test-etcd-start"
                    )
                )
            return await real(*a, **k)

        return write

    monkeypatch.setattr(status, "connect_etcd", flaky)
    ep = servers.etcd_endpoint
    job = f"putrestart-{tmp_path.name}"[:40]
    keys = Keys(job=job)
    store = await connect_etcd(ep)
    try:
        await store.put(keys.desired, _seeded(1).model_dump_json().encode())
        answer = await asyncio.wait_for(
            status.request_readmit(ep, job, ["n1"], False, "op", None, 6.0), 60
        )
        assert down, "the command wrote no request"
        await down[0]
        assert answer.outcome == "withdrawn"
        end = time.monotonic() + 20
        while True:  # the test's own client reconnects too
            try:
                assert await store.get_prefix(keys.readmits) == []
                assert await store.get_prefix(keys.asked) == []
                break
            except TemporaryError:
                assert time.monotonic() < end
                await asyncio.sleep(0.2)
    finally:
        if down:
            await down[0]
        await store.close()


def _start_later(servers: LocalServers, down_s: float) -> None:
    time.sleep(down_s)
    servers.etcd.start()


@pytest.mark.parametrize("committed", [True, False])
async def test_a_clear_bad_whose_answer_was_lost_is_audited_once(
    module_plain_servers: LocalServers,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    committed: bool,
) -> None:
    """A leader's write that applies ``clear-bad 14`` meets an etcd error. Committed (its
    answer lost), the read-back settles it: the ``clear_bad`` record is written with the
    ``request_applied`` one, and once only, however often it is settled again or the
    stale mirror shows the request. Not committed, settling writes none and the next pass
    applies and audits it, once. Before, a committed write whose answer was lost left no
    ``clear_bad`` record: the audit checker held step 14 unreadable."""
    async with executor_on(module_plain_servers, tmp_path, None) as rig:
        keys = rig.ex.keys
        await rig.ex.write_desired(_seeded(rig.ex.epoch), "test")
        req = ClearBadRequest(steps=(14,), who="op", time=time.time())
        await rig.store.put(keys.clear_bad("r1"), req.model_dump_json().encode())
        seen = await rig.store.get(keys.clear_bad("r1"))
        assert seen is not None
        real = rig.store.put_all_guarded

        async def lossy(*a: Any, **k: Any) -> int:
            if committed:
                await real(*a, **k)
            raise TemporaryError("etcd restarted before it answered")

        monkeypatch.setattr(rig.store, "put_all_guarded", lossy)
        with pytest.raises(TemporaryError):
            await _pass(rig, seen)
        monkeypatch.setattr(rig.store, "put_all_guarded", real)
        held = DesiredState.model_validate_json(await rig.desired())
        settled = rig.ex.settle_lost(held)
        assert settled == ((seen.key,) if committed else ())
        assert rig.ex.settle_lost(held) == ()  # settled once
        if committed:
            # the daemon keeps the gone key out of the passes while its mirror shows it
            assert rig.ex.withdrawn == {seen.key: seen.mod_revision}
        else:
            await _pass(rig, seen)  # the request is still there: the next pass applies it
        assert DesiredState.model_validate_json(await rig.desired()).bad_checkpoints == (7,)
        assert await rig.store.get(seen.key) is None
        records = _records(rig.audit, "clear_bad")
        assert [(r["request_id"], r["cleared"]) for r in records] == [("r1", [14])]
        assert records[0].get("answer_lost", False) is committed
        assert len(_records(rig.audit, "request_applied")) == int(committed)


@pytest.mark.parametrize("kind", ["readmit", "clear-bad"])
async def test_a_write_that_did_not_commit_and_whose_request_was_withdrawn_says_withdrawn(
    module_plain_servers: LocalServers,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    kind: str,
) -> None:
    """A leader's desired state that applies the request meets an etcd error and does not
    commit; the command's wait ends and its withdrawal succeeds ("withdrawn"). The settle
    after the error audits the request ``request_withdrawn`` (``answer_lost``), once, and
    no ``readmit``/``clear_bad``: no later pass sees the request to audit it. Before, the
    request had no record at all. A request still there is left to the next pass."""
    async with executor_on(module_plain_servers, tmp_path, None) as rig:
        keys = rig.ex.keys
        await rig.ex.write_desired(_seeded(rig.ex.epoch), "test")
        if kind == "readmit":
            key = keys.readmit("r1")
            body = ReadmitRequest(nodes=("n1",), who="op", time=time.time())
        else:
            key = keys.clear_bad("r1")
            body = ClearBadRequest(steps=(14,), who="op", time=time.time())
        await rig.store.put(key, body.model_dump_json().encode())
        seen = await rig.store.get(key)
        assert seen is not None
        real = rig.store.put_all_guarded

        async def refused(*a: Any, **k: Any) -> int:
            raise TemporaryError("etcd restarted before it committed")

        monkeypatch.setattr(rig.store, "put_all_guarded", refused)
        with pytest.raises(TemporaryError):
            await _pass(rig, seen)
        monkeypatch.setattr(rig.store, "put_all_guarded", real)
        assert await status._withdrawn(rig.store, seen.key, seen.mod_revision) == "withdrawn"
        held = DesiredState.model_validate_json(await rig.desired())
        assert held == _seeded(rig.ex.epoch)  # not committed
        assert rig.ex.settle_lost(held) == ()
        assert await rig.ex.settle_lost_takes() == ()
        assert await rig.ex.settle_lost_takes() == ()  # settled once
        (rec,) = _records(rig.audit, "request_withdrawn")
        assert rec["keys"] == [seen.key] and rec["answer_lost"] is True, rec
        assert _records(rig.audit, "readmit") == _records(rig.audit, "clear_bad") == []
        assert _records(rig.audit, "request_applied") == []
        assert rig.ex.withdrawn == {seen.key: seen.mod_revision}  # out of the stale passes


async def test_a_write_that_did_not_commit_leaves_a_request_still_there_to_the_next_pass(
    module_plain_servers: LocalServers, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As above, the request not withdrawn: the settle writes nothing for it and the next
    pass applies and audits it, once (not withdrawn)."""
    async with executor_on(module_plain_servers, tmp_path, None) as rig:
        keys = rig.ex.keys
        await rig.ex.write_desired(_seeded(rig.ex.epoch), "test")
        body = ReadmitRequest(nodes=("n1",), who="op", time=time.time())
        await rig.store.put(keys.readmit("r1"), body.model_dump_json().encode())
        seen = await rig.store.get(keys.readmit("r1"))
        assert seen is not None
        real = rig.store.put_all_guarded

        async def refused(*a: Any, **k: Any) -> int:
            raise TemporaryError("etcd restarted before it committed")

        monkeypatch.setattr(rig.store, "put_all_guarded", refused)
        with pytest.raises(TemporaryError):
            await _pass(rig, seen)
        monkeypatch.setattr(rig.store, "put_all_guarded", real)
        held = DesiredState.model_validate_json(await rig.desired())
        assert rig.ex.settle_lost(held) == ()
        assert await rig.ex.settle_lost_takes() == ()
        await _pass(rig, seen)
        assert await rig.ex.settle_lost_takes() == ()
        assert [r["request_id"] for r in _records(rig.audit, "readmit")] == ["r1"]
        assert _records(rig.audit, "request_withdrawn") == []
        assert "n1" not in DesiredState.model_validate_json(await rig.desired()).node_health


@pytest.mark.parametrize("committed", [True, False])
async def test_a_state_whose_answer_was_lost_gets_its_phase_record_once(
    module_plain_servers: LocalServers,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    committed: bool,
) -> None:
    """A leader's write of a desired state (no request taken) meets an etcd error.
    Committed (its answer lost), the read-back settles it: its ``phase`` record is written
    then (``answer_lost``), once. Not committed, none is. Before, a committed write whose
    answer was lost had no phase record: the audit missed the state etcd held."""
    async with executor_on(module_plain_servers, tmp_path, None) as rig:
        await rig.ex.write_desired(_seeded(rig.ex.epoch), "test")
        nxt = _seeded(rig.ex.epoch).model_copy(update={"generation": 4, "cause": "lost one"})
        real = rig.store.put_guarded

        async def lossy(*a: Any, **k: Any) -> None:
            if committed:
                await real(*a, **k)
            raise TemporaryError("etcd restarted before it answered")

        monkeypatch.setattr(rig.store, "put_guarded", lossy)
        with pytest.raises(TemporaryError):
            await rig.ex.write_desired(nxt, "generation 4, its answer lost")
        monkeypatch.setattr(rig.store, "put_guarded", real)
        held = DesiredState.model_validate_json(await rig.desired())
        assert (held == nxt) is committed
        assert rig.ex.settle_lost(held) == ()  # it took no request
        assert rig.ex.settle_lost(held) == ()
        phases = [r for r in _records(rig.audit, "phase") if r["generation"] == 4]
        if committed:
            (rec,) = phases
            assert rec["cause"] == "generation 4, its answer lost" and rec["answer_lost"]
        else:
            assert phases == []


@pytest.mark.parametrize("committed", [True, False])
async def test_a_request_deleted_alone_whose_answer_was_lost_is_audited_once(
    module_plain_servers: LocalServers,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    committed: bool,
) -> None:
    """``clear-bad 99`` names no mark there is: the leader deletes it with no desired state
    (``_take``), and that delete meets an etcd error. Committed (its answer lost), the
    settle after the error finds the key gone and writes the ``request_applied`` and
    ``clear_bad`` records, once. Not committed, the next pass takes it and audits it, once.
    Before, a committed delete whose answer was lost left no record of the request."""
    async with executor_on(module_plain_servers, tmp_path, None) as rig:
        keys = rig.ex.keys
        await rig.ex.write_desired(_seeded(rig.ex.epoch), "test")
        req = ClearBadRequest(steps=(99,), who="op", time=time.time())
        await rig.store.put(keys.clear_bad("r1"), req.model_dump_json().encode())
        seen = await rig.store.get(keys.clear_bad("r1"))
        assert seen is not None
        real = rig.store.put_all_guarded

        async def lossy(*a: Any, **k: Any) -> int:
            if committed:
                await real(*a, **k)
            raise TemporaryError("etcd restarted before it answered")

        monkeypatch.setattr(rig.store, "put_all_guarded", lossy)
        with pytest.raises(TemporaryError):
            await _pass(rig, seen)
        monkeypatch.setattr(rig.store, "put_all_guarded", real)
        settled = await rig.ex.settle_lost_takes()
        assert settled == ((seen.key,) if committed else ())
        assert await rig.ex.settle_lost_takes() == ()  # settled once
        if not committed:
            await _pass(rig, seen)  # still there: the next pass takes it
        assert await rig.store.get(seen.key) is None
        records = _records(rig.audit, "clear_bad")
        assert [(r["request_id"], r["cleared"]) for r in records] == [("r1", [])]
        assert "no bad or suspect mark on step 99" in records[0]["reason"]
        assert records[0].get("answer_lost", False) is committed
        assert len(_records(rig.audit, "request_applied")) == int(committed)


async def _lost_repoint_take(
    rig: Rig, monkeypatch: pytest.MonkeyPatch, committed: bool
) -> tuple[KeyValue, CommitRecord]:
    """``clear-bad 300 --repoint`` (step 300 recorded under /old, no mark) read by a leader
    pass whose take (the re-pointed record and the request's delete, no desired state)
    meets an etcd error, ``committed`` or not: the request as read, and the old record."""
    keys = rig.ex.keys
    await rig.ex.write_desired(DesiredState(epoch=rig.ex.epoch, generation=3), "test")
    old = CommitRecord(step=300, directory="/old")
    await rig.store.put(keys.checkpoint(300), old.model_dump_json().encode())
    req = ClearBadRequest(steps=(300,), who="op", time=time.time(), repoint=True)
    await rig.store.put(keys.clear_bad("r1"), req.model_dump_json().encode())
    seen = await rig.store.get(keys.clear_bad("r1"))
    assert seen is not None
    d = DesiredState.model_validate_json(await rig.desired())
    o = Observed(now=time.time(), nodes={}, status={}, commits=(old,), clear_bad={"r1": req})
    real = rig.store.put_all_guarded

    async def lossy(*a: Any, **k: Any) -> int:
        if committed:
            await real(*a, **k)
        raise TemporaryError("etcd restarted before it answered")

    rig.ex.request_revisions = {seen.key: seen.mod_revision}
    monkeypatch.setattr(rig.store, "put_all_guarded", lossy)
    with pytest.raises(TemporaryError):
        await rig.ex.apply(decide(d, o, CFG), d)
    monkeypatch.setattr(rig.store, "put_all_guarded", real)
    return seen, old


async def _directory(store: EtcdStore, keys: Keys, step: int) -> str:
    kv = await store.get(keys.checkpoint(step))
    assert kv is not None
    return CommitRecord.model_validate_json(kv.value).directory


async def test_a_repoint_take_that_did_not_commit_and_was_withdrawn_is_not_applied(
    module_plain_servers: LocalServers, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A leader's take of ``clear-bad 300 --repoint`` meets an etcd error and does not
    commit; the command's wait ends and its withdrawal succeeds ("withdrawn"). The settle
    after the error audits the request withdrawn, once, and writes no ``clear_bad``: the
    record still names /old. Before, the key gone counted as the take committed:
    ``request_applied`` and ``clear_bad`` with ``repointed: [300]`` were written, the
    record unchanged and the command told "withdrawn"."""
    async with executor_on(module_plain_servers, tmp_path, None) as rig:
        keys = rig.ex.keys
        seen, _ = await _lost_repoint_take(rig, monkeypatch, committed=False)
        assert await status._withdrawn(rig.store, seen.key, seen.mod_revision) == "withdrawn"
        assert await rig.ex.settle_lost_takes() == ()
        assert await rig.ex.settle_lost_takes() == ()  # settled once
        assert await _directory(rig.store, keys, 300) == "/old"
        assert _records(rig.audit, "clear_bad") == []
        assert _records(rig.audit, "request_applied") == []
        (rec,) = _records(rig.audit, "request_withdrawn")
        assert rec["keys"] == [seen.key] and rec["answer_lost"] is True
        assert rig.ex.withdrawn == {seen.key: seen.mod_revision}  # out of the stale passes
        assert await rig.store.get_prefix(keys.takens) == []


async def test_a_lost_take_retaken_from_a_stale_mirror_is_audited_applied_only(
    module_plain_servers: LocalServers, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A leader's take of ``clear-bad 300 --repoint`` commits, its answer lost; the
    settle after the error cannot read etcd, and the next pass, its mirror still showing
    the request, takes it again: refused (the key is gone). The audit says applied, once,
    with what it re-pointed, never withdrawn, and the take's mark is gone. Before, the
    refused take wrote ``request_withdrawn`` and a later settle ``request_applied``: both
    outcomes for one request."""
    async with executor_on(module_plain_servers, tmp_path, None) as rig:
        keys = rig.ex.keys
        seen, old = await _lost_repoint_take(rig, monkeypatch, committed=True)
        real_get = rig.store.get

        async def down(*a: Any, **k: Any) -> Any:
            raise TemporaryError("etcd restarting")

        monkeypatch.setattr(rig.store, "get", down)
        assert await rig.ex.settle_lost_takes() == ()  # not known: kept
        monkeypatch.setattr(rig.store, "get", real_get)
        d = DesiredState.model_validate_json(await rig.desired())
        req = ClearBadRequest.model_validate_json(seen.value)
        o = Observed(now=time.time(), nodes={}, status={}, commits=(old,), clear_bad={"r1": req})
        rig.ex.request_revisions = {seen.key: seen.mod_revision}  # the stale mirror
        await rig.ex.apply(decide(d, o, CFG), d)
        assert await rig.ex.settle_lost_takes() == ()
        assert await _directory(rig.store, keys, 300) == "/ck"
        withdrawn = [k for r in _records(rig.audit, "request_withdrawn") for k in r["keys"]]
        assert withdrawn == []
        assert [r["keys"] for r in _records(rig.audit, "request_applied")] == [[seen.key]]
        (rec,) = _records(rig.audit, "clear_bad")
        assert rec["repointed"] == [300] and rec["repointed_from"] == ["/old"]
        assert rec["answer_lost"] is True
        assert await rig.store.get_prefix(keys.takens) == []


async def test_a_lost_take_whose_leader_lost_its_lease_is_still_known_by_its_mark(
    module_plain_servers: LocalServers, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A take whose answer was lost, settled after the leader's lease went: its mark is
    bound to no lease, so it still says the take committed: ``request_applied`` and the
    ``clear_bad`` record, and the mark goes. Before, the mark went with the lease and the
    settle said ``request_unknown`` of a take that had committed."""
    async with executor_on(module_plain_servers, tmp_path, None) as rig:
        seen, _ = await _lost_repoint_take(rig, monkeypatch, committed=True)
        await rig.store.call(rig.store.client.revoke_lease(rig.lead.lease.id))
        assert await rig.ex.settle_lost_takes() == (seen.key,)
        assert [r["keys"] for r in _records(rig.audit, "request_applied")] == [[seen.key]]
        (rec,) = _records(rig.audit, "clear_bad")
        assert rec["repointed"] == [300] and rec["answer_lost"] is True
        assert _records(rig.audit, "request_unknown") == []


async def test_a_lost_take_with_no_mark_after_the_term_is_audited_unknown(
    module_plain_servers: LocalServers, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A take whose answer was lost did not commit, its command withdrew the request, and
    the leader's term is over (its lease gone) when it settles: no mark could mean that,
    or a next leader that audited the take from its mark and deleted it, so the audit says
    ``request_unknown``, never applied nor withdrawn."""
    async with executor_on(module_plain_servers, tmp_path, None) as rig:
        seen, _ = await _lost_repoint_take(rig, monkeypatch, committed=False)
        assert await status._withdrawn(rig.store, seen.key, seen.mod_revision) == "withdrawn"
        await rig.store.call(rig.store.client.revoke_lease(rig.lead.lease.id))
        assert await rig.ex.settle_lost_takes() == ()
        assert [r["keys"] for r in _records(rig.audit, "request_unknown")] == [[seen.key]]
        assert _records(rig.audit, "request_applied") == []
        assert _records(rig.audit, "request_withdrawn") == []
        assert _records(rig.audit, "clear_bad") == []


@pytest.mark.parametrize("kind", ["readmit", "clear-bad"])
async def test_a_request_etcd_failed_before_it_was_written_says_so(
    module_plain_servers: LocalServers, tmp_path: Path, kind: str
) -> None:
    """etcd does not answer at all (nothing listens at the config's endpoint, a member
    that is down): the command ends in one line that names the endpoint, etcd's error and
    that nothing was written. Before: "etcd unavailable (...): temporary: retry", neither
    which etcd nor whether the request was written."""
    # a port nothing listens on, drawn below the ephemeral range: a port the kernel picked
    # (bind to 0) is one it hands out next to another test's listener (a gloo rank's), which
    # the command's connects for a second would then reach
    ep = f"127.0.0.1:{free_port()}"
    cfg = _config(tmp_path, ep, f"down-{kind}")
    if kind == "readmit":
        res = await _cli("node", "readmit", "n1", "--config", str(cfg), "--wait", "1")
    else:
        res = await _cli("checkpoint", "clear-bad", "14", "--config", str(cfg), "--wait", "1")
    out = " ".join(res.output.split())
    assert res.exit_code == 1, res.output
    assert res.output.startswith("error: ") and res.output.count("\n") == 1, res.output
    assert f"etcd at {ep} failed while" in out, out
    assert "before the request was written" in out and "nothing was written" in out, out
    assert "connect" in out.lower()  # etcd's own error, kept
    assert "temporary: retry" not in out
    # the healthy etcd of the module holds no request of this job either
    store = await connect_etcd(module_plain_servers.etcd_endpoint)
    try:
        assert await store.get_prefix(f"/sailor/down-{kind}/") == []
    finally:
        await store.close()


class _SlowWrite:
    """Connects the command's store as ``connect_etcd`` does; every write of its request
    (``put_witnessed``) times out at the caller, and the first one, still on its way to
    etcd, reaches it only after the command's next look at the witness: a transaction
    etcd commits after the command's retries gave up. ``silent``: from the first write on
    etcd answers nothing else either (reads, the witness's close)."""

    def __init__(self, silent: bool = False) -> None:
        self.silent = silent
        self.late: list[Any] = []  # the first write, sent late: () -> its result
        self.late_result: list[Any] = []

    async def __call__(self, *args: Any, **kw: Any) -> EtcdStore:
        store = await connect_etcd(*args, **kw)
        real_put = store.put_witnessed

        async def put_witnessed(*a: Any, **k: Any) -> Any:
            if not self.late:
                self.late.append(lambda: real_put(*a, **k))
            raise TemporaryError("etcd did not answer within 2 s")

        async def after_a_look(real: Any, *a: Any, **k: Any) -> Any:
            if self.silent and self.late:  # silent from the first write on
                raise TemporaryError("etcd did not answer within 2 s")
            got = await real(*a, **k)
            if self.late and not self.late_result:  # the late write lands now
                self.late_result.append(await self.late[0]())
            return got

        for name in ("get", "create_if_absent"):
            real = getattr(store, name)
            setattr(store, name, _bound(after_a_look, real))
        store.put_witnessed = put_witnessed  # type: ignore[method-assign]
        return store


def _bound(f: Any, real: Any) -> Any:
    async def call(*a: Any, **k: Any) -> Any:
        return await f(real, *a, **k)

    return call


@pytest.mark.parametrize("kind", ["readmit", "clear-bad"])
async def test_a_request_no_write_answered_is_unwritten_and_stays_so(
    module_plain_servers: LocalServers,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    kind: str,
) -> None:
    """No write of the request answers within ``--wait``, and the first, delayed, reaches
    etcd just after the command looks: the command closes the witness, so that write is
    refused, and "etcd took no write" (exit status 1) is the truth: no request in etcd,
    none applied later. Before, the command read the witness (absent), answered
    "unwritten", and the late write then put the request in etcd for the next leader."""
    slow = _SlowWrite()
    monkeypatch.setattr(status, "connect_etcd", slow)
    ep = module_plain_servers.etcd_endpoint
    job = f"slow-{kind}-{tmp_path.name}"[:40]
    keys = Keys(job=job)
    store = await connect_etcd(ep)
    try:
        await store.put(keys.desired, _seeded(1).model_dump_json().encode())
        cfg = _config(tmp_path, ep, job)
        if kind == "readmit":
            res = await _cli("node", "readmit", "n1", "--config", str(cfg), "--wait", "1")
            prefix, nothing = keys.readmits, "nothing was readmitted"
        else:
            res = await _cli("checkpoint", "clear-bad", "14", "--config", str(cfg), "--wait", "1")
            prefix, nothing = keys.clear_bads, "no mark was cleared"
        assert slow.late and slow.late_result, "no late write was sent"
        assert slow.late_result == [None]  # refused: the witness was closed first
        out = " ".join(res.output.split())
        assert res.exit_code == 1, res.output
        assert "etcd took no write of request" in out and "within 1 s" in out, out
        assert nothing in out and "is etcd up?" in out
        assert await store.get_prefix(prefix) == []
        witnesses = await store.get_prefix(keys.asked)
        assert [w.value for w in witnesses] == [b"closed"]  # until its lease expires
    finally:
        await store.close()


@pytest.mark.parametrize("kind", ["readmit", "clear-bad"])
async def test_a_request_whose_write_and_close_etcd_never_answered_is_unconfirmed(
    module_plain_servers: LocalServers,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    kind: str,
) -> None:
    """etcd grants the command's lease, then answers nothing: neither the writes nor the
    witness's close. The command says so, with where the request may wait and what to
    check (exit status 1), not "unwritten": the first write may have committed."""
    monkeypatch.setattr(status, "connect_etcd", _SlowWrite(silent=True))
    monkeypatch.setattr(status, "WITHDRAW_RETRY_S", 1.0)
    ep = module_plain_servers.etcd_endpoint
    job = f"silent-{kind}-{tmp_path.name}"[:40]
    store = await connect_etcd(ep)
    try:
        await store.put(Keys(job=job).desired, _seeded(1).model_dump_json().encode())
        cfg = _config(tmp_path, ep, job)
        if kind == "readmit":
            res = await _cli("node", "readmit", "n1", "--config", str(cfg), "--wait", "1")
        else:
            res = await _cli("checkpoint", "clear-bad", "14", "--config", str(cfg), "--wait", "1")
        out = " ".join(res.output.split())
        assert res.exit_code == 1, res.output
        assert "etcd lost its answer to the write of request" in out, out
        assert f"/sailor/{job}/{kind}/" in out and "or have been applied" in out
        assert ("`readmit`" if kind == "readmit" else "`clear_bad`") in out
        assert "Traceback" not in out and "temporary" not in out
    finally:
        await store.close()


@pytest.mark.parametrize("marked", [True, False])
async def test_clear_bad_repoint_rewrites_the_records_with_the_request(
    module_plain_servers: LocalServers, tmp_path: Path, marked: bool
) -> None:
    """The checkpoint storage moved (/old copied to /ck, the checkpoint_dir): ``clear-bad
    --all --repoint`` has the leader re-point the record of step 900 to /ck in the
    transaction that deletes the request (and, marked, clears its mark); the command reads
    it back. Before, no request could say so: the launch read /old, and the job was held."""
    ep = module_plain_servers.etcd_endpoint
    async with executor_on(module_plain_servers, tmp_path, None) as rig:
        keys = rig.ex.keys
        bad = (900,) if marked else ()
        await rig.ex.write_desired(
            DesiredState(epoch=rig.ex.epoch, generation=3, bad_checkpoints=bad), "test"
        )
        old = CommitRecord(step=900, directory="/old")
        await rig.store.put(keys.checkpoint(900), old.model_dump_json().encode())
        asked = asyncio.create_task(
            status.request_clear_bad(ep, keys.job, (), True, "op", None, 10.0, repoint="/ck"),
            name="test-repoint",
        )
        seen = await _request(rig.store, keys.clear_bads)
        assert ClearBadRequest.model_validate_json(seen.value).repoint
        d = DesiredState.model_validate_json(await rig.desired())
        rid = seen.key.rsplit("/", 1)[1]
        o = Observed(
            now=time.time(),
            nodes={},
            status={},
            commits=(old,),
            clear_bad={rid: ClearBadRequest.model_validate_json(seen.value)},
        )
        rig.ex.request_revisions = {seen.key: seen.mod_revision}
        await rig.ex.apply(decide(d, o, CFG), d)
        answer = await asyncio.wait_for(asked, 10)
        assert answer.outcome == "applied" and answer.moved == ("900",) and not answer.unmoved
        assert answer.done == (("900",) if marked else ())
        kv = await rig.store.get(keys.checkpoint(900))
        assert kv is not None and CommitRecord.model_validate_json(kv.value).directory == "/ck"
        assert DesiredState.model_validate_json(await rig.desired()).bad_checkpoints == ()
        (rec,) = _records(rig.audit, "clear_bad")
        assert rec["repointed"] == [900] and rec["directory"] == "/ck"
        assert await rig.store.get_prefix(keys.clear_bads) == []
