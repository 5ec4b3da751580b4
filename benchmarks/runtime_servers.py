"""Real nats-server (JetStream) and etcd 3.4 on free loopback ports, for the runtime benchmarks.

The same way the integration tests start them (tests/integration/conftest.py): fresh data in
a temporary directory, stopped at the end. No mocks.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sailor.localnet import free_port, wait_port

__all__ = ["free_port", "servers"]


def _start(argv: list[str], port: int, log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as fh:
        proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT)
    wait_port(port, 15.0)
    return proc


@contextmanager
def servers(tmp: Path) -> Iterator[tuple[str, str]]:
    """Yield ``(nats_url, etcd_endpoint)`` of freshly started servers."""
    nats_bin = Path(sys.executable).parent / "nats-server"
    nats = str(nats_bin) if nats_bin.exists() else shutil.which("nats-server")
    etcd = shutil.which("etcd")
    if not nats or not etcd:
        raise SystemExit("nats-server and etcd are needed (deploy/install-servers.sh)")
    np_, ep, pp = free_port(), free_port(), free_port()
    (tmp / "nats").mkdir(parents=True, exist_ok=True)
    procs = [
        _start(
            [nats, "-js", "-a", "127.0.0.1", "-p", str(np_), "-sd", str(tmp / "nats")],
            np_,
            tmp / "nats.log",
        ),
        _start(
            [
                *(etcd, "--name", "b", "--data-dir", str(tmp / "etcd")),
                *("--listen-client-urls", f"http://127.0.0.1:{ep}"),
                *("--advertise-client-urls", f"http://127.0.0.1:{ep}"),
                *("--listen-peer-urls", f"http://127.0.0.1:{pp}"),
                *("--initial-advertise-peer-urls", f"http://127.0.0.1:{pp}"),
                *("--initial-cluster", f"b=http://127.0.0.1:{pp}"),
                *("--heartbeat-interval", "10", "--election-timeout", "50"),
                *("--log-level", "warn"),
            ],
            ep,
            tmp / "etcd.log",
        ),
    ]
    try:
        yield f"nats://127.0.0.1:{np_}", f"127.0.0.1:{ep}"
    finally:
        for p in procs:
            p.terminate()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
