"""The pure parts of the failing-node policy: reading a failure text, counting, the backoff."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from sailor.controller.failure_text import parse_failure
from sailor.controller.forgetting import forget_config, forget_gone, readmit, trained
from sailor.controller.node_health import (
    ExclusionPolicy,
    charge,
    excluded,
    held,
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
        # nested past json's recursion limit (an agent's status carries up to 4,096
        # characters of a worker's error file): RecursionError crashed the leader's pass
        ("[" * 3000, "unknown", True, "[[["),
    ],
)
def test_parse_failure_reads_origin_and_retry(
    text: str, origin: str, retry: bool, summary: str
) -> None:
    cause = parse_failure(text)
    assert (cause.origin, cause.retry) == (origin, retry)
    assert cause.summary.startswith(summary) and len(cause.summary) <= 200
    assert cause.own is (origin != "peer")


def _d(health: dict[str, NodeHealth], gen: int, placed: int = 2, **kw: object) -> DesiredState:
    placement = {f"n{i}": (i - 1,) for i in range(1, placed + 1)}
    return DesiredState(
        epoch=1,
        generation=gen,
        placement=placement,
        node_health=health,
        **kw,  # type: ignore[arg-type]
    )


def test_charge_counts_once_per_generation_and_backs_off() -> None:
    local = json.dumps({"origin": "local", "retry": True, "error_type": "X", "message": "m"})
    c = charge(_d({}, 4), {"n1": local, "n2": '{"origin": "peer"}'}, 10.0, POLICY)
    h = c.health
    assert set(h) == {"n1"} and h["n1"].failures == 1 and c.notes == []
    assert h["n1"].origin == "local" and c.job == NodeHealth()
    again = charge(_d(h, 4), {"n1": local}, 11.0, POLICY)
    assert again.health == h  # the same generation's failure, seen again
    c = charge(_d(h, 5), {"n1": local}, 20.0, POLICY)
    h = c.health
    assert h["n1"].excluded_until == 120.0 and h["n1"].exclusions == 1
    assert len(c.notes) == 1 and c.notes[0].startswith("excluded n1 until 1970-01-01T00:02:00Z")
    assert "100 s" in c.notes[0] and "2 consecutive failures" in c.notes[0]
    assert excluded(h, 119.0) == {"n1"} and excluded(h, 120.0) == frozenset()
    lengths = []
    for gen in (6, 7, 8):
        h = charge(_d(h, gen), {"n1": local}, 1000.0, POLICY).health
        lengths.append(h["n1"].excluded_until - 1000.0)
    assert lengths == [200.0, 300.0, 300.0]
    # trained: the streak ends, the backoff stays; a record with nothing else goes
    job = NodeHealth(failures=1, generation=8)
    h, job = trained(h | {"n2": NodeHealth(failures=1, generation=8)}, job, ["n1", "n2", "n9"])
    assert h["n1"].failures == 0 and h["n1"].exclusions == 4 and "n2" not in h
    assert job == NodeHealth()


def test_a_failure_alike_on_most_placed_nodes_is_the_jobs() -> None:
    """At least two nodes and more than half of the placed ones, numbers aside (each rank
    names its own); a killed worker that outlived SIGKILL is the node's however many."""

    def rec(msg: str, kind: str = "RuntimeError") -> str:
        return json.dumps({"origin": "local", "retry": True, "error_type": kind, "message": msg})

    alike = {"n1": rec("rank 0: bad shape 12"), "n2": rec("rank 7: bad shape 96")}
    c = charge(_d({}, 3, placed=3), alike, 5.0, POLICY)
    assert c.health == {} and c.job.failures == 1 and c.job.generation == 3
    assert "2 of the placed nodes failed alike (n1, n2)" in c.notes[-1]
    # not more than half: each node's
    c = charge(_d({}, 3, placed=4), alike, 5.0, POLICY)
    assert set(c.health) == {"n1", "n2"} and c.job == NodeHealth()
    # one node alone is its own, even in a one-node layout
    c = charge(_d({}, 3, placed=1), {"n1": alike["n1"]}, 5.0, POLICY)
    assert set(c.health) == {"n1"} and c.job == NodeHealth()
    stuck = {
        n: rec(f"rank {i}'s process {i}0 outlived", "OutlivedKill") for i, n in enumerate(alike)
    }
    c = charge(_d({}, 3, placed=2), stuck, 5.0, POLICY)
    assert set(c.health) == {"n1", "n2"} and c.job == NodeHealth()
    # the job's exclusion follows the policy: two generations in a row (POLICY.failures 2)
    one = NodeHealth(failures=1, generation=3, cause="RuntimeError: rank #: bad shape #")
    job = charge(_d({}, 4, placed=2, job_health=one), alike, 6.0, POLICY).job
    assert job.failures == 2 and job.excluded_until == 106.0 and held(job, 105.0)


def test_taking_a_count_back_undoes_the_exclusion_it_set() -> None:
    """A node counted (and excluded by that count) before the job-wide evidence came in
    gets its count and exclusion back; one already excluded before keeps its backoff."""
    cfg = json.dumps(
        {"origin": "config", "retry": False, "error_type": "ValueError", "message": "x"}
    )
    before = NodeHealth(failures=1, generation=1, exclusions=1, excluded_until=50.0, cause="Y")
    # n3 trained with that config: a configuration error is then the node's, not the job's
    c = charge(_d({"n1": before}, 3), {"n1": cfg}, 100.0, POLICY, {"n3"})
    assert c.health["n1"].exclusions == 2 and c.health["n1"].excluded_until == 300.0
    back = charge(_d(c.health, 3), {"n2": cfg}, 101.0, POLICY, {"n3"})
    rec = back.health["n1"]
    assert (rec.failures, rec.exclusions, rec.excluded_until, rec.generation) == (1, 1, 0.0, -1)
    assert back.job.excluded_until == 201.0 and back.job.origin == "config"
    # and a node with nothing else on record loses the record
    fresh = charge(_d({}, 3), {"n1": cfg}, 100.0, POLICY, {"n3"}).health
    assert charge(_d(fresh, 3), {"n2": cfg}, 101.0, POLICY, {"n3"}).health == {}


def test_one_nodes_configuration_error_is_taken_back_once_the_next_layout_fails_alike() -> None:
    """n1's worker refused the config first; n2's was stopped by the abort before it read it
    (a loaded host, a slower start): n1 alone is charged and excluded. The next layout, n2
    alone, fails the same way: the job is held, and n1's count of the earlier generation
    (and the exclusion it set) is taken back: it was never n1's fault."""
    cfg = json.dumps(
        {"origin": "config", "retry": False, "error_type": "ValueError", "message": "bad seq"}
    )
    g1 = charge(_d({}, 1), {"n1": cfg}, 100.0, POLICY)
    assert g1.job == NodeHealth() and excluded(g1.health, 101.0) == {"n1"}
    d2 = DesiredState(epoch=1, generation=2, placement={"n2": (0,)}, node_health=g1.health)
    g2 = charge(d2, {"n2": cfg}, 110.0, POLICY)
    assert held(g2.job, 111.0) and g2.health == {}
    assert any(n.startswith("taken back from n1: its configuration error") for n in g2.notes)
    # a node's other failure, or another configuration error, is not the job's: kept
    other = json.dumps(
        {"origin": "config", "retry": False, "error_type": "ValueError", "message": "bad path"}
    )
    g1 = charge(_d({}, 1), {"n1": other}, 100.0, POLICY)
    g2 = charge(d2.model_copy(update={"node_health": g1.health}), {"n2": cfg}, 110.0, POLICY)
    assert held(g2.job, 111.0) and excluded(g2.health, 111.0) == {"n1"}


def test_forgetting_records() -> None:
    ex = NodeHealth(failures=1, generation=2, exclusions=1, excluded_until=100.0, origin="config")
    streak = NodeHealth(failures=1, generation=2, origin="local")
    d = _d({"n1": ex, "n2": streak, "n3": ex}, 4)
    # away: n1 kept until 100 + max_exclude_s; n2's streak for POLICY.failures generations
    assert set(forget_gone(d, {"n3": object()}, 399.0, POLICY)) == {"n1", "n3"}
    assert set(forget_gone(d, {"n3": object()}, 400.0, POLICY)) == {"n3"}
    assert set(forget_gone(d.model_copy(update={"generation": 3}), {}, 400.0, POLICY)) == {"n2"}
    h, job, names = forget_config(d.node_health, NodeHealth(origin="config", failures=1))
    assert set(h) == {"n2"} and job == NodeHealth() and names == ["n1", "n3", "the job"]
    h, job, names = readmit(d.node_health, NodeHealth(failures=1), ["n2", "n7"], False)
    assert set(h) == {"n1", "n3"} and job.failures == 1 and names == ["n2"]
    h, job, names = readmit(d.node_health, NodeHealth(), [], True)
    assert h == {} and names == ["n1", "n2", "n3"]


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
