"""Applying an ``EtcdRbacPlan`` to a live etcd (users, roles, permissions, ``auth enable``).

Idempotent: an existing user, role or grant is not an error, so the operator re-runs it after
adding nodes (it must then connect as ``root``, since auth is on). Users are created without a
password: with ``--client-cert-auth`` the client certificate is the only login. After the
grants, the plan's ``legacy`` grants (the old role names, ambiguous between jobs) are taken
back from its users; one not granted is not an error. Must never import NATS.
"""

from __future__ import annotations

from typing import Any

import structlog
from aetcd import rpc
from aetcd.rpc import auth_pb2

from sailor.coordination.etcd_store import EtcdStore
from sailor.coordination.security.etcd_rbac import EtcdRbacPlan, Perm

__all__ = ["apply_rbac"]

_log = structlog.get_logger("sailor.etcd")

_PERM = {
    Perm.read: auth_pb2.Permission.READ,
    Perm.write: auth_pb2.Permission.WRITE,
    Perm.readwrite: auth_pb2.Permission.READWRITE,
}


async def _tolerate_exists(store: EtcdStore, call: Any) -> None:
    try:
        await store.call(call)
    except Exception as exc:
        if "already exists" not in str(exc):
            raise


async def _revoked(store: EtcdStore, call: Any) -> bool:
    """True if the revocation took a grant back; False if there was none to take."""
    try:
        await store.call(call)
    except Exception as exc:
        if "not granted" not in str(exc) and "not found" not in str(exc):
            raise
        return False
    return True


async def apply_rbac(store: EtcdStore, plan: EtcdRbacPlan, enable: bool = True) -> None:
    """Create the plan's roles and users, grant, take back its legacy grants, then enable
    auth (unless ``enable=False``)."""
    client = store.client
    await client.connect()
    stub = rpc.AuthStub(client.channel)
    md = client.metadata
    for role in plan.roles:
        await _tolerate_exists(
            store, stub.RoleAdd(rpc.AuthRoleAddRequest(name=role.name), metadata=md)
        )
        for p in role.permissions:
            perm = auth_pb2.Permission(permType=_PERM[p.perm], key=p.key, range_end=p.range_end)
            await store.call(
                stub.RoleGrantPermission(
                    rpc.AuthRoleGrantPermissionRequest(name=role.name, perm=perm), metadata=md
                )
            )
    for user, roles in plan.users:
        opts = auth_pb2.UserAddOptions(no_password=True)
        await _tolerate_exists(
            store, stub.UserAdd(rpc.AuthUserAddRequest(name=user, options=opts), metadata=md)
        )
        for role_name in roles:
            if role_name == "root":
                await _tolerate_exists(
                    store, stub.RoleAdd(rpc.AuthRoleAddRequest(name="root"), metadata=md)
                )
            await store.call(
                stub.UserGrantRole(
                    rpc.AuthUserGrantRoleRequest(user=user, role=role_name), metadata=md
                )
            )
    revoked = 0
    for user, role_name in plan.legacy:
        revoked += await _revoked(
            store,
            stub.UserRevokeRole(
                rpc.AuthUserRevokeRoleRequest(name=user, role=role_name), metadata=md
            ),
        )
    if enable:
        await store.call(stub.AuthEnable(rpc.AuthEnableRequest(), metadata=md))
    _log.info(
        "etcd_rbac_applied",
        roles=len(plan.roles),
        users=len(plan.users),
        legacy_revoked=revoked,
        enabled=enable,
    )
