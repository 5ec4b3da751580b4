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
    ("err_code", "description", "replicas", "servers", "expected", "size"),
    [
        # nats-server 2.15's answers, seen on loopback servers (see the integration test)
        (10074, "replicas > 1 not supported in non-clustered mode", 3, 1, "config", 1),
        (10074, "replicas > 1 not supported in non-clustered mode", 3, 3, "config", 1),
        (10005, NO_PEERS, 5, 3, "config", 3),  # R5 on a 3-server cluster
        (10005, NO_PEERS + ", peer offline", 5, 3, "config", 3),
        (10005, NO_PEERS, 3, 2, "config", 2),  # one URL given, one more announced
        (10005, NO_PEERS, 3, 3, "shortage", 3),  # a member never joined: unknown to JS
        (10005, NO_PEERS + ", peer offline", 3, 3, "shortage", 3),  # a member restarting
        (10058, "stream name already in use with a different configuration", 3, 3, None, 0),
        (None, "", 3, 3, None, 0),
    ],
)
def test_a_refused_placement_is_a_config_error_only_when_no_server_can_end_it(
    err_code: int | None,
    description: str,
    replicas: int,
    servers: int,
    expected: str | None,
    size: int,
) -> None:
    err = placement_error(err_code, description, replicas, servers)
    if expected is None:
        assert err is None
        return
    kind = ReplicasExceedClusterError if expected == "config" else StreamNotPlacedError
    assert isinstance(err, kind)
    assert err.fields["cluster_size"] == size
    assert err.fields["reason"] == description
    assert (err.retry_after is None) == (expected == "config")


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
