"""The pure parts of event stream placement: what JetStream's refusal means
(``nats_bus.placement_error``), what an episode of failed placements reports and shows
(``controller.event_stream``), and the deadline's validation. The real servers' side is
tests/integration/test_event_stream_placement.py."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from sailor.controller.config import ControllerConfig
from sailor.controller.event_stream import StreamWatch, placed, shown, unplaced
from sailor.coordination import ReplicasExceedClusterError, StreamNotPlacedError
from sailor.coordination.nats_bus import placement_error

NO_PEERS = "no suitable peers for placement"


@pytest.mark.parametrize(
    ("err_code", "description", "replicas", "expected"),
    [
        # nats-server 2.15's answers, seen on loopback servers (see the integration test)
        (10074, "replicas > 1 not supported in non-clustered mode", 3, "config"),
        (10005, NO_PEERS, 5, "shortage"),  # R5 on a 3-server cluster: told apart by no one
        (10005, NO_PEERS + ", peer offline", 5, "shortage"),
        # R3 on a 3-cluster with one member down, through one URL (a DNS name, a load
        # balancer): the client knew of 2 servers; before, "more than known", a config
        # error that stopped every controller while the member was down
        (10005, NO_PEERS, 3, "shortage"),
        (10005, NO_PEERS + ", peer offline", 3, "shortage"),  # a member restarting
        (10058, "stream name already in use with a different configuration", 3, None),
        (None, "", 3, None),
    ],
)
def test_a_refused_placement_is_a_config_error_only_on_a_server_in_no_cluster(
    err_code: int | None, description: str, replicas: int, expected: str | None
) -> None:
    err = placement_error(err_code, description, replicas)
    if expected is None:
        assert err is None
        return
    kind = ReplicasExceedClusterError if expected == "config" else StreamNotPlacedError
    assert isinstance(err, kind)
    assert err.fields["reason"] == description and err.fields["replicas"] == replicas
    assert (err.retry_after is None) == (expected == "config")
    if expected == "config":
        assert err.fields["cluster_size"] == 1


@pytest.mark.parametrize(
    ("urls", "replicas"),
    [
        (["nats://a:4222", "nats://b:4222"], 3),
        (["nats://a:4222", "tls://A:4222", "nats://b:4222"], 3),  # a and A: one server
        (["nats://a:4222", "nats://a:4223", "nats://a:4224"], 5),
    ],
)
def test_more_replicas_than_several_listed_nats_servers_is_refused_on_load(
    urls: list[str], replicas: int
) -> None:
    """Several URLs list the cluster's members: more replicas can never be placed."""
    with pytest.raises(
        ValidationError, match=f"event_stream_replicas={replicas}: more than the"
    ) as e:
        ControllerConfig(nats_urls=urls, event_stream_replicas=replicas)
    assert "NATS servers nats_urls lists" in str(e.value)


@pytest.mark.parametrize(
    ("urls", "replicas"),
    [
        (["nats://nats.svc:4222"], 3),  # one name may front a cluster of any size
        ("nats://nats.svc:4222", 5),
        (["nats://a:4222", "nats://b:4222", "nats://c:4222"], 3),
        (["nats://a:4222", "nats://b:4222"], 2),
        (["nats://a:4222", "nats://b:4222"], 1),
    ],
)
def test_replicas_within_the_listed_servers_or_behind_one_url_load(
    urls: list[str] | str, replicas: int
) -> None:
    cfg = ControllerConfig(nats_urls=urls, event_stream_replicas=replicas)
    assert cfg.event_stream_replicas == replicas


def test_the_old_single_nats_url_key_fronts_a_cluster_of_any_size() -> None:
    cfg = ControllerConfig.model_validate(
        {"nats_url": "nats://lb:4222", "event_stream_replicas": 3}
    )
    assert cfg.nats_urls == ("nats://lb:4222",)


def test_an_episode_reports_its_start_deadline_and_end_once_each() -> None:
    w = StreamWatch()
    assert shown(w, 3, 7) is None  # nothing failed: nothing written
    w, r = placed(w, 1.0)
    assert r == () and shown(w, 3, 7) is None
    w, r = unplaced(w, 10.0, "a", deadline_s=5.0)
    assert r == ("event_stream_unplaced",)
    first = shown(w, 3, 7)
    assert first is not None and not first.placed and first.since == 10.0
    assert first.reason == "a" and not first.overdue and first.epoch == 7
    w, r = unplaced(w, 12.0, "b", deadline_s=5.0)  # a retry: the answer shows, no report
    assert r == () and w.since == 10.0 and w.reason == "b"
    w, r = unplaced(w, 15.0, "b", deadline_s=5.0)
    assert r == ("event_stream_overdue",) and w.overdue
    w, r = unplaced(w, 30.0, "b", deadline_s=5.0)
    assert r == ()
    w, r = placed(w, 31.0)
    assert r == ("event_stream_placed",)
    back = shown(w, 3, 7)
    assert back is not None and back.placed and back.since == 31.0 and not back.overdue
    w, r = placed(w, 40.0)
    assert r == () and shown(w, 3, 7) == back  # no rewrite while it stays placed
    w, r = unplaced(w, 50.0, "c", deadline_s=5.0)  # a new episode, from its own start
    assert r == ("event_stream_unplaced",) and w.since == 50.0 and not w.overdue


@pytest.mark.parametrize(
    ("value", "why"),
    [(0, "greater than 0"), (-1.0, "greater than 0"), (90_000.0, "less than or equal to 86400")],
)
def test_the_deadline_is_validated_naming_field_and_value(value: float, why: str) -> None:
    with pytest.raises(ValidationError, match="event_stream_deadline_s") as e:
        ControllerConfig(event_stream_deadline_s=value)
    assert why in str(e.value) and f"input_value={value}" in str(e.value)
    assert ControllerConfig().event_stream_deadline_s == 300.0  # a few minutes by default
