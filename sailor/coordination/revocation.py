"""Revoking a node's credentials: its etcd user and roles, its NATS login (``sailor certs revoke``).

An operator's act, never automatic: a spot VM that was preempted may come back under the
same node id (``SAILOR_NODE_ID``, or a stopped spot VM restarted with its instance id) and
must then log in again; a node revoked cannot. Revocation, as root on the head VM:

1. etcd: the node's user and its node roles in every job are deleted
   (``etcd_auth.revoke_node_user``); etcd takes the user from the certificate's common
   name, so every request made with the node's certificate is refused from then on;
2. NATS: its login leaves every generated nats-server config in the PKI directory and its
   ``<node>.nats.json`` is deleted (``pki.remove_nats_login``); the caller's ``reload``
   then makes nats-server read the config again (``systemctl reload sailor-nats``: SIGHUP),
   which refuses the login and disconnects the node's clients;
3. ``<node>.revoked.json`` records it (``pki.record_revocation``); ``certs issue`` refuses the
   name from then on (the old certificate stays valid for TLS until it expires).

Idempotent: a second run finds nothing left and changes nothing (``already``). A name with
no etcd user, role, login or record is an ``UnknownNodeError`` naming it.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from sailor.coordination.etcd_auth import EtcdRevocation, NotANodeError, revoke_node_user
from sailor.coordination.etcd_store import connect_etcd
from sailor.coordination.security.pki import (
    REVOKED_SUFFIX,
    check_name,
    nats_login_role,
    record_revocation,
    remove_nats_login,
    revoked_record,
)
from sailor.coordination.security.settings import SecurityConfig

__all__ = ["NotANodeError", "Revocation", "UnknownNodeError", "revoke_node"]


class UnknownNodeError(ValueError):
    """No credentials of this name, now or revoked before: a typo, or never issued here."""


@dataclass(frozen=True, slots=True)
class Revocation:
    """What one ``revoke_node`` did. ``already``: nothing was left (revoked before)."""

    node: str
    etcd: EtcdRevocation
    nats_files: tuple[Path, ...]
    nats_reloaded: bool
    record: Path
    already: bool


async def revoke_node(
    directory: Path,
    node: str,
    etcd_endpoints: str | Sequence[str],
    by: str,
    admin: str = "root",
    reload: Callable[[], None] | None = None,
    op_timeout: float = 5.0,
) -> Revocation:
    """Revoke ``node``'s etcd user and roles and its NATS login (module docstring).

    ``reload`` is called when a nats-server config in ``directory`` changed; it raises if
    the server could not be told (the files are changed and recorded by then: reload by
    hand). ``admin``: the certificate in ``directory`` to connect to etcd with (root)."""
    check_name(node)
    role = nats_login_role(directory, node)
    if role is not None and role != "agent":
        raise NotANodeError(f"node={node!r} is not a node: its NATS login has role {role!r}")
    admin_sec = SecurityConfig(
        ca_file=directory / "ca.crt",
        cert_file=directory / f"{admin}.crt",
        key_file=directory / f"{admin}.key",
    )
    store = await connect_etcd(etcd_endpoints, op_timeout=op_timeout, security=admin_sec)
    try:
        etcd = await revoke_node_user(store, node)
    finally:
        await store.close()
    files = tuple(remove_nats_login(directory, node))
    record = directory / f"{node}{REVOKED_SUFFIX}"
    already = not etcd.user_deleted and not etcd.roles_deleted and not files
    if already:
        if revoked_record(directory, node) is None:
            raise UnknownNodeError(
                f"node={node!r}: unknown node: etcd has no user or node role of that name "
                f"and {directory} no NATS login or revocation record"
            )
        return Revocation(node, etcd, files, False, record, already=True)
    record = record_revocation(directory, node, by, dt.datetime.now(dt.UTC))
    configs = [f for f in files if not f.name.endswith(".nats.json")]
    if configs and reload is not None:
        reload()
    return Revocation(node, etcd, files, bool(configs) and reload is not None, record, False)
