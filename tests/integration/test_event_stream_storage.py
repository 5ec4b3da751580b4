"""The event stream on a NATS server whose JetStream store is small (docs/operations.md,
"Event stream limits"): JetStream reserves a stream's ``max_bytes`` out of
``max_file_store`` when the stream is made or raised, and nothing for its other limits.

With a 1 GiB default a second job's stream did not fit a 1.5 GB store: the server's refusal
(``insufficient storage resources``, a 500) was wrapped as "jetstream unavailable" with its
reason lost, and the controller retried it every 0.3 s for ever, reading no event; a stream
an older release made without limits could not be updated either, and was never consumed.
Now the default is small, a refused reservation is an error naming ``max_file_store``, and a
refused update leaves the existing stream to be consumed with its old limits.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import nats.js.api
import pytest

from sailor.coordination import Keys, NatsEventBus, StreamStorageError, connect_nats
from sailor.coordination.stream_limits import EVENT_MAX_BYTES
from sailor.localnet import free_port
from sailor.localservers import ServerMissingError, ServerProcess, server_binaries

pytestmark = pytest.mark.usefixtures("no_task_leak")

STORE_MB = 160
"""Room for two streams of the default 64 MiB, not for a third (nor for one of 1 GiB)."""


@pytest.fixture
def small_store_url(tmp_path: Path) -> Iterator[str]:
    """A nats-server whose JetStream file store holds ``STORE_MB`` MB: its URL."""
    try:
        binary = server_binaries()[0]
    except ServerMissingError as exc:
        pytest.skip(str(exc))
    port = free_port()
    conf = tmp_path / "nats.conf"
    conf.write_text(
        json.dumps(
            {
                "listen": f"127.0.0.1:{port}",
                "jetstream": {
                    "store_dir": str(tmp_path / "js"),
                    "max_file_store": STORE_MB * 1024 * 1024,
                    "max_memory_store": 8 * 1024 * 1024,
                },
            }
        )
    )
    server = ServerProcess("nats", [binary, "-c", str(conf)], port, tmp_path / "nats.log")
    server.start()
    try:
        yield f"nats://127.0.0.1:{port}"
    finally:
        server.stop()


def _old_config(keys: Keys) -> nats.js.api.StreamConfig:
    """The stream as releases before the limits made it (no max_bytes: nothing reserved)."""
    return nats.js.api.StreamConfig(
        name=keys.stream,
        subjects=[keys.event_subjects],
        storage=nats.js.api.StorageType.FILE,
        duplicate_window=120.0,
        max_age=24 * 3600.0,
        num_replicas=1,
    )


async def test_default_streams_fit_and_a_reservation_refused_names_max_file_store(
    small_store_url: str,
) -> None:
    assert 2 * EVENT_MAX_BYTES <= STORE_MB * 1024 * 1024 < 3 * EVENT_MAX_BYTES
    nc = await connect_nats(small_store_url, "c1")
    try:
        for job in ("joba", "jobb"):
            await NatsEventBus(nc, Keys(job=job), durable="ctl").ensure_stream()
        third = NatsEventBus(nc, Keys(job="jobc"), durable="ctl")
        with pytest.raises(StreamStorageError) as err:
            await third.ensure_stream()
        text = str(err.value)
        assert "max_file_store" in text and "event_stream_max_bytes" in text
        assert "insufficient storage" in text  # the server's own words, kept
        # a smaller max_bytes (the controller's event_stream_max_bytes) fits
        small = NatsEventBus(nc, Keys(job="jobc"), durable="ctl", max_bytes=8 * 1024 * 1024)
        await small.ensure_stream()
        info = await nc.jetstream().stream_info(Keys(job="jobc").stream)
        assert info.config.max_bytes == 8 * 1024 * 1024
    finally:
        await nc.close()


async def test_an_old_stream_whose_update_does_not_fit_is_consumed_as_it_is(
    small_store_url: str,
) -> None:
    keys = Keys(job="old")
    nc = await connect_nats(small_store_url, "c1")
    try:
        js = nc.jetstream()
        await js.add_stream(_old_config(keys))
        agent = NatsEventBus(nc, keys, durable="unused", source="n1")
        assert await agent.publish("node_joined", b"{}", msg_id="before")
        ctl = NatsEventBus(nc, keys, durable="ctl", max_bytes=STORE_MB * 2 * 1024 * 1024)
        for _ in range(2):  # each ensure tries the update again; neither blocks the consumer
            await ctl.ensure_stream()
        assert (await js.stream_info(keys.stream)).config.max_bytes == -1  # left as it was
        assert await agent.publish("node_left", b"{}", msg_id="after")
        got = []
        while batch := await ctl.fetch(10, timeout=0.5):
            for d in batch:
                got.append(d.msg_id)
                await d.ack()
        assert got == ["before", "after"]
        await ctl.close()
    finally:
        await nc.close()
