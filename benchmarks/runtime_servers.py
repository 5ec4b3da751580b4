"""Real nats-server (JetStream) and etcd 3.4 on free loopback ports, for the runtime benchmarks.

Started by :mod:`sailor.localservers`, the one launcher the demo, the integration tests and
the chaos suite use: fresh data in a temporary directory, stopped at the end. No mocks.

Plain (no TLS, no auth) unless ``secure=True``: the decision-latency and burst benchmarks
play 64 to 2,048 simulated nodes over one connection, which per-node logins and permissions
forbid by design, and they measure the control plane against the baselines recorded in
docs/runtime.md, which were taken on plain servers.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sailor.localnet import free_port
from sailor.localservers import Identities, ServerMissingError, local_servers

__all__ = ["free_port", "servers"]


@contextmanager
def servers(
    tmp: Path, secure: bool = False, identities: Identities | None = None
) -> Iterator[tuple[str, str]]:
    """Yield ``(nats_url, etcd_endpoint)`` of freshly started servers."""
    try:
        with local_servers(tmp, identities, secure=secure) as s:
            yield s.nats_url, s.etcd_endpoint
    except ServerMissingError as exc:
        raise SystemExit(str(exc)) from None
