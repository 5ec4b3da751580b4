"""The event stream's limits and name, on real nats-server (docs/operations.md, "Event
stream limits"): an event above ``EVENT_MAX_MSG_SIZE`` is refused at its publish (one agent
stored 40 x 1 MB events in 2 s before, and a thousand filled JetStream so that every node's
publishes failed); a stream an older release made without limits is updated to them; jobs
whose names differ only in case (``x_y``, ``X_Y``) get streams of their own (they shared one,
and the second job's start moved the first's subjects away); a stream of this job's name
that carries another job's subjects is left alone with a clear error, and a job's stream
under its old name (an upper-case job, upgraded) is adopted.

These run on the plain servers: they make streams of jobs that have no logins there, and
streams as an older release made them.
"""

from __future__ import annotations

import nats.js.api
import pytest

from sailor.coordination import (
    EventTooLargeError,
    Keys,
    NatsEventBus,
    StreamConflictError,
    connect_nats,
)
from sailor.coordination.stream_limits import (
    EVENT_MAX_BYTES,
    EVENT_MAX_MSG_SIZE,
    EVENT_MAX_MSGS_PER_SUBJECT,
)
from sailor.localservers import LocalServers

pytestmark = pytest.mark.usefixtures("no_task_leak")


def _old_config(keys: Keys, name: str | None = None) -> nats.js.api.StreamConfig:
    """The stream as releases before the limits made it."""
    return nats.js.api.StreamConfig(
        name=name or keys.legacy_stream,
        subjects=[keys.event_subjects],
        storage=nats.js.api.StorageType.FILE,
        duplicate_window=120.0,
        max_age=24 * 3600.0,
        num_replicas=1,
    )


async def _read_all(bus: NatsEventBus) -> list[str]:
    got: list[str] = []
    while batch := await bus.fetch(50, timeout=0.5):
        for d in batch:
            got.append(d.msg_id)
            await d.ack()
    return got


async def test_limits_set_and_an_oversized_event_refused(plain_servers: LocalServers) -> None:
    keys = Keys(job="limits")
    nc = await connect_nats(plain_servers.nats_url, "c1")
    try:
        ctl = NatsEventBus(nc, keys, durable="ctl")
        await ctl.ensure_stream()
        cfg = (await nc.jetstream().stream_info(keys.stream)).config
        assert (cfg.max_msg_size, cfg.max_msgs_per_subject, cfg.max_bytes) == (
            EVENT_MAX_MSG_SIZE,
            EVENT_MAX_MSGS_PER_SUBJECT,
            EVENT_MAX_BYTES,
        )
        assert cfg.discard == nats.js.api.DiscardPolicy.OLD  # a full stream drops, not refuses
        flood = NatsEventBus(nc, keys, durable="unused", source="n1", op_timeout=1.0)
        with pytest.raises(EventTooLargeError):  # refused for good: no retry can pass
            await flood.publish("heartbeat", b"x" * (EVENT_MAX_MSG_SIZE + 1), msg_id="big")
        other = NatsEventBus(nc, keys, durable="unused", source="n2", op_timeout=1.0)
        assert await other.publish("preemption_notice", b"{}", msg_id="notice")
        assert await _read_all(ctl) == ["notice"]
        await ctl.close()
    finally:
        await nc.close()


async def test_a_stream_without_limits_is_updated_and_keeps_its_events(
    plain_servers: LocalServers,
) -> None:
    keys = Keys(job="upgraded")
    nc = await connect_nats(plain_servers.nats_url, "c1")
    try:
        await nc.jetstream().add_stream(_old_config(keys))
        old = NatsEventBus(nc, keys, durable="unused", source="n1")
        assert await old.publish("node_joined", b"{}", msg_id="before")
        ctl = NatsEventBus(nc, keys, durable="ctl")
        await ctl.ensure_stream()
        cfg = (await nc.jetstream().stream_info(keys.stream)).config
        assert cfg.max_msg_size == EVENT_MAX_MSG_SIZE
        assert cfg.max_msgs_per_subject == EVENT_MAX_MSGS_PER_SUBJECT
        assert await old.publish("node_left", b"{}", msg_id="after")
        assert await _read_all(ctl) == ["before", "after"]
        await ctl.close()
    finally:
        await nc.close()


async def test_jobs_differing_in_case_have_streams_of_their_own(
    plain_servers: LocalServers,
) -> None:
    """``x_y`` and ``X_Y`` shared ``SAILOR_X_Y_EVENTS``; ``X_Y`` and ``x_Y`` keep their case
    (JetStream's names are case-sensitive: both exist side by side)."""
    jobs = [Keys(job=j) for j in ("x_y", "X_Y", "x_Y")]
    assert len({k.stream for k in jobs}) == 3
    nc = await connect_nats(plain_servers.nats_url, "c1")
    try:
        buses = [NatsEventBus(nc, k, durable="ctl") for k in jobs]
        for bus in (*buses, buses[0]):  # the first again: no other took its place
            await bus.ensure_stream()
        for keys in jobs:
            cfg = (await nc.jetstream().stream_info(keys.stream)).config
            assert cfg.subjects == [f"sailor.{keys.job}.events.>"]
            pub = NatsEventBus(nc, keys, durable="unused", source="n1", op_timeout=1.0)
            assert await pub.publish("heartbeat", b"{}", msg_id=keys.job)
        for keys, bus in zip(jobs, buses, strict=True):
            assert await _read_all(bus) == [keys.job]
            await bus.close()
    finally:
        await nc.close()


async def test_another_jobs_stream_of_this_name_is_refused_and_left_alone(
    plain_servers: LocalServers,
) -> None:
    """An older release's job ``X_Y`` made ``SAILOR_X_Y_EVENTS`` with its subjects; job
    ``x_y`` of this release has that name: it refuses, naming both, and changes nothing."""
    theirs, ours = Keys(job="X_Y"), Keys(job="x_y")
    nc = await connect_nats(plain_servers.nats_url, "c1")
    try:
        await nc.jetstream().add_stream(_old_config(theirs))
        assert theirs.legacy_stream == ours.stream
        with pytest.raises(StreamConflictError, match=r"'x_y'.*SAILOR_X_Y_EVENTS.*X_Y"):
            await NatsEventBus(nc, ours, durable="ctl").ensure_stream()
        cfg = (await nc.jetstream().stream_info(ours.stream)).config
        assert cfg.subjects == ["sailor.X_Y.events.>"]
        assert not cfg.max_msg_size or cfg.max_msg_size < 0  # not updated either
    finally:
        await nc.close()


async def test_an_upper_case_jobs_old_stream_is_adopted(plain_servers: LocalServers) -> None:
    keys = Keys(job="Prod")
    assert keys.stream != keys.legacy_stream == "SAILOR_PROD_EVENTS"
    nc = await connect_nats(plain_servers.nats_url, "c1")
    try:
        await nc.jetstream().add_stream(_old_config(keys))
        pub = NatsEventBus(nc, keys, durable="unused", source="n1")
        assert await pub.publish("node_joined", b"{}", msg_id="kept")
        ctl = NatsEventBus(nc, keys, durable="ctl")
        await ctl.ensure_stream()
        await ctl.ensure_stream()  # as the controller does before each fetch
        assert ctl.stream == "SAILOR_PROD_EVENTS"
        cfg = (await nc.jetstream().stream_info("SAILOR_PROD_EVENTS")).config
        assert cfg.max_msg_size == EVENT_MAX_MSG_SIZE
        assert await _read_all(ctl) == ["kept"]
        await ctl.close()
    finally:
        await nc.close()


async def test_jobs_sharing_subjects_through_a_dot_are_told_apart(
    plain_servers: LocalServers,
) -> None:
    """A job name may hold a ``.`` again (``llama-3.1``, valid before names were checked):
    ``a.b`` and ``a_b`` share NATS subjects and the stream's name, and the second job's
    controller refuses to start on the first's stream instead of consuming its events."""
    dot, under = Keys(job="a.b"), Keys(job="a_b")
    assert (dot.stream, dot.event_subjects) == (under.stream, under.event_subjects)
    nc = await connect_nats(plain_servers.nats_url, "c1")
    try:
        await NatsEventBus(nc, dot, durable="ctl").ensure_stream()
        with pytest.raises(StreamConflictError) as err:
            await NatsEventBus(nc, under, durable="ctl").ensure_stream()
        assert "'a_b'" in str(err.value) and "'a.b'" in str(err.value)
        await NatsEventBus(nc, dot, durable="ctl").ensure_stream()  # its own: idempotent
    finally:
        await nc.close()


async def test_an_unmarked_stream_of_this_jobs_subjects_is_taken_and_marked(
    plain_servers: LocalServers,
) -> None:
    keys = Keys(job="llama-3.1")
    nc = await connect_nats(plain_servers.nats_url, "c1")
    try:
        js = nc.jetstream()
        await js.add_stream(_old_config(keys))  # an older release's: no description
        await NatsEventBus(nc, keys, durable="ctl").ensure_stream()
        info = await js.stream_info(keys.stream)
        assert info.config.description == "sailor events of job llama-3.1"
        with pytest.raises(StreamConflictError):
            await NatsEventBus(nc, Keys(job="llama-3_1"), durable="ctl").ensure_stream()
    finally:
        await nc.close()
