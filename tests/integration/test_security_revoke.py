"""Revoking a node's credentials (``sailor certs revoke``) against the real etcd and nats-server.

Before the revocation node-a writes its status and publishes its events; after it, etcd
refuses its certificate (its user and role are gone) and nats-server its login (gone from
the config, which the server reloaded on SIGHUP as ``systemctl reload sailor-nats`` does):
its open connections (closed by the server) as well as new ones. node-b is untouched. A
second run changes nothing; an unknown name and a controller are refused, naming them.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Callable

import pytest
from typer.testing import CliRunner

from sailor.cli.main import app
from sailor.controller.audit import read_records, timeline
from sailor.coordination import (
    CoordinationError,
    Keys,
    NatsCommands,
    NatsEventBus,
    PermanentError,
    close_nats,
    connect_etcd,
    connect_nats,
)
from sailor.coordination.revocation import NotANodeError, UnknownNodeError, revoke_node
from sailor.coordination.security.certs import CertKind
from sailor.coordination.security.pki import Role, issue_cert
from sailor.localservers import LocalServers
from tests.integration.conftest import IDENTITIES
from tests.integration.secure_servers import CONTROLLER, JOB, Pki

KEYS = Keys(job=JOB)


def _sighup(servers: LocalServers) -> Callable[[], None]:
    def reload() -> None:
        assert servers.nats.proc is not None
        os.kill(servers.nats.proc.pid, signal.SIGHUP)  # the server we started (ExecReload)

    return reload


async def _refused_by_nats(url: str, pki: Pki, node: str, within_s: float = 10.0) -> bool:
    """Whether a new connection with ``node``'s login is refused (the reload is async)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + within_s
    while loop.time() < end:
        try:
            nc = await connect_nats(url, node, timeout=2.0, security=pki.security(node))
        except CoordinationError:
            return True
        await close_nats(nc)
        await asyncio.sleep(0.2)
    return False


async def test_a_revoked_node_is_refused_by_etcd_and_nats_and_the_others_are_not(
    servers: LocalServers, pki: Pki, no_task_leak: None
) -> None:
    ep, url = servers.etcd_endpoint, servers.nats_url
    ctl_nc = await connect_nats(url, CONTROLLER, security=pki.security(CONTROLLER))
    before_a = set(asyncio.all_tasks())
    a_nc = await connect_nats(url, "node-a", security=pki.security("node-a"))
    a_commands = NatsCommands(a_nc, KEYS)  # as its agent does: a subscription with a task

    async def _ack(data: bytes) -> bytes:
        return b"ack"

    await a_commands.serve("node-a", _ack)
    a_tasks = set(asyncio.all_tasks()) - before_a
    b_nc = await connect_nats(url, "node-b", security=pki.security("node-b"))
    a_kv = await connect_etcd(ep, op_timeout=2.0, security=pki.security("node-a"))
    b_kv = await connect_etcd(ep, op_timeout=2.0, security=pki.security("node-b"))
    ctl_bus = NatsEventBus(ctl_nc, KEYS, durable="ctl")
    a_bus = NatsEventBus(a_nc, KEYS, durable="unused", source="node-a", op_timeout=1.0)
    b_bus = NatsEventBus(b_nc, KEYS, durable="unused", source="node-b", op_timeout=1.0)
    try:
        await ctl_bus.ensure_stream()
        # before: node-a registers (its key bound to its kept-alive lease), writes its
        # status and publishes its event
        a_lease = await a_kv.lease(2)
        await a_kv.put(KEYS.node("node-a"), b"spec-a", lease=a_lease)
        await a_kv.put(KEYS.status("node-a"), b"a-before")
        assert await a_bus.publish("node_joined", b"a-before", msg_id="a1") is True

        done = await revoke_node(pki.dir, "node-a", ep, by="test", reload=_sighup(servers))
        # the node's role in every job on this etcd goes (the servers serve four jobs)
        every_job = tuple(sorted(f"sailor/{j}/node/node-a" for j in IDENTITIES.jobs))
        assert done.etcd.user_deleted and done.etcd.roles_deleted == every_job
        assert done.etcd.keys_deleted == (KEYS.node("node-a"), KEYS.status("node-a"))
        assert done.nats_reloaded and not done.already
        assert not (pki.dir / "node-a.nats.json").exists()
        assert '"node-a"' not in (pki.dir / "nats-server.conf").read_text()

        # after: etcd refuses node-a's certificate on its open connection and a new one
        with pytest.raises(PermanentError, match="permission denied"):
            await a_kv.put(KEYS.status("node-a"), b"a-after")
        with pytest.raises(PermanentError, match="permission denied"):
            await connect_etcd(ep, op_timeout=2.0, security=pki.security("node-a"))
        # NATS refuses a new login as node-a and closed its open connection (the client
        # keeps trying to reconnect, refused each time: "Authorization Violation")
        assert await _refused_by_nats(url, pki, "node-a")
        assert not a_nc.is_connected
        # its close with data unsent (what it publishes meanwhile waits for a reconnect that
        # is refused) raises nothing and leaves none of its tasks running: nats-py's own
        # close raised BrokenPipeError on writing that data and left the subscription's
        # task running for ever
        await a_nc.publish(KEYS.event_subject("node_joined", "node-a"), b"a-unsent" * 512)
        await close_nats(a_nc)
        assert sorted(t.get_name() for t in a_tasks if not t.done()) == []

        # node-b is unaffected: its status and its events still go through
        await b_kv.put(KEYS.status("node-b"), b"b-after")
        assert await b_bus.publish("node_joined", b"b-after", msg_id="b1") is True
        got = await ctl_bus.fetch(10, timeout=1.0)
        assert sorted(d.data for d in got) == [b"a-before", b"b-after"]
        for d in got:
            await d.ack()
        root = await connect_etcd(ep, op_timeout=2.0, security=servers.security("root"))
        try:
            await asyncio.sleep(3.0)  # past the lease's TTL: a keepalive would have held it
            a_node = await root.get(KEYS.node("node-a"))
            a_status = await root.get(KEYS.status("node-a"))
            b_status = await root.get(KEYS.status("node-b"))
        finally:
            await root.close()
        # node-a's registration went with its lease, which its agent kept alive (etcd 3.4
        # checks no permission on a keepalive: it stayed registered, planned on, for ever)
        assert a_status is None and a_node is None and not a_lease.alive
        assert b_status is not None and b_status.value == b"b-after"

        # a second run is a no-op: nothing in etcd, no file changed, no reload
        conf = (pki.dir / "nats-server.conf").read_bytes()
        reloads: list[int] = []
        again = await revoke_node(
            pki.dir, "node-a", ep, by="test", reload=lambda: reloads.append(1)
        )
        assert again.already and not again.etcd.user_deleted and again.etcd.roles_deleted == ()
        assert again.nats_files == () and reloads == []
        assert (pki.dir / "nats-server.conf").read_bytes() == conf
        # the revoked id cannot be issued again (its old certificate would log in as it)
        with pytest.raises(ValueError, match="name='node-a' was revoked"):
            issue_cert(pki.dir, "node-a", CertKind.client, role=Role.agent, days=1, force=True)
    finally:
        await ctl_bus.close()
        for kv in (a_kv, b_kv):
            await kv.close()
        for nc in (a_nc, b_nc, ctl_nc):
            await close_nats(nc)


async def test_an_unknown_node_and_a_controller_are_refused_by_name(
    servers: LocalServers, pki: Pki, no_task_leak: None
) -> None:
    ep = servers.etcd_endpoint
    conf = (pki.dir / "nats-server.conf").read_bytes()
    with pytest.raises(UnknownNodeError, match="node='no-such-node': unknown node"):
        await revoke_node(pki.dir, "no-such-node", ep, by="test")
    with pytest.raises(ValueError, match=r"name='\.\./n1': use letters"):
        await revoke_node(pki.dir, "../n1", ep, by="test")
    with pytest.raises(NotANodeError, match=f"node='{CONTROLLER}' is not a node"):
        await revoke_node(pki.dir, CONTROLLER, ep, by="test")
    with pytest.raises(NotANodeError, match="node='root' is not a node"):
        await revoke_node(pki.dir, "root", ep, by="test")
    assert (pki.dir / "nats-server.conf").read_bytes() == conf  # nothing was touched
    # the controller still works
    ctl = await connect_etcd(ep, op_timeout=2.0, security=pki.security(CONTROLLER))
    try:
        await ctl.put(KEYS.desired, b"d")
    finally:
        await ctl.close()


async def test_sailor_certs_revoke_reloads_nats_and_records_it_in_the_audit_log(
    servers: LocalServers,
    pki: Pki,
    tmp_path,
    no_task_leak: None,  # type: ignore[no-untyped-def]
) -> None:
    """The operator's command: etcd and NATS refuse node-b after it; the controller's audit
    log holds one ``credentials_revoked`` record (shown by ``sailor audit``); a second run
    says so and records nothing; an unknown name fails naming it, exit 1."""
    assert servers.nats.proc is not None
    audit = tmp_path / "audit.jsonl"
    audit.write_text('{"kind": "leader", "time": 1.0, "epoch": 1}\n')  # the controller's
    argv = [
        *("certs", "revoke", str(pki.dir), "--name", "node-b"),
        *("--endpoint", servers.etcd_endpoint, "--nats-pid", str(servers.nats.proc.pid)),
        *("--audit-log", str(audit)),
    ]

    def run(*args: str):  # type: ignore[no-untyped-def]
        return CliRunner().invoke(app, list(args))

    res = await asyncio.to_thread(run, *argv)
    assert res.exit_code == 0, res.output
    assert "node-b: etcd user deleted" in res.output and "nats-server reloaded" in res.output
    assert await _refused_by_nats(servers.nats_url, pki, "node-b")
    with pytest.raises(PermanentError, match="permission denied"):  # refused at connect
        await connect_etcd(servers.etcd_endpoint, op_timeout=2.0, security=pki.security("node-b"))
    records = [r for r in read_records([audit]) if r["kind"] == "credentials_revoked"]
    assert len(records) == 1
    assert records[0]["node"] == "node-b" and records[0]["nats_reloaded"] is True
    assert f"sailor/{JOB}/node/node-b" in records[0]["etcd_roles"]
    assert any("credentials_revoked" in line for line in timeline(read_records([audit])))
    assert json.loads((pki.dir / "node-b.revoked.json").read_text())["name"] == "node-b"

    again = await asyncio.to_thread(run, *argv)
    assert again.exit_code == 0 and "already revoked" in again.output
    assert len(audit.read_text().splitlines()) == 2  # nothing more recorded

    unknown = await asyncio.to_thread(run, *[a if a != "node-b" else "node-zz" for a in argv])
    assert unknown.exit_code == 1 and "node='node-zz': unknown node" in unknown.output
