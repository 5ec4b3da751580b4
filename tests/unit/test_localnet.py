"""Loopback port helpers: a server that dies before binding fails fast, not after the timeout."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from sailor.localnet import PortTimeoutError, ProcessExitedError, free_port, wait_port


def test_wait_port_fails_fast_when_the_process_exits() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    t0 = time.monotonic()
    with pytest.raises(ProcessExitedError, match="exited with code 3"):
        wait_port(free_port(), 30.0, "stand-in", proc.poll)
    assert time.monotonic() - t0 < 10.0


def test_wait_port_times_out_without_a_listener() -> None:
    with pytest.raises(PortTimeoutError, match="did not open port"):
        wait_port(free_port(), 0.3, "nothing")


def test_free_port_pair_gives_two_bindable_ports() -> None:
    import socket

    from sailor.localnet import free_port_pair

    port = free_port_pair()
    for p in (port, port + 1):
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_free_ports_lie_below_the_ephemeral_range() -> None:
    """Outgoing connections take their source ports from the kernel's ephemeral range; a
    port handed out for a listener lies below it, so none of them can take it first."""
    import socket

    from sailor.localnet import _ephemeral_start

    top = _ephemeral_start()
    ports = [free_port() for _ in range(50)]
    assert all(10000 <= p < top for p in ports)
    assert len(set(ports)) > 45  # drawn at random, not one port again and again
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[0]))
