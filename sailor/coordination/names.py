"""The names the runtime accepts for jobs and nodes, and the clashes of their NATS tokens.

A job name becomes a part of every etcd key (``/sailor/<job>/``), of every NATS subject and
of the event stream's name; a node id names etcd keys, a NATS subject token, a NATS login,
a certificate and files in the agent's work directory. NATS subject tokens cannot hold a
``.``, so ``safe_token`` maps it (and any other character outside ``[A-Za-z0-9_-]``) to
``_``: two node ids that differ only there (``gpu.1``, ``gpu_1``) would share a command
subject, an event subject and a reply inbox, that is every NATS permission. Such a pair is
refused wherever logins are made (``token_clashes``).

Job names take no ``/`` (and no character outside ``[A-Za-z0-9._-]``, and no leading
``.``): a job's etcd prefix then never holds another job's (``/sailor/a/`` would cover
``/sailor/a/b/``, and with it an agent's etcd RBAC). A ``.`` is taken (``llama-3.1``: it was
valid before names were checked, and a job's etcd state, its commit records above all, is
kept under its name): its etcd keys are its own, but its NATS token maps the ``.`` to
``_``, so ``a.b`` and ``a_b`` would share subjects and the event stream's name. The
controller marks its stream with its job's name and refuses to start on a stream another
job marked (``NatsEventBus``: ``StreamConflictError``). Must never import NATS or etcd
clients.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

__all__ = [
    "JOB_PATTERN",
    "NODE_ID_PATTERN",
    "check_job",
    "check_node_id",
    "safe_token",
    "token_clashes",
]

_TOKEN = re.compile(r"[^A-Za-z0-9_-]")


def safe_token(text: str) -> str:
    """A NATS subject token / stream name part: letters, digits, '_' and '-' only."""
    return _TOKEN.sub("_", text) or "_"


JOB_PATTERN = r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}$"
"""A job name: letters, digits, ``.``, ``_`` and ``-``, 1 to 64 of them, not starting with
``.``."""

NODE_ID_PATTERN = r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}$"
"""A node id: letters, digits, ``.``, ``_`` and ``-``, not starting with ``.`` (so never
``.`` or ``..``), at most 128 (``NodeEvent.node_id``'s bound). The same names as a
certificate's (``sailor certs issue --name``): with security on, the node id is its login."""

_JOB = re.compile(JOB_PATTERN)
_NODE = re.compile(NODE_ID_PATTERN)


def check_job(job: str, field: str = "job") -> str:
    """``job`` if it is a valid job name, else ``ValueError`` naming ``field`` and the value."""
    if not _JOB.fullmatch(job):
        raise ValueError(
            f"{field}={job!r}: a job name is 1 to 64 letters, digits, '.', '_' or '-', not "
            "starting with '.' (it is part of etcd keys, NATS subjects and the event "
            "stream's name)"
        )
    return job


def check_node_id(node_id: str, field: str = "node_id") -> str:
    """``node_id`` if it is a valid node id, else ``ValueError`` naming ``field`` and the value."""
    if not _NODE.fullmatch(node_id):
        raise ValueError(
            f"{field}={node_id!r}: a node id is 1 to 128 letters, digits, '.', '_' or '-', "
            "not starting with '.' (it names etcd keys, NATS subjects, a certificate and "
            "files in the agent's work directory)"
        )
    return node_id


def token_clashes(names: Iterable[str]) -> list[tuple[str, ...]]:
    """Groups of distinct names that share one NATS token (``safe_token``), sorted; empty
    when every name has a token of its own. Exact duplicates are not a clash here."""
    by_token: dict[str, set[str]] = {}
    for name in names:
        by_token.setdefault(safe_token(name), set()).add(name)
    return sorted(tuple(sorted(group)) for group in by_token.values() if len(group) > 1)
