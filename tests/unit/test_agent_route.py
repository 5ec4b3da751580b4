"""The agent's own address when its configuration gives none (the rendezvous of a plan whose
rank 0 runs there listens on it; the controller could otherwise only name 127.0.0.1)."""

from __future__ import annotations

from sailor.agent.node_join import route_address


def test_the_address_towards_the_servers() -> None:
    assert route_address("127.0.0.1:2379") == "127.0.0.1"
    assert route_address("[::1]:2379") in ("::1", "")  # '' on a host without IPv6
    assert route_address("no-such-host.invalid:2379") == ""
    assert route_address("nonsense") == ""


def test_the_first_address_that_is_not_loopback_wins() -> None:
    """On the etcd host with a loopback etcd endpoint, the route to another server gives the
    address other nodes reach; loopback only when every server is here."""
    from sailor.agent.node_join import host_port, node_address

    routes = {"127.0.0.1:2379": "127.0.0.1", "10.0.0.2:4222": "10.0.0.7", "bad:1": ""}
    probe = routes.__getitem__
    assert node_address(["127.0.0.1:2379", "10.0.0.2:4222"], probe) == "10.0.0.7"
    assert node_address(["bad:1", "127.0.0.1:2379"], probe) == "127.0.0.1"
    assert node_address(["bad:1"], probe) == ""
    assert node_address([]) == ""
    assert host_port("nats://10.0.0.2:4222") == "10.0.0.2:4222"
    assert host_port("tls://head") == "head:4222"
    assert host_port("nats://[fd00::2]:4223") == "[fd00::2]:4223"
