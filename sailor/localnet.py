"""Loopback ports for the processes Sailor starts on one machine.

Rendezvous ports of local training ranks, and the nats-server and etcd that the demo, the
integration tests and the benchmarks start: one free-port and one wait-for-port helper for
all of them. Binds to 127.0.0.1 only; never touches another address.
"""

from __future__ import annotations

import secrets
import socket
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["PortTimeoutError", "ProcessExitedError", "free_port", "wait_port"]


class PortTimeoutError(RuntimeError):
    """A process we started did not open its port in time."""


_LOWEST = 10000
"""Ports below this are left to the machine's own services."""
_EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")


def _ephemeral_start() -> int:
    """The first port the kernel hands out as a connection's source port (Linux; 32768
    elsewhere, the IANA range starts higher)."""
    try:
        return int(_EPHEMERAL.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(tries: int = 64) -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago.

    Drawn at random below the kernel's ephemeral range: a port the kernel picked (bind to
    port 0) lies inside that range, where every outgoing connection on the machine takes its
    source port, so between this call and the listener's bind another process's connection
    could take it (``EADDRINUSE`` at a rendezvous). Below the range only an explicit bind
    can, and two callers drawing at random from ~20,000 ports rarely meet. Falls back to
    the kernel's choice when the range starts too low."""
    top = _ephemeral_start()
    for _ in range(tries if top - _LOWEST > 1000 else 0):
        port = _LOWEST + secrets.randbelow(top - _LOWEST)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_port_pair(tries: int = 50) -> int:
    """A port ``p`` on 127.0.0.1 such that ``p`` and ``p + 1`` were both free a moment ago
    (``sailor profile network --master`` listens on both)."""
    for _ in range(tries):
        port = free_port()
        if port >= 65535:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise PortTimeoutError(f"no two consecutive free ports on 127.0.0.1 in {tries} tries")


class ProcessExitedError(PortTimeoutError):
    """The process exited before it opened its port (e.g. a port taken since ``free_port``)."""


def wait_port(
    port: int,
    timeout_s: float,
    what: str = "server",
    exit_code: Callable[[], int | None] | None = None,
) -> None:
    """Return once something accepts connections on 127.0.0.1:``port``; with ``exit_code``
    (``Popen.poll``), fail at once if the process has exited."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        with socket.socket() as s:
            s.settimeout(0.2)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        if exit_code is not None and (rc := exit_code()) is not None:
            raise ProcessExitedError(f"{what} exited with code {rc} before opening port {port}")
        time.sleep(0.02)
    raise PortTimeoutError(f"{what} did not open port {port} within {timeout_s:.0f} s")
