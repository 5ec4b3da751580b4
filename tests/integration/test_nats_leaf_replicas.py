"""The standby's check of ``event_stream_replicas`` against a real nats-server leaf node
(``nats_bus.unclustered_replicas``): what a leaf's INFO says, and that the check defers.

A leaf node names itself as its cluster in its INFO (nats-server 2.15), whether its
JetStream extends the hub's domain or is its own: the INFO cannot tell them apart, so the
check does not refuse either (the first placement answers) and says so in a warning. A
standalone server's INFO names no cluster and is still refused
(``test_event_stream_placement``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from sailor.coordination import close_nats, connect_nats, unclustered_replicas
from sailor.localnet import free_port
from sailor.localservers import ServerMissingError, ServerProcess, server_binaries

pytestmark = pytest.mark.usefixtures("no_task_leak")

_ACCOUNTS = {
    "accounts": {
        "SYS": {"users": [{"user": "sys", "password": "sys"}]},
        "APP": {"jetstream": "enabled", "users": [{"user": "app", "password": "app"}]},
    },
    "system_account": "SYS",
}


def _server(root: Path, name: str, conf: dict[str, object], port: int) -> ServerProcess:
    path = root / f"{name}.conf"
    path.write_text(json.dumps({"server_name": name, "listen": f"127.0.0.1:{port}", **conf}))
    nats = server_binaries()[0]
    return ServerProcess(name, [nats, "-c", str(path)], port, root / f"{name}.log")


@pytest.fixture(params=["will_extend", "no_extend"])
def leaf_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A hub with JetStream and a leaf node connected to it (the job's account and the
    system account over the leaf connection), the leaf's JetStream extending the hub's
    domain (``will_extend``) or its own (``no_extend``, domain ``edge``): the leaf's URL."""
    try:
        server_binaries()
    except ServerMissingError as exc:
        pytest.skip(str(exc))
    hub_port, leaf_listen, leaf_port = free_port(), free_port(), free_port()
    hub = _server(
        tmp_path,
        "hub",
        {
            **_ACCOUNTS,
            "jetstream": {"store_dir": str(tmp_path / "hub")},
            "leafnodes": {"listen": f"127.0.0.1:{leaf_listen}"},
        },
        hub_port,
    )
    js: dict[str, str] = {"store_dir": str(tmp_path / "leaf"), "extension_hint": request.param}
    if request.param == "no_extend":
        js["domain"] = "edge"
    remote = f"127.0.0.1:{leaf_listen}"
    leaf = _server(
        tmp_path,
        "leaf",
        {
            **_ACCOUNTS,
            "jetstream": js,
            "leafnodes": {
                "remotes": [
                    {"urls": [f"nats://app:app@{remote}"], "account": "APP"},
                    {"urls": [f"nats://sys:sys@{remote}"], "account": "SYS"},
                ]
            },
        },
        leaf_port,
    )
    hub.start()
    try:
        leaf.start()
        try:
            yield f"nats://app:app@127.0.0.1:{leaf_port}"
        finally:
            leaf.stop()
    finally:
        hub.stop()


async def test_a_leaf_node_running_jetstream_is_not_refused_from_its_info(leaf_url: str) -> None:
    """The leaf's INFO says ``jetstream: true`` and names its own server as its cluster;
    the check refuses nothing (the hub may place the replicas: the first placement tells)
    and logs that it could not check. Before, the same INFO was let through with no word
    (the leaf taken for a cluster member), and one without a cluster would have been
    refused though its JetStream might extend a hub's."""
    nc = await connect_nats(leaf_url, "c2")
    try:
        info = nc._server_info
        assert info["jetstream"] is True and info["cluster"] == info["server_name"] == "leaf"
        with capture_logs() as logs:
            assert unclustered_replicas(nc, 3) is None
            assert unclustered_replicas(nc, 1) is None
        (warned,) = [e for e in logs if e["event"] == "event_stream_replicas_unchecked"]
        assert warned["replicas"] == 3 and warned["server"] == "leaf"
    finally:
        await close_nats(nc)
