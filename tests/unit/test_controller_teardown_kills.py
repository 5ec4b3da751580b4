"""TEARDOWN reads a node's kill from its status, not from its Abort's ack.

An agent acks an Abort once the signals are sent (``agent_commands``): the kill, up to the
grace period plus the teardown bound (~123 s) for a rank in the GPU driver's teardown, goes
on, and the status says so (``AgentStatus.killing``: the worker process groups still being
killed). Before, the ack meant "the kill is over": a node whose Abort was acked was done.
Now a node killing workers is busy whatever its state (an in-place node's held workers
stay ``held`` while the others are killed), no launch waits on it past the deadline
unnoticed, and one still killing at the deadline is charged as one that never acked.
"""

from __future__ import annotations

from dataclasses import replace

from sailor.controller.decide import decide
from sailor.schemas.runtime import AgentStatus, NoticeRecord, Phase
from tests.unit.test_controller_decide import (
    CFG,
    IN_PLACE,
    NOW,
    _planned,
    kinds,
    nodes,
    obs,
    running,
    st,
)


def _killing(s: AgentStatus, groups: int) -> AgentStatus:
    return s.model_copy(update={"killing": groups})


def test_a_node_killing_workers_holds_up_the_restart_launch_though_it_acked() -> None:
    """n2 acked its Abort and reports idle (its generation's workers are gone) while a
    kill of its goes on (leftovers of an in-place launch, say): the launch waits for it.
    Before, an idle node was done, and the Launch met a node whose killed rank still held
    its GPU."""
    d = _planned(running((1, 2), phase=Phase.TEARDOWN, phase_deadline=NOW + 60), (1, 2))
    acked = frozenset({"e7-g1-abort-n2"})
    sts = [st(1, state="idle"), _killing(st(2, state="idle"), 1)]
    assert kinds(decide(d, obs(nodes(1, 2), sts, acked=acked), CFG)) == []
    sts = [st(1, state="idle"), st(2, state="idle")]  # its kill is over
    assert kinds(decide(d, obs(nodes(1, 2), sts, acked=acked), CFG)) == ["set:launch"]


def test_an_in_place_node_killing_the_workers_that_did_not_hold_is_waited_for() -> None:
    """Its held workers report ``held`` while those that did not hold are killed: no
    in-place launch before the kill is over (it would be refused, then charged at the
    LAUNCH deadline, 20 s, shorter than the kill may take)."""
    d = _planned(running((1, 2, 3), phase=Phase.TEARDOWN, load_step=12), (1, 2))
    ns = nodes(1, 2, 3)
    gone = {"n3": NoticeRecord(node_id="n3", deadline=NOW + 30)}
    acked = frozenset({"e7-g1-hold-n2"})
    sts = [st(1, state="held"), _killing(st(2, state="held"), 2), st(3, state="held")]
    a = decide(d, obs(ns, sts, notices=gone, acked=acked), IN_PLACE)
    assert "set:launch" not in kinds(a), a
    sts[1] = st(2, state="held")
    a = decide(d, obs(ns, sts, notices=gone, acked=acked), IN_PLACE)
    assert kinds(a)[-1] == "set:launch"


def test_a_node_still_killing_at_the_teardown_deadline_is_charged_though_it_acked() -> None:
    """Its agent's kill outlasts the controller's deadline (its ``teardown_timeout_s`` set
    above ``deadlines.teardown``): charged and excluded as a node that never acked (its
    workers may hold its GPUs), and the teardown goes on without it. One that acked and
    killing nothing any more (its status lags) is not."""
    d = _planned(running((1, 2), phase=Phase.TEARDOWN, phase_deadline=NOW + 20), (1, 2))
    acked = frozenset({"e7-g1-abort-n2"})
    late = replace(
        obs(nodes(1, 2), [st(1, state="idle"), _killing(st(2, state="stopped"), 1)], acked=acked),
        now=NOW + 21,
    )
    a = decide(d, late, CFG)
    assert kinds(a) == ["set:teardown"], a
    reason = a[-1].reason  # type: ignore[union-attr]
    assert "going on without n2" in reason and "its Abort acked" in reason, reason
    assert "1 worker process group(s) still being killed" in reason, reason
    rec = a[-1].state.node_health["n2"]  # type: ignore[union-attr]
    assert rec.excluded_until == NOW + 21 + 600 and rec.cause.startswith("TeardownMissed")

    lagging = replace(late, status={**late.status, "n2": st(2, state="stopped")})
    assert kinds(decide(d, lagging, CFG)) == ["set:launch"]


def test_a_node_readmitted_while_it_kills_past_the_teardown_deadline_stays_readmitted() -> None:
    """``sailor node readmit n2`` while n2 still kills workers past the teardown deadline:
    the pass that applied it (the request deleted: the command reported n2 readmitted)
    charged and excluded n2 again at once, the very record it had forgotten. Now the
    generation's records are forgiven for its teardown too (``forgiven_through``, as for
    its failures): n2 stays readmitted and the teardown goes on."""
    from sailor.controller.decision_types import ClearReadmit, SetDesired
    from sailor.schemas.runtime import ReadmitRequest

    torn = running((1, 2, 3), phase=Phase.TEARDOWN, aborted=True, load_step=-1)
    torn = torn.model_copy(update={"phase_deadline": NOW - 1, "phase_epoch": 7})
    acked = frozenset(f"e7-g1-abort-n{i}" for i in (1, 2, 3))
    statuses = [st(1, state="idle"), _killing(st(2, state="stopped"), 1), st(3, state="idle")]
    o = obs(nodes(1, 2, 3), statuses, acked=acked)
    (charged,) = decide(torn, o, CFG)
    assert isinstance(charged, SetDesired) and "n2" in charged.state.node_health
    req = ReadmitRequest(nodes=("n2",), who="ops", time=NOW)
    a = decide(charged.state, replace(o, readmit={"r1": req}), CFG)
    assert [x for x in a if isinstance(x, ClearReadmit)] == [ClearReadmit("r1", "forgot n2")]
    states = [x.state for x in a if isinstance(x, SetDesired)]
    assert states and all("n2" not in s.node_health for s in states), a
    assert not any("going on without n2" in getattr(x, "reason", "") for x in a)
