"""nats-server (JetStream) and etcd for the demo, secured as a deployment secures them.

Started by :mod:`sailor.localservers` (the launcher the tests, the chaos suite and the
benchmarks use) under the demo's process registry, on free loopback ports with fresh data in
the demo's temporary directory: a fresh CA, TLS with client certificates on both servers, a
NATS login per daemon with the per-node permissions, and etcd RBAC (agents write only their
own keys). The demo's observer reads etcd as the operator (``root``). Must never reuse an
existing server or data directory.
"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path

from sailor.cli.demo.processes import ProcessRegistry
from sailor.localnet import free_port
from sailor.localservers import (
    Identities,
    LocalServers,
    ServerMissingError,
    start_local_servers,
)

__all__ = ["ServerError", "free_port", "start_servers"]

ServerError = ServerMissingError


def start_servers(
    reg: ProcessRegistry, data: Path, job: str, controller: str, nodes: Sequence[str]
) -> LocalServers:
    """Start both servers under ``reg`` (names ``nats``, ``etcd``) with security on."""

    def spawn(name: str, argv: Sequence[str], _log: Path) -> subprocess.Popen[bytes]:
        return reg.start(name, argv)  # its log goes to the registry's log directory

    ids = Identities(jobs=(job,), controllers=(controller,), agents=tuple(nodes))
    return start_local_servers(data, ids, secure=True, spawn=spawn)
