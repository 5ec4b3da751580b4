"""The pure parts of the failing-node policy: reading a failure text, counting, the backoff."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from sailor.controller.node_health import (
    ExclusionPolicy,
    charge,
    excluded,
    forget_gone,
    parse_failure,
    trained,
)
from sailor.megatron_patch.errors import failure_record, signal_failure_record
from sailor.schemas.runtime import DesiredState, NodeHealth

POLICY = ExclusionPolicy(failures=2, exclude_s=100, max_exclude_s=300)


def _worker_record(exc: BaseException, in_training: bool, traceback_chars: int = 0) -> str:
    """What the agent puts in ``AgentStatus.failure``: the record's first 2000 characters."""
    rec = failure_record(exc, rank=3, step=7, in_training=in_training)
    rec["traceback"] = "x" * traceback_chars or rec["traceback"]
    return json.dumps(rec)[:2000]


@pytest.mark.parametrize(
    ("text", "origin", "retry", "summary"),
    [
        (_worker_record(ValueError("bad seq_len"), False), "config", False, "ValueError: bad"),
        (_worker_record(RuntimeError("CUDA error: unhandled cuda error"), True), "local", True, ""),
        (_worker_record(RuntimeError("Connection closed by peer"), True), "peer", True, ""),
        # a long traceback cut at 2000 characters: no longer JSON, the keys still read
        (
            _worker_record(ValueError("bad seq_len"), False, traceback_chars=5000),
            "config",
            False,
            "ValueError: bad seq_len",
        ),
        (json.dumps(signal_failure_record(0, -6, 12)), "local", True, "Signal: rank 0 killed"),
        # the toy worker's record names no origin; the supervisor's text is no record
        ('{"rank": 0, "error": "TimeoutError", "message": "late"}', "unknown", True, "Timeout"),
        ("rank 1 exit 1: Traceback | OSError", "unknown", True, "rank 1 exit 1"),
        ("", "unknown", True, ""),
        ("{not json", "unknown", True, "{not json"),
    ],
)
def test_parse_failure_reads_origin_and_retry(
    text: str, origin: str, retry: bool, summary: str
) -> None:
    cause = parse_failure(text)
    assert (cause.origin, cause.retry) == (origin, retry)
    assert cause.summary.startswith(summary) and len(cause.summary) <= 200
    assert cause.own is (origin != "peer")


def test_charge_counts_once_per_generation_and_backs_off() -> None:
    local = json.dumps({"origin": "local", "retry": True, "error_type": "X", "message": "m"})
    h, notes = charge({}, {"n1": local, "n2": '{"origin": "peer"}'}, 4, 10.0, POLICY)
    assert set(h) == {"n1"} and h["n1"].failures == 1 and notes == []
    again, _ = charge(h, {"n1": local}, 4, 11.0, POLICY)
    assert again == h  # the same generation's failure, seen again
    h, notes = charge(h, {"n1": local}, 5, 20.0, POLICY)
    assert h["n1"].excluded_until == 120.0 and h["n1"].exclusions == 1
    assert len(notes) == 1 and notes[0].startswith("excluded n1 until 1970-01-01T00:02:00Z")
    assert "100 s" in notes[0] and "2 consecutive failures" in notes[0]
    assert excluded(h, 119.0) == {"n1"} and excluded(h, 120.0) == frozenset()
    lengths = []
    for gen in (6, 7, 8):
        h, _ = charge(h, {"n1": local}, gen, 1000.0, POLICY)
        lengths.append(h["n1"].excluded_until - 1000.0)
    assert lengths == [200.0, 300.0, 300.0]
    # trained: the streak ends, the backoff stays; a record with nothing else goes
    h = trained(h | {"n2": NodeHealth(failures=1, generation=8)}, ["n1", "n2", "n9"])
    assert h["n1"].failures == 0 and h["n1"].exclusions == 4 and "n2" not in h
    assert forget_gone(h, {"n2": object()}) == {}


def test_the_policy_and_the_record_are_validated() -> None:
    with pytest.raises(ValidationError, match=r"max_exclude_s=10\.0.*below exclude_s"):
        ExclusionPolicy(exclude_s=60, max_exclude_s=10)
    with pytest.raises(ValidationError, match="failures"):
        ExclusionPolicy(failures=0)
    with pytest.raises(ValidationError, match="greater than or equal to 0"):
        NodeHealth(failures=-1)
    with pytest.raises(ValidationError, match=r"excluded_until=5\.0.*exclusions is 0"):
        NodeHealth(excluded_until=5)
    with pytest.raises(ValidationError, match=r"node_health\.n1\.exclusions"):
        DesiredState.model_validate({"epoch": 1, "node_health": {"n1": {"exclusions": -2}}})
