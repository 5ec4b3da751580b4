"""Local servers start again on new ports when etcd's port was taken before it bound it, and
the process that took it answered the wait for the port.

Seen in a fresh-clone CI: between ``free_port()`` and etcd's bind, another process took
etcd's client port; the wait for the port was answered by that process, etcd exited on its
bind error, and the first TLS connection (the RBAC set-up) met the other process's bytes
(``WRONG_VERSION_NUMBER``): 30 s of retries, then an error. The restart on new ports was
only for a member that exited before anything answered on its port.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import sailor.localservers as ls
from sailor.localnet import free_port


@pytest.fixture
def squatter() -> Iterator[int]:
    """A port held by a process that answers every connection with bytes that are not TLS."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    srv.settimeout(0.2)
    done = threading.Event()

    def serve() -> None:
        while not done.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            with conn, contextlib.suppress(OSError):
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield srv.getsockname()[1]
    finally:
        done.set()
        t.join(2)
        srv.close()


def test_etcds_port_taken_and_answered_by_another_process_starts_on_new_ports(
    tmp_path: Path, squatter: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = {"n": 0}

    def drawn() -> int:
        calls["n"] += 1
        # one NATS server, then etcd's client port: the squatter's
        return squatter if calls["n"] == 2 else free_port()

    monkeypatch.setattr(ls, "free_port", drawn)
    servers = ls.start_local_servers(tmp_path)
    try:
        assert servers.etcd.port != squatter and servers.etcd.running
        assert calls["n"] > 3  # a second draw of ports
        assert servers.secure
    finally:
        servers.stop()
