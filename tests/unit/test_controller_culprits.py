"""A peer's failure that names its guilty rank charges that rank's node, not the reporter's,
once reporters on two other nodes name it; one alone charges both (a dispute).

From the worker's record (``failure_record``: ``culprit``, the sender of bytes that do not
decode) through the agent's ``WorkerFailed`` event to the controller's charge
(``controller/culprits.py``, ``node_health.charge``); a culprit that is no rank of the layout
is ignored with a note naming it; a hostile reporter cannot get an honest node excluded
before itself.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from pydantic import ValidationError, create_model

from sailor.comm.codec import PeerObjectError, decode
from sailor.controller.culprits import BLAMED, DISPUTED, blame, rank_of
from sailor.controller.failing_nodes import charge_abort, health_update
from sailor.controller.failure_text import parse_failure
from sailor.controller.node_health import Charged, ExclusionPolicy, charge, excluded
from sailor.megatron_patch.errors import (
    PeerFailedError,
    culprit_of,
    failure_record,
    signal_failure_record,
)
from sailor.schemas import SCHEMA_VERSION, _base
from sailor.schemas.events import EventAdapter, WorkerFailed
from sailor.schemas.runtime import Accusations, AgentStatus, DesiredState, NodeHealth, Phase

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


def _failure(culprit: int | str = "", origin: str = "peer", traceback_chars: int = 0) -> str:
    """What the agent puts in ``AgentStatus.failure``: a record's first 2000 characters.

    An ``int`` culprit: the record a receiver writes on that rank's bytes that do not
    decode (``failure_record`` of the real error; its traceback replaced by
    ``traceback_chars`` characters when given). Else a record written by hand, of
    ``origin``, naming ``culprit`` as raw JSON text (a forged or corrupted value; '':
    none)."""
    if isinstance(culprit, int):
        rec = failure_record(_garbage_from(culprit), rank=0, step=7, in_training=True)
        rec["traceback"] = "x" * traceback_chars or rec["traceback"]
        return json.dumps(rec)[:2000]
    named = f', "culprit": {culprit}' if culprit else ""
    return (
        f'{{"rank": 1, "step": 3, "origin": "{origin}", "retry": true{named}, "error_type": "X"}}'
    )


def _d(gen: int, health: dict[str, NodeHealth] | None = None) -> DesiredState:
    return DesiredState(epoch=1, generation=gen, placement=PLACEMENT, node_health=health or {})


def test_the_record_of_a_peers_bad_bytes_names_the_sender_right_after_retry() -> None:
    rec = failure_record(_garbage_from(5), rank=0, step=7, in_training=True)
    assert rec["origin"] == "peer" and rec["culprit"] == 5
    assert list(rec)[:5] == ["rank", "step", "origin", "retry", "culprit"]
    # cut after a long traceback, the agent's and the controller's readers still find it
    cut = _failure(5, traceback_chars=5000)
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
        (_failure("4"), 4),
        (_failure("-3"), -1),
        (_failure("99999999999"), -1),  # past a C int
        (_failure('"n3"'), -1),
        (_failure("4.5"), -1),
        (_failure("4e3"), -1),
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
    bad = _failure(5)
    causes = {n: parse_failure(t) for n, t in {"n1": bad, "n2": bad}.items()}
    b = blame(PLACEMENT, causes)
    assert set(b.causes) == {"n3"} and b.notes == []
    cause = b.causes["n3"]
    assert cause.origin == "local" and cause.retry and cause.own
    assert cause.summary.startswith(f"{BLAMED}: rank 5 named guilty by n1: PeerObjectError")
    # forged or corrupted: out of the layout, negative, no integer; each named in a note
    forged = {"n1": _failure("6"), "n2": _failure("-2"), "n3": _failure('"n1"')}
    b = blame(PLACEMENT, {n: parse_failure(t) for n, t in forged.items()})
    assert b.causes == {}
    assert b.notes == [
        "culprit '6' named by n1 ignored: not a rank of the layout (0..5)",
        "culprit '-2' named by n2 ignored: not a rank of the layout (0..5)",
        "culprit '\"n1\"' named by n3 ignored: not a rank of the layout (0..5)",
    ]
    # a record of the node's own failure charges that node, whatever culprit it names
    own = _failure("5", origin="local")
    assert blame(PLACEMENT, {"n1": parse_failure(own)}).causes == {}
    # the culprit's node reported its own failure: that one is counted, not the blame ...
    mine = _failure(origin="local")
    causes = {"n1": parse_failure(bad), "n3": parse_failure(mine)}
    assert blame(PLACEMENT, causes).causes == {}
    # ... unless it is a SIGABRT (its watchdog, after its peers left): the blame is (two
    # reporters: one alone is a dispute, below)
    causes["n3"] = parse_failure(json.dumps(signal_failure_record(5, -6, 7)))
    causes["n2"] = parse_failure(bad)
    assert set(blame(PLACEMENT, causes).causes) == {"n3"}


def test_the_culprits_node_is_charged_and_excluded_not_the_reporters() -> None:
    """Two honest nodes fail of the bytes rank 5 sends: before, both reports were ``peer``
    and nobody was charged, so n3 stayed in every next layout; now n3 is counted, and
    excluded at the policy's second failure, and n1 and n2 never are."""
    bad = _failure(5)
    c = charge(_d(4), {"n1": bad, "n2": bad}, 10.0, POLICY)
    assert set(c.health) == {"n3"} and c.job == NodeHealth()
    rec = c.health["n3"]
    assert (rec.failures, rec.generation, rec.origin) == (1, 4, "local")
    assert rec.cause.startswith(f"{BLAMED}: rank 5 named guilty by n1")
    assert any(n.startswith("counted against n3 (failure 1 in a row)") for n in c.notes), c.notes
    # a later pass of the same generation counts nothing again
    again = charge(_d(4, c.health), {"n1": bad, "n2": bad}, 11.0, POLICY)
    assert again.health == c.health
    c = charge(_d(5, c.health), {"n1": bad, "n2": bad}, 20.0, POLICY)
    assert excluded(c.health, 21.0) == {"n3"} and set(c.health) == {"n3"}
    assert any(n.startswith("excluded n3 until") and "rank 5" in n for n in c.notes), c.notes


def _pass(d: DesiredState, failures: dict[str, str], now: float) -> tuple[DesiredState, Charged]:
    """``d`` once a ``decide`` pass counted ``failures`` (node -> failure text), as the
    abort and each TEARDOWN pass write it back, and what the charge said."""
    c = charge(d, failures, now, POLICY)
    return d.model_copy(update=health_update(c)), c


def test_a_lone_accusation_charges_the_accuser_as_much_as_the_accused() -> None:
    """One node names rank 5 (n3) and no other does: nothing tells an honest receiver of
    garbage from a liar, so both are charged, each once (before: n3 alone, on n1's word)."""
    b = blame(PLACEMENT, {"n1": parse_failure(_failure(5))})
    assert set(b.causes) == {"n1", "n3"} and b.notes == [] and b.named == {"n1": "n3"}
    assert b.causes["n3"].summary.startswith(
        f"{BLAMED}: rank 5 named guilty by n1 alone (n1 charged too, uncorroborated): "
    )
    assert b.causes["n1"].summary.startswith(
        f"{DISPUTED}: named rank 5 of n3 guilty, no other node corroborates it: PeerObjectError"
    )
    d, c = _pass(_d(4), {"n1": _failure(5)}, 10.0)
    assert {n: r.failures for n, r in d.node_health.items()} == {"n1": 1, "n3": 1}
    assert d.accusations == Accusations(generation=4, named={"n1": "n3"})
    assert any(n.startswith("counted against n1 (failure 1 in a row): Blame") for n in c.notes)
    # the accused's SIGABRT bears nothing out (its watchdog fires once its peers left)
    sigabrt = parse_failure(json.dumps(signal_failure_record(5, -6, 7)))
    b = blame(PLACEMENT, {"n1": parse_failure(_failure(5)), "n3": sigabrt})
    assert set(b.causes) == {"n1", "n3"}
    # a node naming a rank of its own is charged once, as the accused
    b = blame(PLACEMENT, {"n3": parse_failure(_failure(4))})
    assert set(b.causes) == {"n3"} and b.causes["n3"].summary.startswith(BLAMED)


@pytest.mark.parametrize(
    "victims", [("n3",), ("n2", "n3")], ids=["one-victim", "a-new-victim-each-generation"]
)
def test_a_hostile_reporter_cannot_get_an_honest_node_excluded_before_itself(
    victims: tuple[str, ...],
) -> None:
    """n1 ends every generation with a record naming an honest rank (of one node, or of
    each in turn). Before, the named node was counted each generation and excluded at the
    policy's second, n1 never; now n1 is counted whenever its victim is, and is excluded
    no later than any victim."""
    first_rank = {n: ranks[0] for n, ranks in PLACEMENT.items()}
    health: dict[str, NodeHealth] = {}
    now = 0.0
    for gen in range(1, 7):
        now = gen * 10.0
        victim = victims[gen % len(victims)]
        d, _ = _pass(_d(gen, health), {"n1": _failure(first_rank[victim])}, now)
        health = dict(d.node_health)
        out = excluded(health, now + 1)
        assert "n1" in health and health["n1"].generation == gen, (gen, health)
        for n in victims:
            if n in health:
                assert health[n].failures <= health["n1"].failures, (gen, health)
                assert health[n].exclusions <= health["n1"].exclusions, (gen, health)
            assert n not in out or "n1" in out, (gen, out)
        assert set(health) <= {"n1", *victims}, health  # nobody else is charged
    assert "n1" in excluded(health, now + 1)


def test_two_reporters_on_distinct_nodes_charge_the_sender_alone_in_one_pass() -> None:
    """The honest case: every receiver of rank 5's garbage reports it."""
    d, _ = _pass(_d(4), {"n1": _failure(5), "n2": _failure(5)}, 10.0)
    assert set(d.node_health) == {"n3"} and d.node_health["n3"].failures == 1
    assert d.accusations.named == {"n1": "n3", "n2": "n3"}


def test_a_second_report_in_a_later_pass_takes_the_lone_accusers_charge_back() -> None:
    """The abort comes at n1's report alone (a dispute: n1 and n3 counted); the Abort
    clears n1's status, and n2's report of the same garbage comes in at a TEARDOWN pass:
    the accusation is borne out, n1's count (and the exclusion it set) is taken back, n3's
    stays. Before, the first pass counted n3 alone on n1's word."""
    streak = NodeHealth(failures=1, generation=3, cause="X: earlier", origin="local")
    d, _ = _pass(_d(4, {"n1": streak}), {"n1": _failure(5)}, 10.0)
    assert d.node_health["n1"].excluded_until > 10.0  # its second failure in a row
    assert set(d.node_health) == {"n1", "n3"}
    d, c = _pass(d, {"n2": _failure(5)}, 11.0)
    assert set(d.node_health) == {"n1", "n3"} and d.node_health["n3"].failures == 1
    assert d.node_health["n1"].failures == 1 and d.node_health["n1"].excluded_until == 0
    assert d.node_health["n1"].generation == -1  # not counted again for generation 4
    assert "taken back from n1: its accusation of n3 is borne out" in c.notes, c.notes
    assert d.accusations.named == {"n1": "n3", "n2": "n3"}
    # a later pass with the same reports changes nothing
    again, _ = _pass(d, {"n1": _failure(5), "n2": _failure(5)}, 12.0)
    assert again == d
    # the accused's own failure, reported later, bears a lone accusation out too
    d, _ = _pass(_d(4), {"n1": _failure(5)}, 10.0)
    d, c = _pass(d, {"n3": _failure(origin="local")}, 11.0)
    assert set(d.node_health) == {"n3"}, d.node_health
    # the next generation weighs its own accusations only
    d, _ = _pass(
        _d(5, d.node_health).model_copy(update={"accusations": d.accusations}),
        {"n2": _failure(5)},
        20.0,
    )
    assert set(d.node_health) == {"n2", "n3"} and d.accusations.named == {"n2": "n3"}


def test_a_reporter_accuses_once_a_generation_and_a_forgiven_ones_dispute_charges_nobody() -> None:
    """A hostile node whose status names another rank at each pass would otherwise buy a
    charge on every node with one count of its own."""
    d, _ = _pass(_d(4), {"n1": _failure(5)}, 10.0)
    d, c = _pass(d, {"n1": _failure(2)}, 11.0)
    assert set(d.node_health) == {"n1", "n3"}
    assert "culprit 2 (n2) named by n1 ignored: it named a rank of n3 earlier" in c.notes[0]
    # readmitted by an operator: n1 cannot be charged, so neither is the node it names
    forgiven = _d(4).model_copy(update={"forgiven_nodes": {"n1": 4}})
    d, c = _pass(forgiven, {"n1": _failure(5)}, 10.0)
    assert d.node_health == {} and d.accusations.named == {"n1": "n3"}
    assert c.notes == [
        "rank 5 (n3) named guilty by n1 alone charges nobody: n1's failures of the "
        "generation are forgiven"
    ]
    # ... and still counts towards corroboration
    d, _ = _pass(d, {"n2": _failure(5)}, 11.0)
    assert set(d.node_health) == {"n3"}


def test_in_a_two_node_layout_an_honest_garbage_sender_is_excluded_with_its_one_reporter() -> None:
    """One possible reporter: every accusation is a dispute, the two are counted together
    and excluded at the same generation (the sender is not tolerated for ever; nothing
    tells it from its accuser)."""
    placement = {"a": (0,), "b": (1,)}
    health: dict[str, NodeHealth] = {}
    for gen in (1, 2):
        d = DesiredState(epoch=1, generation=gen, placement=placement, node_health=health)
        d, _ = _pass(d, {"a": _failure(1)}, gen * 10.0)
        health = dict(d.node_health)
    assert excluded(health, 21.0) == {"a", "b"}


def test_a_culprit_named_by_an_older_generations_record_is_not_weighed() -> None:
    """At a LAUNCH abort a placed node still reporting an older generation's failure counts
    (its agent did not start this one), but a culprit its record names is a rank of that
    generation's layout: before, it was mapped through this one's placement and charged
    n3, which ran no such rank then."""
    d = _d(3).model_copy(update={"phase": Phase.LAUNCH})
    status = {
        n: AgentStatus(node_id=n, generation=2, state="failed", failure=_failure(5))
        for n in ("n1", "n2")
    }
    c = charge_abort(d, status, 10.0, POLICY)
    assert c.health == {} and c.accusations is None
    assert c.notes == [
        f"culprit '5' named by {n} ignored: its failure is of an older generation, whose "
        "ranks are another layout's"
        for n in ("n1", "n2")
    ]
    # this generation's records are weighed, as always
    status = {n: st.model_copy(update={"generation": 3}) for n, st in status.items()}
    assert set(charge_abort(d, status, 10.0, POLICY).health) == {"n3"}


def test_a_forged_culprit_charges_nobody_and_is_named() -> None:
    c = charge(_d(4), {"n1": _failure("77"), "n2": _failure("-1")}, 10.0, POLICY)
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
    failures = {"n1": _failure(1), "n2": _failure(0)}
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
    msg = WorkerFailed(**base, culprit=5, cause=_failure(5))
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
    agent.supervisor.failure = _failure(5, traceback_chars=5000)
    event = agent._failure_event(agent.status())
    assert event.culprit == 5 and event.node_id == "n1" and event.cause.startswith('{"rank"')
    assert EventAdapter.validate_json(event.model_dump_json()) == event
    # a forged record: no rank, the event still goes out
    agent.supervisor.failure = _failure("-7")
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
