"""etcd 3.4 with TLS, client-certificate authentication and the job's RBAC (real etcd).

The certificate's common name is the etcd user: an agent writes its own node and status keys
and is refused another node's; a client without a certificate is refused outright.
"""

from __future__ import annotations

import pytest

from sailor.coordination import CoordinationError, Keys, PermanentError, connect_etcd
from sailor.coordination.security import SecurityConfig
from tests.integration.conftest import Server
from tests.integration.secure_servers import CONTROLLER, JOB, Pki

KEYS = Keys(job=JOB)


def _ep(server: Server) -> str:
    return f"127.0.0.1:{server.port}"


async def test_a_client_without_a_certificate_is_refused(
    secure_etcd_server: Server, pki: Pki, no_task_leak: None
) -> None:
    with pytest.raises(CoordinationError):
        await connect_etcd(
            _ep(secure_etcd_server),
            op_timeout=1.0,
            security=SecurityConfig(ca_file=pki.dir / "ca.crt"),
        )
    with pytest.raises(CoordinationError):  # plain TCP against a TLS port
        await connect_etcd(_ep(secure_etcd_server), op_timeout=1.0)


async def test_an_agent_writes_only_its_own_keys(
    secure_etcd_server: Server, pki: Pki, no_task_leak: None
) -> None:
    agent = await connect_etcd(_ep(secure_etcd_server), security=pki.security("node-a"))
    ctl = await connect_etcd(_ep(secure_etcd_server), security=pki.security(CONTROLLER))
    try:
        lease = await agent.lease(5)
        await agent.put(KEYS.node("node-a"), b"spec-a", lease=lease)
        await agent.put(KEYS.status("node-a"), b"status-a", lease=lease)
        with pytest.raises(PermanentError, match="permission denied"):
            await agent.put(KEYS.node("node-b"), b"forged")
        with pytest.raises(PermanentError, match="permission denied"):
            await agent.put(KEYS.desired, b"forged")
        with pytest.raises(PermanentError, match="permission denied"):
            await agent.get_prefix(KEYS.nodes)  # no reading other nodes either
        # the controller reads and writes the whole job
        assert [kv.key for kv in await ctl.get_prefix(KEYS.nodes)] == [KEYS.node("node-a")]
        await ctl.put(KEYS.desired, b"d")
        # an agent reads (only reads) the desired state: Launch names its plan there
        got = await agent.get(KEYS.desired)
        assert got is not None and got.value == b"d"
        await lease.revoke()
        assert await ctl.get(KEYS.node("node-a")) is None
    finally:
        await agent.close()
        await ctl.close()
