"""nats-server (JetStream) and etcd for the demo, from the project's own install.

``deploy/install-servers.sh`` puts ``nats-server`` into the virtualenv's ``bin`` and etcd
comes from the Debian package; both are started on free loopback ports with fresh data in
the demo's temporary directory, exactly as the integration tests and benchmarks start them.
Must never reuse an existing server or data directory.
"""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from sailor.cli.demo.processes import ProcessRegistry
from sailor.localnet import free_port, wait_port

__all__ = ["ServerError", "Servers", "free_port", "start_servers"]


class ServerError(RuntimeError):
    """A server binary is missing (not retried); a port not opened raises PortTimeoutError."""


def _binaries() -> tuple[str, str]:
    venv_nats = Path(sys.executable).parent / "nats-server"
    nats = str(venv_nats) if venv_nats.exists() else shutil.which("nats-server")
    etcd = shutil.which("etcd") or ("/usr/bin/etcd" if Path("/usr/bin/etcd").exists() else None)
    if not nats or not etcd:
        raise ServerError(
            f"nats-server ({nats or 'missing'}) and etcd ({etcd or 'missing'}) are needed: "
            "run deploy/install-servers.sh (or `make demo`)"
        )
    return nats, etcd


@dataclass(frozen=True)
class Servers:
    nats_url: str
    etcd_endpoint: str


def start_servers(reg: ProcessRegistry, data: Path) -> Servers:
    """Start both servers under ``reg`` (names ``nats``, ``etcd``) and wait for their ports."""
    nats, etcd = _binaries()
    np_, ep, pp = free_port(), free_port(), free_port()
    (data / "nats").mkdir(parents=True, exist_ok=True)
    reg.start("nats", [nats, "-js", "-a", "127.0.0.1", "-p", str(np_), "-sd", str(data / "nats")])
    reg.start(
        "etcd",
        [
            *(etcd, "--name", "demo", "--data-dir", str(data / "etcd")),
            *("--listen-client-urls", f"http://127.0.0.1:{ep}"),
            *("--advertise-client-urls", f"http://127.0.0.1:{ep}"),
            *("--listen-peer-urls", f"http://127.0.0.1:{pp}"),
            *("--initial-advertise-peer-urls", f"http://127.0.0.1:{pp}"),
            *("--initial-cluster", f"demo=http://127.0.0.1:{pp}"),
            # one member on loopback: short heartbeats make the first election instant
            *("--heartbeat-interval", "10", "--election-timeout", "50"),
            *("--log-level", "warn"),
        ],
    )
    wait_port(np_, 15.0, "nats-server")
    wait_port(ep, 15.0, "etcd")
    return Servers(nats_url=f"nats://127.0.0.1:{np_}", etcd_endpoint=f"127.0.0.1:{ep}")
