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
import time
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from sailor.cli.main import app
from sailor.controller import status
from sailor.controller.decide import decide
from sailor.controller.decision_types import DecideConfig, Observed
from sailor.coordination import EtcdStore, Keys, KeyValue, connect_etcd
from sailor.localservers import LocalServers
from sailor.schemas.runtime import ClearBadRequest, DesiredState, NodeHealth, ReadmitRequest
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
