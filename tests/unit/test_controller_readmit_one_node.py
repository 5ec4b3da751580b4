"""A readmit of one node forgives that node, not the generation.

``sailor node readmit n1`` forgets n1's failure record; the failures n1 still reports in
the same generation must not count again, nor may the pass that applied it charge n1
for a teardown it holds up (``controller/failing_nodes.py``). Before, the forgiveness was
one number for the whole state (``DesiredState.forgiven_through``), so every other node
of that generation was forgiven too: one still running at the teardown deadline was
neither charged nor excluded (the next layout used it while its old workers might hold its
GPUs), and a failure or an unreadable checkpoint another node reported late in the
teardown was not counted. Now each readmitted node is recorded
(``DesiredState.forgiven_nodes``); ``readmit --all`` still forgives the generation.
"""

from __future__ import annotations

from sailor.controller.decide import decide
from sailor.controller.decision_types import ClearReadmit, SetDesired
from sailor.schemas.runtime import DesiredState, Phase, ReadmitRequest
from tests.unit.test_controller_decide import (
    CFG,
    NOW,
    _replanned,
    _sets,
    fails,
    nodes,
    obs,
    running,
    st,
)
from tests.unit.test_controller_suspect_checkpoint import _loading, _o, _unreadable, _up

ALL = nodes(1, 2, 3, 4)


def _torn_on_n1() -> DesiredState:
    """Generation 1 of n1 to n4 aborted on n1's own error (n2's ranks failed as its
    peers): n1 charged, the teardown under way."""
    d = running((1, 2, 3, 4))
    sts = [fails(1), fails(2, "peer"), st(3), st(4)]
    (torn,) = _sets(decide(d, obs(ALL, sts), CFG))
    assert torn.phase is Phase.TEARDOWN and set(torn.node_health) == {"n1"}
    assert set(torn.placement) == set(ALL)
    return torn


def _readmit(d: DesiredState, *names: str) -> dict[str, ReadmitRequest]:
    return {"r1": ReadmitRequest(nodes=names, who="ops", time=NOW)}


def test_a_node_still_running_at_the_teardown_deadline_is_charged_after_anothers_readmit() -> None:
    """n3 never acked its Abort (its workers still run) when the teardown's deadline
    passes, in the pass that applies ``readmit n1``: n3 is charged and excluded, and the
    teardown goes on without it; n1 stays readmitted. Before, n1's readmit forgave the
    generation: n3 was not charged, and the next layout was planned with it."""
    torn = _torn_on_n1().model_copy(update={"phase_deadline": NOW - 1})
    acked = frozenset(f"e7-g1-abort-n{i}" for i in (1, 2, 4))
    sts = [st(1, state="idle"), st(2, state="idle"), st(3), st(4, state="idle")]
    a = decide(torn, obs(ALL, sts, acked=acked, readmit=_readmit(torn, "n1")), CFG)
    assert [x for x in a if isinstance(x, ClearReadmit)] == [ClearReadmit("r1", "forgot n1")]
    states = _sets(a)
    last = states[-1]
    assert set(last.node_health) == {"n3"}, a
    assert "going on without n3" in [x for x in a if isinstance(x, SetDesired)][-1].reason
    rec = last.node_health["n3"]
    assert rec.cause.startswith("TeardownMissed") and rec.excluded_until > NOW
    # the next layout leaves n3 out (before: planned on n1 to n4)
    assert _replanned(decide(last, obs(ALL, sts, acked=acked), CFG)) == ["n1", "n2", "n4"]
    # n1 alone forgiven, for generation 1
    assert states[0].forgiven_nodes == {"n1": 1} and states[0].forgiven_through == -1


def test_a_failure_reported_late_by_another_node_counts_after_a_readmit() -> None:
    """After ``readmit n1``, n3's own error of the same generation comes in during the
    teardown: counted against n3. n1's error, still reported, is not counted again."""
    torn = _torn_on_n1()
    (readmitted,) = _sets(decide(torn, obs(ALL, [st(3), st(4)], readmit=_readmit(torn, "n1")), CFG))
    assert readmitted.node_health == {}
    ecc = fails(3, message="CUDA error: an illegal memory access")
    sts = [fails(1), fails(2, "peer"), ecc, st(4, state="idle")]
    (late,) = _sets(decide(readmitted, obs(ALL, sts), CFG))
    assert set(late.node_health) == {"n3"}, late.node_health
    assert (
        late.node_health["n3"].failures == 1
        and "illegal memory access" in late.node_health["n3"].cause
    )


def test_readmit_all_still_forgives_the_generation() -> None:
    """``readmit --all`` forgets every record: a failure reported late by a node without one
    is not counted either (the operator forgave the generation), as before."""
    torn = _torn_on_n1()
    req = {"r1": ReadmitRequest(all=True, who="ops", time=NOW)}
    (readmitted,) = _sets(decide(torn, obs(ALL, [st(3), st(4)], readmit=req), CFG))
    assert readmitted.forgiven_through == 1 and readmitted.forgiven_nodes == {"n1": 1}
    ecc = fails(3, message="CUDA error: an illegal memory access")
    sts = [fails(1), fails(2, "peer"), ecc, st(4, state="idle")]
    assert _sets(decide(readmitted, obs(ALL, sts), CFG)) == []


def test_an_unreadable_checkpoint_reported_late_by_another_node_is_charged_after_a_readmit() -> (
    None
):
    """Step 30 suspect after n1 failed to read it; ``readmit n1``; n2's reader error of the
    same generation comes in during the teardown: n2 is charged alike and the suspect
    extended (before: not charged, as if the operator had forgiven n2 too). n1 is not
    charged again."""
    d = _loading((1, 2, 3, 4))
    (torn,) = _sets(decide(d, _o([_unreadable(1), *_up((2, 3, 4), 1)]), CFG))
    (readmitted,) = _sets(decide(torn, _o(_up((2, 3, 4), 1), readmit=_readmit(torn, "n1")), CFG))
    assert readmitted.node_health == {} and readmitted.suspect_checkpoint.nodes == ("n1",)
    (more,) = _sets(decide(readmitted, _o([_unreadable(1), _unreadable(2), *_up((3, 4), 1)]), CFG))
    assert more.suspect_checkpoint.nodes == ("n1", "n2")
    assert set(more.node_health) == {"n2"}
    assert more.node_health["n2"].cause.startswith("CheckpointUnreadable: step 30")


def test_the_next_launch_drops_the_readmitted_nodes() -> None:
    """Whom a readmit forgave is the generation's: the next launch empties the record, and
    a state without one writes no version-6 field (``executor.write_desired``)."""
    torn = _torn_on_n1()
    (readmitted,) = _sets(decide(torn, obs(ALL, [st(3), st(4)], readmit=_readmit(torn, "n1")), CFG))
    assert readmitted.forgiven_nodes == {"n1": 1}
    idle = [st(i, state="idle") for i in (1, 2, 3, 4)]
    acked = frozenset(f"e7-g1-abort-n{i}" for i in (1, 2, 3, 4))
    planned = readmitted.model_copy(
        update={
            "next_plan": readmitted.plan,
            "next_placement": readmitted.placement,
            "next_membership": readmitted.membership,
        }
    )
    launched = [
        s
        for s in _sets(decide(planned, obs(ALL, idle, acked=acked), CFG))
        if s.phase is Phase.LAUNCH
    ]
    assert launched and launched[-1].generation == 2 and launched[-1].forgiven_nodes == {}


def test_a_readmitted_nodes_failure_does_not_make_a_later_one_the_jobs() -> None:
    """n1 of n1..n3 fails on its own and is charged; ``readmit n1``; n2 reports the same
    error late in the teardown (n1's status still says it). n2's failure is n2's: one of
    three placed nodes alike, not the job's. Before, n1's forgiven report still counted
    toward "failed alike" (2 of 3): the job was charged and n2 spared."""
    three = nodes(1, 2, 3)
    ecc = "CUDA error: an illegal memory access"
    d = running((1, 2, 3))
    (torn,) = _sets(decide(d, obs(three, [fails(1, message=ecc), st(2), st(3)]), CFG))
    assert set(torn.node_health) == {"n1"}
    (readmitted,) = _sets(
        decide(torn, obs(three, [st(2), st(3)], readmit=_readmit(torn, "n1")), CFG)
    )
    assert readmitted.node_health == {} and readmitted.forgiven_nodes == {"n1": 1}
    sts = [fails(1, message=ecc), fails(2, message=ecc), st(3, state="idle")]
    (late,) = _sets(decide(readmitted, obs(three, sts), CFG))
    assert late.job_health.generation != 1, late.job_health
    assert set(late.node_health) == {"n2"}, late.node_health
    assert "illegal memory access" in late.node_health["n2"].cause
