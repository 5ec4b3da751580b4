"""Loopback ports for the processes Sailor starts on one machine.

Rendezvous ports of local training ranks, and the nats-server and etcd that the demo, the
integration tests and the benchmarks start: one free-port and one wait-for-port helper for
all of them. Binds to 127.0.0.1 only; never touches another address.
"""

from __future__ import annotations

import socket
import time

__all__ = ["PortTimeoutError", "free_port", "wait_port"]


class PortTimeoutError(RuntimeError):
    """A process we started did not open its port in time."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, timeout_s: float, what: str = "server") -> None:
    """Return once something accepts connections on 127.0.0.1:``port``."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        with socket.socket() as s:
            s.settimeout(0.2)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.02)
    raise PortTimeoutError(f"{what} did not open port {port} within {timeout_s:.0f} s")
