"""A peer's failure that names its guilty rank charges that rank's node, not the reporter's.

From the worker's record (``failure_record``: ``culprit``, the sender of bytes that do not
decode) through the agent's ``WorkerFailed`` event to the controller's charge
(``controller/culprits.py``, ``node_health.charge``); a culprit that is no rank of the layout
is ignored with a note naming it.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from pydantic import ValidationError, create_model

from sailor.comm.codec import PeerObjectError, decode
from sailor.controller.culprits import BLAMED, blame, rank_of
from sailor.controller.failure_text import parse_failure
from sailor.controller.node_health import ExclusionPolicy, charge, excluded
from sailor.megatron_patch.errors import (
    PeerFailedError,
    culprit_of,
    failure_record,
    signal_failure_record,
)
from sailor.schemas import SCHEMA_VERSION, _base
from sailor.schemas.events import EventAdapter, WorkerFailed
from sailor.schemas.runtime import DesiredState, NodeHealth

POLICY = ExclusionPolicy(failures=2, exclude_s=100, max_exclude_s=300)

# three nodes of two ranks each: rank 5 runs on n3
PLACEMENT = {"n1": (0, 1), "n2": (2, 3), "n3": (4, 5)}


def _garbage_from(rank: int) -> PeerObjectError:
    """The error a receiver raises on rank ``rank``'s bytes that do not decode."""
    try:
        decode(b"\x80 not json", rank)
    except PeerObjectError as exc:
        return exc
    raise AssertionError("garbage decoded")


def _status_text(exc: BaseException, rank: int = 0, traceback_chars: int = 0) -> str:
    """What the agent puts in ``AgentStatus.failure``: the record's first 2000 characters."""
    rec = failure_record(exc, rank=rank, step=7, in_training=True)
    rec["traceback"] = "x" * traceback_chars or rec["traceback"]
    return json.dumps(rec)[:2000]


def _forged(culprit: str) -> str:
    return '{"rank": 1, "step": 3, "origin": "peer", "retry": true, "culprit": ' + culprit + "}"


def _d(gen: int, health: dict[str, NodeHealth] | None = None) -> DesiredState:
    return DesiredState(epoch=1, generation=gen, placement=PLACEMENT, node_health=health or {})


def test_the_record_of_a_peers_bad_bytes_names_the_sender_right_after_retry() -> None:
    rec = failure_record(_garbage_from(5), rank=0, step=7, in_training=True)
    assert rec["origin"] == "peer" and rec["culprit"] == 5
    assert list(rec)[:5] == ["rank", "step", "origin", "retry", "culprit"]
    # cut after a long traceback, the agent's and the controller's readers still find it
    cut = _status_text(_garbage_from(5), traceback_chars=5000)
    assert len(cut) == 2000 and culprit_of(cut) == 5 and parse_failure(cut).culprit == "5"
    # a failure that names no guilty rank: no culprit (PeerFailedError's rank failed on its
    # own, or was preempted: its word is no evidence)
    for exc in (
        RuntimeError("Connection closed by peer"),
        PeerFailedError("rank 3 (h3) failed before its world's first step: OSError"),
        ValueError("bad seq_len"),
        PeerObjectError("a tag with keys ['a', 'b'] (exactly one expected)", rank=-1),
    ):
        rec = failure_record(exc, rank=0, step=7, in_training=False)
        assert "culprit" not in rec, exc
        assert culprit_of(json.dumps(rec)) == -1 and parse_failure(json.dumps(rec)).culprit == ""
    assert "culprit" not in signal_failure_record(0, -6, 12)


@pytest.mark.parametrize(
    ("text", "rank"),
    [
        (_forged("4"), 4),
        (_forged("-3"), -1),
        (_forged("99999999999"), -1),  # past a C int
        (_forged('"n3"'), -1),
        (_forged("4.5"), -1),
        (_forged("4e3"), -1),
        ('{"message": "rank 5 sent \\"culprit\\": 5"}', -1),  # inside a value: not the key
        ('rank 1 exit 1: "culprit": 5', -1),  # no record
        ("", -1),
    ],
    ids=[
        "rank",
        "negative",
        "huge",
        "string",
        "float",
        "exponent",
        "in-message",
        "no-record",
        "empty",
    ],
)
def test_the_agent_reads_only_a_rank_from_a_record(text: str, rank: int) -> None:
    assert culprit_of(text) == rank


@pytest.mark.parametrize(
    ("culprit", "ranks", "want"),
    [
        ("0", 6, 0),
        ("5", 6, 5),
        ("6", 6, None),
        ("-1", 6, None),
        ('"5"', 6, None),
        ("5.0", 6, None),
        ("9" * 40, 6, None),
        ("", 6, None),
    ],
    ids=["first", "last", "past-last", "negative", "quoted", "float", "many-digits", "empty"],
)
def test_a_culprit_is_a_rank_of_the_layout_or_none(culprit: str, ranks: int, want: int) -> None:
    assert rank_of(culprit, ranks) == want


def test_blame_maps_the_rank_to_its_node_once_and_ignores_forgeries() -> None:
    bad = _status_text(_garbage_from(5))
    causes = {n: parse_failure(t) for n, t in {"n1": bad, "n2": bad}.items()}
    b = blame(PLACEMENT, causes)
    assert set(b.causes) == {"n3"} and b.notes == []
    cause = b.causes["n3"]
    assert cause.origin == "local" and cause.retry and cause.own
    assert cause.summary.startswith(f"{BLAMED}: rank 5 named guilty by n1: PeerObjectError")
    # forged or corrupted: out of the layout, negative, no integer; each named in a note
    forged = {"n1": _forged("6"), "n2": _forged("-2"), "n3": _forged('"n1"')}
    b = blame(PLACEMENT, {n: parse_failure(t) for n, t in forged.items()})
    assert b.causes == {}
    assert b.notes == [
        "culprit '6' named by n1 ignored: not a rank of the layout (0..5)",
        "culprit '-2' named by n2 ignored: not a rank of the layout (0..5)",
        "culprit '\"n1\"' named by n3 ignored: not a rank of the layout (0..5)",
    ]
    # a record of the node's own failure charges that node, whatever culprit it names
    own = '{"origin": "local", "retry": true, "culprit": 5, "error_type": "X", "message": "m"}'
    assert blame(PLACEMENT, {"n1": parse_failure(own)}).causes == {}
    # the culprit's node reported its own failure: that one is counted, not the blame ...
    mine = json.dumps({"origin": "local", "retry": True, "error_type": "OSError", "message": "m"})
    causes = {"n1": parse_failure(bad), "n3": parse_failure(mine)}
    assert blame(PLACEMENT, causes).causes == {}
    # ... unless it is a SIGABRT (its watchdog, after its peers left): the blame is
    causes["n3"] = parse_failure(json.dumps(signal_failure_record(5, -6, 7)))
    assert set(blame(PLACEMENT, causes).causes) == {"n3"}


def test_the_culprits_node_is_charged_and_excluded_not_the_reporters() -> None:
    """Two honest nodes fail of the bytes rank 5 sends: before, both reports were ``peer``
    and nobody was charged, so n3 stayed in every next layout; now n3 is counted, and
    excluded at the policy's second failure, and n1 and n2 never are."""
    bad = _status_text(_garbage_from(5))
    c = charge(_d(4), {"n1": bad, "n2": bad}, 10.0, POLICY)
    assert set(c.health) == {"n3"} and c.job == NodeHealth()
    rec = c.health["n3"]
    assert (rec.failures, rec.generation, rec.origin) == (1, 4, "local")
    assert rec.cause.startswith(f"{BLAMED}: rank 5 named guilty by n1")
    assert any(n.startswith("counted against n3 (failure 1 in a row)") for n in c.notes), c.notes
    # a later pass of the same generation counts nothing again
    again = charge(_d(4, c.health), {"n1": bad, "n2": bad}, 11.0, POLICY)
    assert again.health == c.health
    c = charge(_d(5, c.health), {"n2": bad}, 20.0, POLICY)
    assert excluded(c.health, 21.0) == {"n3"}
    assert any(n.startswith("excluded n3 until") and "rank 5" in n for n in c.notes), c.notes


def test_a_forged_culprit_charges_nobody_and_is_named() -> None:
    c = charge(_d(4), {"n1": _forged("77"), "n2": _forged("-1")}, 10.0, POLICY)
    assert c.health == {} and c.job == NodeHealth()
    assert c.notes == [
        "culprit '77' named by n1 ignored: not a rank of the layout (0..5)",
        "culprit '-1' named by n2 ignored: not a rank of the layout (0..5)",
    ]


def test_two_blamed_nodes_are_not_a_failure_of_the_job() -> None:
    """Blames are about their nodes' processes: two of them (most of a 3-node layout) do
    not make the failure "alike", the job's."""
    placement = {"n1": (0,), "n2": (1,), "n3": (2,)}
    d = DesiredState(epoch=1, generation=2, placement=placement)
    failures = {"n1": _status_text(_garbage_from(1)), "n2": _status_text(_garbage_from(0))}
    c = charge(d, failures, 10.0, POLICY)
    assert set(c.health) == {"n1", "n2"} and c.job == NodeHealth()


def test_the_worker_failed_event_carries_the_culprit_in_wire_version_10(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``WorkerFailed.culprit`` came with version 10: -1 by default (a release-9 agent's
    event), refused below -1 naming the field; a release-9 controller drops it and refuses
    it at its own version."""
    assert SCHEMA_VERSION >= 10
    base = {"event_id": "e1", "node_id": "n1", "time": 1.0}
    assert WorkerFailed(**base).culprit == -1
    msg = WorkerFailed(**base, culprit=5, cause=_status_text(_garbage_from(5)))
    raw = msg.model_dump_json()
    assert EventAdapter.validate_json(raw) == msg
    with pytest.raises(ValidationError, match="culprit"):
        WorkerFailed(**base, culprit=-2)
    kept = {
        name: (f.annotation, f)
        for name, f in WorkerFailed.model_fields.items()
        if name not in ("culprit", "schema_version")
    }
    previous = create_model("WorkerFailed", __base__=_base.WireMessage, **kept)  # type: ignore[call-overload]
    monkeypatch.setattr(_base, "SCHEMA_VERSION", 9)
    old = previous.model_validate_json(raw)
    assert "culprit" not in type(old).model_fields and old.cause == msg.cause  # type: ignore[attr-defined]
    with pytest.raises(ValidationError, match="culprit"):
        previous.model_validate_json(json.dumps(json.loads(raw) | {"schema_version": 9}))


def test_the_agents_failure_event_carries_the_culprit_its_workers_record_names(
    tmp_path: Path,
) -> None:
    from sailor.agent.agent_config import AgentConfig
    from sailor.agent.daemon import Agent
    from sailor.schemas.hardware import NodeSpec

    node = NodeSpec(node_id="n1", gpu_type="cpu", gpus=1, zone="z")
    agent = Agent(AgentConfig(node=node, work_dir=tmp_path))
    agent.supervisor.failure = _status_text(_garbage_from(5), traceback_chars=5000)
    event = agent._failure_event(agent.status())
    assert event.culprit == 5 and event.node_id == "n1" and event.cause.startswith('{"rank"')
    assert EventAdapter.validate_json(event.model_dump_json()) == event
    # a forged record: no rank, the event still goes out
    agent.supervisor.failure = _forged("-7")
    assert agent._failure_event(agent.status()).culprit == -1


def test_a_held_world_broken_by_a_peers_bytes_names_the_sender_to_the_agent(
    tmp_path: Path,
) -> None:
    """An in-place rank holds (no error file) when a peer's bytes break its world: its held
    line names the sender, the agent's status and event carry it; a held line's value that
    is no rank is -1, and never stops the agent."""
    from sailor.agent.agent_config import AgentConfig
    from sailor.agent.daemon import Agent
    from sailor.agent.worker_view import WorkerView
    from sailor.megatron_patch.in_place import Held
    from sailor.megatron_patch.in_place_steps import held_line
    from sailor.schemas.hardware import NodeSpec

    cause = "PeerObjectError: rank 5 sent an object that does not decode"
    line = held_line(Held(None, 0, 7, 56, True, 3, cause, 5))
    assert line == {
        "event": "held",
        "rank": 0,
        "step": 7,
        "broken": True,
        "cause": cause,
        "culprit": 5,
    }
    assert "culprit" not in held_line(Held(None, 0, 7, 56, True, 3, "gloo: timeout"))

    node = NodeSpec(node_id="n1", gpu_type="cpu", gpus=1, zone="z")
    agent = Agent(AgentConfig(node=node, work_dir=tmp_path))
    w = WorkerView(rank=0, proc=None, argv=())  # type: ignore[arg-type]
    agent.supervisor.workers = [w]
    for culprit, want in ((5, 5), (-4, -1), (True, -1), ("5", -1), (2**40, -1)):
        asyncio.run(agent.supervisor._on_line(w, {**line, "culprit": culprit}))
        st = agent.status()
        assert (st.state, st.failure, st.culprit) == ("held", cause, want), culprit
        assert agent._failure_event(st).culprit == want
