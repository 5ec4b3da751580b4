"""An event stream JetStream cannot place, on real nats-server: a configuration error stops
the controller at once, naming ``event_stream_replicas``; a shortage of servers is waited
out, shown by ``sailor status`` (since when, why, overdue past ``event_stream_deadline_s``)
and audited once at its start, deadline and end (docs/runtime.md, "Event stream
placement"). Before, both retried every 0.3 s with a log line each, and nothing showed it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from sailor.cli.main import app
from sailor.controller.audit import read_records
from sailor.controller.daemon import Controller
from sailor.controller.event_intake import _Placement
from sailor.controller.status import read_status
from sailor.coordination import (
    DaemonFailedError,
    Keys,
    ManualClock,
    TemporaryError,
    campaign,
    connect_etcd,
    connect_nats,
)
from sailor.coordination.errors import StreamNotPlacedError
from sailor.localservers import LocalServers, ServerMissingError, start_local_servers
from sailor.schemas.runtime import EventStreamState
from tests.integration.cluster_kit import Cluster, until
from tests.integration.conftest import IDENTITIES, released

pytestmark = pytest.mark.usefixtures("no_task_leak")


@pytest.fixture
async def nats_two_of_three(tmp_path: Path) -> AsyncIterator[LocalServers]:
    """A 3-server NATS cluster whose third server is down from the start (JetStream never
    knew it); ``nats_members[2].start()`` brings it in."""
    try:
        s = start_local_servers(
            tmp_path / "servers", IDENTITIES, nats_servers=3, etcd_members=1, nats_down=1
        )
    except ServerMissingError as exc:
        pytest.skip(str(exc))
    yield s
    await released(s)  # the test's closed etcd clients: else etcd's stop waits on them
    s.stop()


async def test_more_replicas_than_a_single_nats_server_holds_stops_the_controller(
    tmp_path: Path, servers: LocalServers
) -> None:
    """Replicas 3 on a server in no cluster: the start is refused with the field, its value
    and the cluster's size (before: retried forever, the leader taking no event)."""
    cfg = (
        Cluster(tmp_path, servers).ctl_config("c1").model_copy(update={"event_stream_replicas": 3})
    )
    ctl = Controller(cfg)
    with pytest.raises(DaemonFailedError):
        await asyncio.wait_for(ctl.run(), 20)
    assert ctl.failure is not None
    assert "event_stream_replicas=3" in ctl.failure and "1 server" in ctl.failure, ctl.failure
    failed = [r for r in read_records([cfg.audit_log]) if r["kind"] == "failed"]
    assert len(failed) == 1 and failed[0]["cluster_size"] == 1, failed


async def test_a_stream_jetstream_cannot_reserve_is_waited_for_then_stops_the_controller(
    tmp_path: Path, servers: LocalServers
) -> None:
    """An ``event_stream_max_bytes`` above what the server's ``max_file_store`` has left: a
    shortage another job's stream being deleted may end, so the leader retries it, audits
    and shows it, and fails only once it has lasted ``event_stream_deadline_s``, saying
    which two settings to change. Before, it failed at once, and systemd's restart limit
    left the job no controller a minute later; before that, the server's refusal (err_code
    10047) was "jetstream unavailable", retried every 0.3 s for ever, shown nowhere."""
    cfg = (
        Cluster(tmp_path, servers)
        .ctl_config("c1")
        .model_copy(
            update={
                "event_stream_max_bytes": 1 << 40,  # 1 TiB: more than the disk
                "event_stream_deadline_s": 4.0,
            }
        )
    )
    ctl = Controller(cfg)
    task = asyncio.create_task(ctl.run(), name="test-ctl-c1")
    try:
        await until(lambda: ctl.leadership is not None or task.done(), 20, "c1 leading")

        def reported() -> bool:
            kinds = [r["kind"] for r in read_records([cfg.audit_log])]
            return "event_stream_unplaced" in kinds or task.done()

        await until(reported, 10, "the shortage reported")
        assert not task.done(), ctl.failure  # retried, not failed at once
        (rec,) = [r for r in read_records([cfg.audit_log]) if r["kind"] == "event_stream_unplaced"]
        assert "max_file_store" in rec["reason"], rec
        with pytest.raises(DaemonFailedError):
            await asyncio.wait_for(asyncio.shield(task), 20)
    finally:
        if not task.done():
            ctl.stopping.set()
            ctl.wake()
            await asyncio.wait({task}, timeout=15)
    assert ctl.failure is not None
    assert "max_file_store" in ctl.failure and "event_stream_max_bytes" in ctl.failure
    records = read_records([cfg.audit_log])
    overdue = [r for r in records if r["kind"] == "event_stream_overdue"]
    (failed,) = [r for r in records if r["kind"] == "failed"]
    assert len(overdue) == 1 and failed["time"] - overdue[0]["since"] >= 4.0, (overdue, failed)


async def test_a_standby_whose_replicas_no_server_holds_is_refused_at_its_start(
    tmp_path: Path, servers: LocalServers
) -> None:
    """Replicas 3 on a server in no cluster, on a standby while another controller leads:
    refused at its start, naming the field, from the server's INFO (nothing placed), and
    the leader leads on. Before, the standby waited as one, and failed only once it led:
    when the leader it was there to replace was lost."""
    async with Cluster(tmp_path, servers) as cluster:
        leader = cluster.start_controller("c1")
        await until(lambda: leader.leadership is not None, 20, "c1 leading")
        cfg = cluster.ctl_config("c2").model_copy(update={"event_stream_replicas": 3})
        standby = Controller(cfg)
        with pytest.raises(DaemonFailedError):
            await asyncio.wait_for(standby.run(), 10)
        assert standby.failure is not None and standby.leadership is None
        assert "event_stream_replicas=3 cannot be placed" in standby.failure, standby.failure
        assert "in no cluster" in standby.failure and "at most 1" in standby.failure
        (failed,) = [r for r in read_records([cfg.audit_log]) if r["kind"] == "failed"]
        assert failed["epoch"] == -1 and failed["cluster_size"] == 1, failed
        assert not [r for r in read_records([cfg.audit_log]) if r["kind"] == "leader"]
        assert leader.leadership is not None and leader.failure is None


@pytest.mark.parametrize("urls", ["every member", "one URL"])
async def test_a_shortage_of_nats_servers_shows_in_status_until_the_stream_is_placed(
    tmp_path: Path, nats_two_of_three: LocalServers, urls: str
) -> None:
    """Replicas 3 on a 3-server cluster with one server down: the leader leads, status says
    the stream is not placed (why, since when, then overdue), the audit log says so once;
    the server's start places it, status and audit say that too. Through one URL (a DNS
    name, a load balancer, the old ``nats_url`` key) too: the client then knows of the two
    servers up only; before, 3 replicas "more than the 2 servers known" was taken for a
    configuration error that stopped the controller (and its standby) while NATS was
    short a member."""
    servers = nats_two_of_three
    listed = servers.nats_urls if urls == "every member" else servers.nats_urls[:1]
    cfg = (
        Cluster(tmp_path, servers)
        .ctl_config("c1")
        .model_copy(
            update={
                "nats_urls": listed,
                "event_stream_replicas": 3,
                "event_stream_deadline_s": 1.0,
            }
        )
    )
    sec = servers.security("c1")
    ctl = Controller(cfg)
    task = asyncio.create_task(ctl.run(), name="test-ctl-c1")
    loop = asyncio.get_running_loop()

    async def stream(want: str, timeout: float) -> dict[str, Any]:
        end = loop.time() + timeout
        while True:
            assert not task.done(), ctl.failure
            st = (await read_status(servers.etcd_endpoint, cfg.job, sec))["event_stream"]
            if st is not None and (
                (want == "overdue" and st["overdue"]) or (want == "placed" and st["placed"])
            ):
                return dict(st)
            assert loop.time() < end, f"event stream not {want} within {timeout} s: {st}"
            await asyncio.sleep(0.2)

    try:
        # JetStream of two servers elects its meta leader (~5 s), then refuses R3
        st = await stream("overdue", 30)
        assert not st["placed"] and st["replicas"] == 3 and st["for_s"] >= 1.0
        assert "no suitable peers" in str(st["reason"]), st
        assert ctl.leadership is not None  # it leads meanwhile
        await asyncio.to_thread(servers.nats_members[2].start)
        st = await stream("placed", 30)
        assert not st["overdue"]
        nc = await connect_nats(servers.nats_urls, "c1", security=sec)
        try:
            info = await nc.jetstream().stream_info(ctl.keys.stream)
            assert info.config.num_replicas == 3
        finally:
            await nc.close()
    finally:
        ctl.stopping.set()
        ctl.wake()
        await asyncio.wait_for(task, 15)
    records = [r for r in read_records([cfg.audit_log]) if r["kind"].startswith("event_stream_")]
    assert [r["kind"] for r in records] == [
        "event_stream_unplaced",
        "event_stream_overdue",
        "event_stream_placed",
    ], records
    assert "no suitable peers" in records[0]["reason"]
    assert records[2]["unplaced_s"] >= 1.0  # the deadline passed first
    assert ctl.failure is None


@pytest.mark.parametrize("placed", [False, True])
async def test_status_shows_the_stream_unplaced_then_placed(
    module_plain_servers: LocalServers, tmp_path: Path, placed: bool
) -> None:
    """``sailor status`` prints the leader's ``event-stream`` record: not placed (since when,
    why, OVERDUE), and once placed, placed since when, for the rest of the term. Before,
    it printed nothing once the stream was placed, while the docs said it showed that."""
    ep = module_plain_servers.etcd_endpoint
    job = f"es-{tmp_path.name}"[:40]
    keys = Keys(job=job)
    record = EventStreamState(
        placed=placed,
        since=time.time() - 30,
        reason="" if placed else "jetstream cannot place 3 replicas now: no suitable peers",
        replicas=3,
        overdue=not placed,
        epoch=1,
    )
    store = await connect_etcd(ep)
    try:
        await store.put(keys.event_stream, record.model_dump_json().encode())
        cfg = tmp_path / "controller.yaml"
        cfg.write_text(f"etcd_endpoints: [{ep}]\njob: {job}\ncheckpoint_dir: /ck\n")
        res = await asyncio.to_thread(CliRunner().invoke, app, ["status", "--config", str(cfg)])
    finally:
        await store.close()
    out = " ".join(res.output.split())  # the console wraps at its width
    assert res.exit_code == 0, res.output
    if placed:
        assert "event stream placed since" in out and "3 replicas" in out, out
        assert "not placed" not in out
    else:
        assert "event stream not placed OVERDUE since" in out, out
        assert "no suitable peers" in out


async def test_a_shortage_through_a_leader_change_counts_from_its_first_term(
    tmp_path: Path, nats_two_of_three: LocalServers
) -> None:
    """Replicas 3 with a NATS server down; the leader's term ends (a restart) before the
    shortage's deadline, and the next term's episode counts from the first one's start: it
    is overdue at its first failed placement, its ``since`` the first term's. The start is
    kept unleased in etcd until a placement, which deletes it. Before, each term counted
    from its own first failure: leader changes more frequent than the deadline hid the
    shortage for good."""
    servers = nats_two_of_three
    cfg = (
        Cluster(tmp_path, servers)
        .ctl_config("c1")
        .model_copy(update={"event_stream_replicas": 3, "event_stream_deadline_s": 5.0})
    )
    sec = servers.security("c1")
    keys = Keys(job=cfg.job)
    loop = asyncio.get_running_loop()

    async def shown(ctl: Controller, task: asyncio.Task[None], want: str) -> dict[str, Any]:
        end = loop.time() + 30
        while True:
            assert not task.done(), ctl.failure
            st = (await read_status(servers.etcd_endpoint, cfg.job, sec))["event_stream"]
            lead = ctl.leadership
            if st is not None and lead is not None and st["epoch"] == lead.epoch and st[want]:
                return dict(st)
            assert loop.time() < end, f"event stream not {want}: {st}"
            await asyncio.sleep(0.2)

    async def stop(ctl: Controller, task: asyncio.Task[None]) -> None:
        ctl.stopping.set()
        ctl.wake()
        await asyncio.wait_for(task, 15)

    first = Controller(cfg)
    task = asyncio.create_task(first.run(), name="test-ctl-c1-term1")
    try:
        began = (await shown(first, task, "reason"))["since"]
    finally:
        await stop(first, task)
    store = await connect_etcd(servers.etcd_endpoint, security=sec)
    try:
        kept = await store.get(keys.event_stream_shortage)  # unleased: outlives the term
        assert kept is not None and EventStreamState.model_validate_json(kept.value).since == began
        # the deadline passes while no term leads
        await asyncio.sleep(max(0.0, began + 5.5 - time.time()))
        second = Controller(cfg)
        task = asyncio.create_task(second.run(), name="test-ctl-c1-term2")
        try:
            st = await shown(second, task, "overdue")
            assert st["since"] == began and not st["placed"], st
            await asyncio.to_thread(servers.nats_members[2].start)
            await shown(second, task, "placed")
            await until_gone(store, keys.event_stream_shortage)
        finally:
            await stop(second, task)
    finally:
        await store.close()
    records = [r for r in read_records([cfg.audit_log]) if r["kind"].startswith("event_stream_")]
    kinds = [r["kind"] for r in records]
    assert kinds == [
        "event_stream_unplaced",
        "event_stream_unplaced",
        "event_stream_overdue",
        "event_stream_placed",
    ], records
    assert records[1]["since"] == began and records[2]["since"] == began
    assert records[0]["epoch"] < records[1]["epoch"]


async def until_gone(store: Any, key: str) -> None:
    end = time.monotonic() + 10
    while await store.get(key) is not None:
        assert time.monotonic() < end, f"{key} still there"
        await asyncio.sleep(0.2)


class _Bus:
    """The bus's placement answer as told: placed, or "no suitable peers" (a shortage).
    Only ``ensure_stream``'s answer is stood in: what the controller keeps of it goes to
    a real etcd."""

    def __init__(self) -> None:
        self.short = False

    async def ensure_stream(self) -> None:
        if self.short:
            raise StreamNotPlacedError("stream not placed", reason="no suitable peers")


@pytest.mark.parametrize("lost", ["write_answer", "delete", "both"])
async def test_a_shortage_start_goes_with_its_episode_whatever_etcd_answered(
    tmp_path: Path, servers: LocalServers, monkeypatch: pytest.MonkeyPatch, lost: str
) -> None:
    """Episode 1 of a shortage writes its start (``event-stream-shortage``), and the
    placement that ends it deletes it; etcd fails one of the two: ``write_answer``, the
    start's write commits and its answer is lost; ``delete``, the placement's delete fails
    (the next episode begins before another placement); ``both``. A later episode, long after, is
    not overdue at its first failure and the key holds its own start, as a next term
    reads it. Before, a lost answer kept the term's earlier "cleared" and no placement
    deleted the start; a start this term kept was carried into a new episode (overdue at
    once), or a failed delete left it to the next term."""
    clock = ManualClock(start=time.time())
    cfg = (
        Cluster(tmp_path, servers)
        .ctl_config("c1")
        .model_copy(update={"event_stream_replicas": 3, "event_stream_deadline_s": 60.0})
    )
    keys = Keys(job=cfg.job)
    store = await connect_etcd(servers.etcd_endpoint, security=servers.security("c1"))
    ctl = Controller(cfg, clock=clock)
    lead = await campaign(store, keys.leader, "c1", 10, timeout=10)
    try:
        bus, placement = _Bus(), _Placement()
        assert await ctl._ensure_stream(bus, store, lead, placement)  # type: ignore[arg-type]
        bus.short = True  # episode 1
        if lost in ("write_answer", "both"):
            real_put = store.put_guarded

            async def answer_lost(*a: Any, **k: Any) -> Any:
                await real_put(*a, **k)
                raise TemporaryError("etcd restarted before it answered")

            monkeypatch.setattr(store, "put_guarded", answer_lost)
        assert not await ctl._ensure_stream(bus, store, lead, placement)  # type: ignore[arg-type]
        monkeypatch.undo()
        first = await store.get(keys.event_stream_shortage)
        assert first is not None
        bus.short = False  # episode 1 ends, well within the deadline
        if lost in ("delete", "both"):

            async def refused(*a: Any, **k: Any) -> Any:
                raise TemporaryError("etcd unavailable")

            monkeypatch.setattr(store, "delete_guarded", refused)
        assert await ctl._ensure_stream(bus, store, lead, placement)  # type: ignore[arg-type]
        monkeypatch.undo()
        if lost == "write_answer":
            assert await store.get(keys.event_stream_shortage) is None
        clock.advance(3600.0)  # an hour later, episode 2
        bus.short = True
        began = clock.now()
        assert not await ctl._ensure_stream(bus, store, lead, placement)  # type: ignore[arg-type]
        assert placement.watch.since == began and not placement.watch.overdue, placement.watch
        kept = await store.get(keys.event_stream_shortage)
        assert kept is not None
        assert EventStreamState.model_validate_json(kept.value).since == began
        bus.short = False
        assert await ctl._ensure_stream(bus, store, lead, placement)  # type: ignore[arg-type]
        assert await store.get(keys.event_stream_shortage) is None
    finally:
        await lead.resign()
        ctl.audit.close()
        await store.close()
