"""The agent's own address when its configuration gives none (the rendezvous of a plan whose
rank 0 runs there listens on it; the controller could otherwise only name 127.0.0.1)."""

from __future__ import annotations

from sailor.agent.daemon import route_address


def test_the_address_towards_the_servers() -> None:
    assert route_address("127.0.0.1:2379") == "127.0.0.1"
    assert route_address("[::1]:2379") in ("::1", "")  # '' on a host without IPv6
    assert route_address("no-such-host.invalid:2379") == ""
    assert route_address("nonsense") == ""
