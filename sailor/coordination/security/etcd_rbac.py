"""etcd RBAC for one job, and the etcd flags that turn on TLS with client certificates.

Pure: a plan of users, roles and key-range permissions, applied by
``sailor.coordination.etcd_auth``. With ``--client-cert-auth`` etcd takes the user name from
the client certificate's common name, so each identity's certificate *is* its login:

- ``root`` (the operator): etcd's built-in root role; used only to apply this plan;
- a controller (CN = its identity): read-write on ``/sailor/<job>/`` (role
  ``sailor/<job>/controller``);
- an agent (CN = its node id): read-write only on ``nodes/<id>`` and ``status/<id>``, and
  read-only on ``desired`` (a Launch names its plan; the agent reads it there) (role
  ``sailor/<job>/node/<id>``).

Role names join the job and the node id with ``/``, which neither may hold, so two jobs'
roles on one etcd never share a name. They were ``sailor-<job>-node-<id>`` and
``sailor-<job>-controller``, ambiguous since both names may hold ``-``: job ``a``'s node
``b-controller`` and job ``a-node-b``'s controllers had one role, and applying the second
job's plan granted that node all of the second job's keys (grants add up; a role that
exists is reused). A plan also names those old roles (``legacy``): applying it takes them
back from its users, after granting the new ones.

Every role also reads the revision probe key (``EtcdStore.revision``), which lies outside
the job's prefix. etcd 3.4 checks that a request's key range lies inside a granted range, so
an agent's put on another node's key is refused with "permission denied".
Must never import NATS or etcd clients.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import PurePath

from sailor.coordination.keys import Keys

__all__ = [
    "REVISION_PROBE",
    "EtcdPermission",
    "EtcdRbacPlan",
    "EtcdRole",
    "Perm",
    "controller_role",
    "etcd_tls_flags",
    "merge_plans",
    "node_role",
    "prefix_end",
    "rbac_plan",
]

ROOT = "root"
REVISION_PROBE = b"/sailor/\x00revision-probe"
"""The key ``EtcdStore.revision`` reads as a prefix (kept in sync by a unit test)."""


class Perm(StrEnum):
    read = "READ"
    write = "WRITE"
    readwrite = "READWRITE"


def prefix_end(prefix: bytes) -> bytes:
    """etcd's range end of a prefix: the prefix with its last byte incremented."""
    out = bytearray(prefix)
    for i in reversed(range(len(out))):
        if out[i] < 0xFF:
            out[i] += 1
            return bytes(out[: i + 1])
    return b"\x00"  # every key


@dataclass(frozen=True, slots=True)
class EtcdPermission:
    perm: Perm
    key: bytes
    range_end: bytes = b""  # empty: the single key


@dataclass(frozen=True, slots=True)
class EtcdRole:
    name: str
    permissions: tuple[EtcdPermission, ...]


@dataclass(frozen=True, slots=True)
class EtcdRbacPlan:
    """Users (name -> role names) and roles to create, then ``auth enable``; ``legacy``:
    (user, role) grants of the old, ambiguous role names to take back."""

    users: tuple[tuple[str, tuple[str, ...]], ...]
    roles: tuple[EtcdRole, ...]
    legacy: tuple[tuple[str, str], ...] = ()


def controller_role(keys: Keys) -> str:
    """The role of ``keys.job``'s controllers ('/' is in no job name: unambiguous)."""
    return f"sailor/{keys.job}/controller"


def node_role(keys: Keys, node: str) -> str:
    """The role of agent ``node`` in ``keys.job`` ('/' is in no job name or node id)."""
    return f"sailor/{keys.job}/node/{node}"


def _probe() -> EtcdPermission:
    return EtcdPermission(Perm.read, REVISION_PROBE, prefix_end(REVISION_PROBE))


def rbac_plan(keys: Keys, controllers: tuple[str, ...], nodes: tuple[str, ...]) -> EtcdRbacPlan:
    """Roles and users for one job's controllers and agents (root is always included)."""
    overlap = sorted(set(controllers) & set(nodes))
    if overlap or ROOT in controllers or ROOT in nodes:
        raise ValueError(f"identities must be distinct and not 'root', got overlap {overlap}")
    root = keys.root.encode()
    ctl_role = EtcdRole(
        controller_role(keys),
        (EtcdPermission(Perm.readwrite, root, prefix_end(root)), _probe()),
    )
    roles = [ctl_role]
    users: list[tuple[str, tuple[str, ...]]] = [(ROOT, (ROOT,))]
    users += [(c, (ctl_role.name,)) for c in controllers]
    legacy = [(c, f"sailor-{keys.job}-controller") for c in controllers]
    for node in nodes:
        legacy.append((node, f"sailor-{keys.job}-node-{node}"))
        role = EtcdRole(
            node_role(keys, node),
            (
                EtcdPermission(Perm.readwrite, keys.node(node).encode()),
                EtcdPermission(Perm.readwrite, keys.status(node).encode()),
                # Launch names its plan; the agent reads it from the desired state (read only).
                EtcdPermission(Perm.read, keys.desired.encode()),
                _probe(),
            ),
        )
        roles.append(role)
        users.append((node, (role.name,)))
    return EtcdRbacPlan(users=tuple(users), roles=tuple(roles), legacy=tuple(legacy))


def merge_plans(plans: Sequence[EtcdRbacPlan]) -> EtcdRbacPlan:
    """One plan for several jobs on one etcd: every role, each user with all its roles."""
    roles: dict[str, EtcdRole] = {}
    users: dict[str, list[str]] = {}
    legacy: dict[tuple[str, str], None] = {}
    for plan in plans:
        legacy.update(dict.fromkeys(plan.legacy))
        for role in plan.roles:
            roles.setdefault(role.name, role)
        for user, names in plan.users:
            have = users.setdefault(user, [])
            have += [n for n in names if n not in have]
    return EtcdRbacPlan(
        users=tuple((u, tuple(r)) for u, r in users.items()),
        roles=tuple(roles.values()),
        legacy=tuple(legacy),
    )


def etcd_tls_flags(ca_file: PurePath, cert_file: PurePath, key_file: PurePath) -> list[str]:
    """Flags for an etcd member: TLS on client and peer URLs, client certificates required.

    The client and peer URLs must use ``https://`` as well (not generated here: they depend
    on the member's addresses).
    """
    return [
        "--client-cert-auth",
        f"--trusted-ca-file={ca_file}",
        f"--cert-file={cert_file}",
        f"--key-file={key_file}",
        "--peer-client-cert-auth",
        f"--peer-trusted-ca-file={ca_file}",
        f"--peer-cert-file={cert_file}",
        f"--peer-key-file={key_file}",
    ]
