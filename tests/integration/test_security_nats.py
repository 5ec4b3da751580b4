"""NATS with TLS, logins and per-user permissions (a real nats-server; see secure_servers.py).

An agent publishes only its own node's events, serves only its own command subject, and never
publishes a command; a client without TLS or with a wrong password is refused.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from sailor.coordination import (
    CoordinationError,
    Keys,
    NatsCommands,
    NatsEventBus,
    UnavailableError,
    connect_nats,
)
from sailor.coordination.security import SecurityConfig
from tests.integration.conftest import Server
from tests.integration.secure_servers import CONTROLLER, JOB, Pki

KEYS = Keys(job=JOB)


def _url(server: Server) -> str:
    return f"nats://127.0.0.1:{server.port}"


async def test_agent_publishes_only_its_own_events(
    secure_nats_server: Server, pki: Pki, no_task_leak: None
) -> None:
    url = _url(secure_nats_server)
    ctl = await connect_nats(url, CONTROLLER, security=pki.security(CONTROLLER))
    agent = await connect_nats(url, "node-a", security=pki.security("node-a"))
    try:
        ctl_bus = NatsEventBus(ctl, KEYS, durable="ctl")
        await ctl_bus.ensure_stream()
        own = NatsEventBus(agent, KEYS, durable="unused", source="node-a", op_timeout=0.5)
        forged = NatsEventBus(agent, KEYS, durable="unused", source="node-b", op_timeout=0.5)
        assert await own.publish("node_joined", b"mine", msg_id="e1") is True
        with pytest.raises(UnavailableError):
            await forged.publish("node_joined", b"forged", msg_id="e2")
        got = await ctl_bus.fetch(10, timeout=0.5)
        assert [(d.data, d.subject) for d in got] == [
            (b"mine", f"sailor.{JOB}.events.node-a.node_joined")
        ]
        for d in got:
            await d.ack()
        await ctl_bus.close()
    finally:
        await agent.close()
        await ctl.close()


async def test_only_the_controller_commands_and_agents_serve_only_their_own_subject(
    secure_nats_server: Server, pki: Pki, no_task_leak: None
) -> None:
    url = _url(secure_nats_server)
    ctl = await connect_nats(url, CONTROLLER, security=pki.security(CONTROLLER))
    a = await connect_nats(url, "node-a", security=pki.security("node-a"))
    b = await connect_nats(url, "node-b", security=pki.security("node-b"))
    seen: dict[str, list[bytes]] = {"a-own": [], "a-steals-b": [], "b": []}

    def handler(tag: str):  # type: ignore[no-untyped-def]
        async def _h(data: bytes) -> bytes:
            seen[tag].append(data)
            return b"ack-" + tag.encode()

        return _h

    ctl_cmds, a_cmds, b_cmds = NatsCommands(ctl, KEYS), NatsCommands(a, KEYS), NatsCommands(b, KEYS)
    try:
        await a_cmds.serve("node-a", handler("a-own"))
        await a_cmds.serve("node-b", handler("a-steals-b"))  # refused by the server
        await b_cmds.serve("node-b", handler("b"))
        await asyncio.sleep(0.2)
        # the controller reaches each agent on its own subject, over TLS with its login
        assert await ctl_cmds.request("node-a", b"c1", timeout=2.0) == b"ack-a-own"
        for i in range(5):  # were node-a subscribed too, it would answer some of these
            assert await ctl_cmds.request("node-b", f"c{i}".encode(), timeout=2.0) == b"ack-b"
        assert seen["a-steals-b"] == []
        # an agent may not publish a command, to another node or to itself
        with pytest.raises(UnavailableError):
            await a_cmds.request("node-b", b"forged", timeout=0.5)
        assert len(seen["b"]) == 5
    finally:
        for c in (ctl_cmds, a_cmds, b_cmds):
            await c.close()
        for nc in (a, b, ctl):
            await nc.close()


async def test_clients_without_tls_or_with_a_wrong_password_are_refused(
    secure_nats_server: Server,
    pki: Pki,
    tmp_path,
    no_task_leak: None,  # type: ignore[no-untyped-def]
) -> None:
    url = _url(secure_nats_server)
    with pytest.raises(CoordinationError):
        await connect_nats(url, "plain", timeout=2.0)  # no TLS, no login
    wrong = tmp_path / "wrong.nats.json"
    secret = "not-the-password-0123456789"
    wrong.write_text(json.dumps({"user": "node-a", "password": secret, "role": "agent"}))
    sec = pki.security("node-a")
    bad = SecurityConfig(
        ca_file=sec.ca_file, cert_file=sec.cert_file, key_file=sec.key_file, nats_login_file=wrong
    )
    with pytest.raises(CoordinationError) as info:
        await connect_nats(url, "node-a", timeout=2.0, security=bad)
    assert secret not in str(info.value) and secret not in repr(info.value)


async def test_a_refused_client_gives_up_within_its_timeout(
    secure_nats_server: Server, no_task_leak: None
) -> None:
    """Short deadlines land inside the TLS handshake, where nats-py's ``close()`` of the half
    open client used to wait for ever (connect_nats hung until pytest's limit)."""
    url = _url(secure_nats_server)
    loop = asyncio.get_running_loop()
    for i in range(12):
        timeout = 0.02 + 0.01 * i
        t0 = loop.time()
        with pytest.raises(CoordinationError):
            # the outer bound only turns a hang into a failure here
            await asyncio.wait_for(connect_nats(url, "plain", timeout=timeout), 30)
        # the connect's deadline, then at most its close's (as long) and their graces
        assert loop.time() - t0 < 2 * timeout + 4.0 + 2.0
