"""Applying an ``EtcdRbacPlan`` to a live etcd (users, roles, permissions, ``auth enable``).

Idempotent: an existing user, role or grant is not an error, so the operator re-runs it after
adding nodes (it must then connect as ``root``, since auth is on). Users are created without a
password: with ``--client-cert-auth`` the client certificate is the only login. After the
grants, the plan's ``legacy`` grants (the old role names, ambiguous between jobs) are taken
back from its users; one not granted is not an error. ``revoke_node_user`` deletes a node's
user and its node roles (``sailor certs revoke``). Must never import NATS.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import structlog
from aetcd import rpc
from aetcd.rpc import auth_pb2

from sailor.coordination.etcd_store import EtcdStore
from sailor.coordination.keys import Keys
from sailor.coordination.security.etcd_rbac import EtcdRbacPlan, Perm

__all__ = ["EtcdRevocation", "NotANodeError", "apply_rbac", "revoke_node_user"]

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


class NotANodeError(ValueError):
    """The identity to revoke is root or a controller, not an agent's node."""


@dataclass(frozen=True, slots=True)
class EtcdRevocation:
    """What ``revoke_node_user`` deleted: the user (False: there was none), its node roles
    (``sailor/<job>/node/<id>``, every job's) and its registration and status keys (with
    the leases they were bound to)."""

    user_deleted: bool
    roles_deleted: tuple[str, ...]
    keys_deleted: tuple[str, ...] = ()


def _is_node_role(role: str, node: str) -> bool:
    """``sailor/<job>/node/<node>`` for some job (no job name holds a '/')."""
    parts = role.split("/")
    return len(parts) == 4 and parts[0] == "sailor" and parts[2] == "node" and parts[3] == node


async def revoke_node_user(store: EtcdStore, node: str) -> EtcdRevocation:
    """Delete etcd user ``node`` and its node roles in every job, as root.

    With ``--client-cert-auth`` the certificate's common name is the user: once the user is
    gone, etcd refuses every request made with the node's certificate. Idempotent: a user
    and roles already gone are not an error. Refuses (``NotANodeError``, naming it) a user
    holding root or a controller role: that is not a node."""
    client = store.client
    await client.connect()
    stub = rpc.AuthStub(client.channel)
    md = client.metadata
    try:
        got = await store.call(stub.UserGet(rpc.AuthUserGetRequest(name=node), metadata=md))
        held = tuple(got.roles)
    except Exception as exc:
        if "user name not found" not in str(exc):
            raise
        held = None
    if held is not None:
        others = [r for r in held if r == "root" or r.endswith("/controller")]
        if others:
            raise NotANodeError(f"node={node!r} is not a node: its etcd user holds {others}")
    listed = await store.call(stub.RoleList(rpc.AuthRoleListRequest(), metadata=md))
    roles = tuple(r for r in listed.roles if _is_node_role(r, node))
    if held is not None:
        await store.call(stub.UserDelete(rpc.AuthUserDeleteRequest(name=node), metadata=md))
    # etcd 3.4 checks no permission on a lease's keepalive: a revoked agent still running
    # kept its registration alive (and so its place in the layouts). Its keys go, with the
    # leases they are bound to (which hold no other node's keys: a node's lease is its own).
    keys_deleted = []
    for role in roles:
        keys = Keys(job=role.split("/")[1])
        for key in (keys.node(node), keys.status(node)):
            kv = await store.get(key)
            if kv is None:
                continue
            if kv.lease:
                try:
                    await store.call(client.revoke_lease(kv.lease))
                except Exception as exc:
                    if "lease not found" not in str(exc):
                        raise
            await store.delete(key)
            keys_deleted.append(key)
    deleted = []
    for role in roles:
        try:
            await store.call(stub.RoleDelete(rpc.AuthRoleDeleteRequest(role=role), metadata=md))
        except Exception as exc:
            if "role name not found" not in str(exc):
                raise
            continue
        deleted.append(role)
    _log.info(
        "etcd_node_revoked",
        node=node,
        user_deleted=held is not None,
        roles=deleted,
        keys=keys_deleted,
    )
    return EtcdRevocation(held is not None, tuple(deleted), tuple(keys_deleted))
