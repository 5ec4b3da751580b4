"""etcd 3.4 with TLS, client-certificate authentication and the job's RBAC (real etcd).

The certificate's common name is the etcd user: an agent writes its own node and status keys
and is refused another node's; a client without a certificate is refused outright.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from aetcd import rpc

from sailor.coordination import (
    CoordinationError,
    Keys,
    ManualClock,
    PermanentError,
    connect_etcd,
)
from sailor.coordination.security import SecurityConfig
from tests.integration.conftest import Server, connected_to
from tests.integration.secure_servers import CONTROLLER, JOB, Pki

KEYS = Keys(job=JOB)


def _ep(server: Server) -> str:
    return f"127.0.0.1:{server.port}"


def _open_fds() -> int:
    return sum(1 for _ in Path("/proc/self/fd").iterdir())


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


async def test_closed_clients_let_go_of_etcd_without_the_garbage_collector(
    secure_etcd_server: Server, pki: Pki, no_task_leak: None
) -> None:
    """A closed client holds no connection and no file descriptor, with the garbage
    collector off, after refused calls (a revoked node's) and a refreshed lease.

    Each left its gRPC call, and with it the channel and the connection to etcd, in a
    reference cycle that only a collection ended: a refused call's error (the frame of
    ``asyncio.wait_for`` held the task that held the error; an error passed on unconverted
    was its own cause), and a lease's keepalive (aetcd's ``refresh_lease`` leaves its
    stream unfinished). Measured: 20 TLS clients closed after a refused call each left 20
    connections and 26 descriptors, and etcd's stop on SIGTERM waited ~1.1 s on them."""
    ep, ports = _ep(secure_etcd_server), {secure_etcd_server.port}
    warm = await connect_etcd(ep, security=pki.security("node-a"))
    await warm.close()
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        fds = _open_fds()
        for _ in range(3):
            clock = ManualClock()
            agent = await connect_etcd(ep, security=pki.security("node-a"), clock=clock)
            try:
                lease = await agent.lease(5)
                clock.advance(60.0)  # past its TTL: fresh again once a refresh is answered
                await _until(lambda: lease.fresh)  # noqa: B023  # this iteration's lease
                with pytest.raises(PermanentError, match="permission denied"):
                    await agent.put(KEYS.node("node-b"), b"forged")  # converted by the store
                with pytest.raises(grpc.aio.AioRpcError) as raw:  # raised as it is
                    await agent.call(
                        rpc.AuthStub(agent.client.channel).UserGet(
                            rpc.AuthUserGetRequest(name="node-b"), metadata=agent.client.metadata
                        )
                    )
                assert raw.value.__cause__ is not raw.value
                del raw
            finally:
                await agent.close()
        await _until(lambda: not connected_to(ports), within_s=2.0)  # a loop turn or two
        assert not connected_to(ports)
        assert _open_fds() <= fds
    finally:
        if was_enabled:
            gc.enable()


async def _until(cond: Callable[[], bool], within_s: float = 5.0) -> None:
    end = time.monotonic() + within_s
    while not cond() and time.monotonic() < end:
        await asyncio.sleep(0.01)


async def test_one_jobs_node_gets_nothing_of_another_jobs_role(
    secure_etcd_server: Server, pki: Pki, no_task_leak: None
) -> None:
    """Role names of two jobs on one etcd never coincide, whatever '-' the names hold.

    They were ``sailor-<job>-node-<id>`` and ``sailor-<job>-controller``: job ``a``'s node
    ``b-controller`` and job ``a-node-b``'s controllers then had one role, and applying the
    second job's RBAC granted that node read-write on all of job ``a-node-b`` (its desired
    state, its commits). A re-run also takes back such a name from its users (an upgrade).
    """
    from sailor.coordination.etcd_auth import apply_rbac
    from sailor.coordination.security.certs import CertKind
    from sailor.coordination.security.etcd_rbac import rbac_plan
    from sailor.coordination.security.pki import Role, issue_cert

    issue_cert(pki.dir, "b-controller", CertKind.client, role=Role.agent, days=1)
    job_a, job_anb = Keys(job="a"), Keys(job="a-node-b")
    root = await connect_etcd(_ep(secure_etcd_server), security=pki.security("root", nats=False))
    agent = None
    try:
        await apply_rbac(root, rbac_plan(job_a, (CONTROLLER,), ("b-controller",)))
        await apply_rbac(root, rbac_plan(job_anb, (CONTROLLER,), ()))
        await root.put(job_anb.desired, b"the other job's desired state")
        agent = await connect_etcd(_ep(secure_etcd_server), security=pki.security("b-controller"))
        await agent.put(job_a.status("b-controller"), b"its own status")
        with pytest.raises(PermanentError, match="permission denied"):
            await agent.put(job_anb.desired, b"forged")
        with pytest.raises(PermanentError, match="permission denied"):
            await agent.get(job_anb.desired)
        got = await root.get(job_anb.desired)
        assert got is not None and got.value == b"the other job's desired state"
    finally:
        if agent is not None:
            await agent.close()
        await root.close()


async def test_a_rerun_takes_back_the_old_ambiguous_role_names(
    secure_etcd_server: Server, pki: Pki, no_task_leak: None
) -> None:
    """An etcd set up with the old role names (the node ``b-controller`` of job ``a`` holding
    job ``a-node-b``'s controller grant) is cleaned by re-running each job's RBAC."""
    from sailor.coordination.etcd_auth import apply_rbac
    from sailor.coordination.security.certs import CertKind
    from sailor.coordination.security.etcd_rbac import (
        REVISION_PROBE,
        EtcdPermission,
        EtcdRbacPlan,
        EtcdRole,
        Perm,
        prefix_end,
        rbac_plan,
    )
    from sailor.coordination.security.pki import Role, issue_cert

    issue_cert(pki.dir, "b-controller", CertKind.client, role=Role.agent, days=1)
    job_a, job_anb = Keys(job="a"), Keys(job="a-node-b")
    anb = job_anb.root.encode()
    old_name = "sailor-a-node-b-controller"  # both roles' name before
    old = EtcdRbacPlan(
        users=(("b-controller", (old_name,)), (CONTROLLER, (old_name,))),
        roles=(
            EtcdRole(
                old_name,
                (
                    EtcdPermission(Perm.readwrite, anb, prefix_end(anb)),
                    EtcdPermission(Perm.readwrite, job_a.status("b-controller").encode()),
                    EtcdPermission(Perm.read, REVISION_PROBE, prefix_end(REVISION_PROBE)),
                ),
            ),
        ),
    )
    root = await connect_etcd(_ep(secure_etcd_server), security=pki.security("root", nats=False))
    agent = None
    try:
        await apply_rbac(root, old)
        agent = await connect_etcd(_ep(secure_etcd_server), security=pki.security("b-controller"))
        await agent.put(job_anb.desired, b"forged")  # what the old names allowed
        await apply_rbac(root, rbac_plan(job_a, (CONTROLLER,), ("b-controller",)))
        await apply_rbac(root, rbac_plan(job_anb, (CONTROLLER,), ()))
        with pytest.raises(PermanentError, match="permission denied"):
            await agent.put(job_anb.desired, b"forged again")
        await agent.put(job_a.status("b-controller"), b"its own status")  # the new role
        ctl = await connect_etcd(_ep(secure_etcd_server), security=pki.security(CONTROLLER))
        try:
            await ctl.put(job_anb.desired, b"the controller's")  # its new role
        finally:
            await ctl.close()
    finally:
        if agent is not None:
            await agent.close()
        await root.close()
