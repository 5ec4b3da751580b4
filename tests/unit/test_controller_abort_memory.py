"""What a TEARDOWN remembers of its abort across passes and leaders: the placed nodes the
generation lost (``DesiredState.lost_nodes``, not parsed back from a shortened cause) and
the SIGABRTs its nodes reported (``DesiredState.sigabrt_reports``: an Abort clears a
report, and a hang whose reports came in over two passes was under the threshold in
each). Each test failed on the code before the fields, but the one that says it is a
regression guard."""

from __future__ import annotations

from sailor.controller.decide import decide
from sailor.controller.decision_types import Action, SetDesired
from sailor.controller.failing_nodes import LOST_WITHOUT_NOTICE, lost_nodes, upgraded
from sailor.controller.node_health import charge
from sailor.schemas import SCHEMA_VERSION
from sailor.schemas.runtime import CAUSE_MAX, DesiredState, NodeHealth, Phase, SigabrtReports
from tests.unit.test_controller_decide import CFG, _sigabrt, nodes, obs, running, st

IDS = (1, 2, 3, 4)


def _states(actions: list[Action]) -> list[DesiredState]:
    return [a.state for a in actions if isinstance(a, SetDesired)]


def _torn(d: DesiredState, statuses: list[object], ids: tuple[int, ...] = IDS) -> DesiredState:
    (done,) = _states(decide(d, obs(nodes(*ids), statuses), CFG))  # type: ignore[arg-type]
    assert done.phase is Phase.TEARDOWN and done.aborted
    return done


def _as_read(d: DesiredState) -> DesiredState:
    """``d`` as a leader reads it back from etcd (the cause shortened to ``CAUSE_MAX``)."""
    return DesiredState.model_validate_json(d.model_dump_json())


# ---- the abort's lost nodes are a field, not the cause's text ----


def test_a_zones_outage_records_every_lost_node_past_the_causes_cut() -> None:
    """300 placed nodes, 250 of them gone at once: the abort's cause names them all, and is
    shortened to its head on the way to etcd, so a leader that read it back knew only the
    first ~200. The record keeps every one, also once they are back."""
    ids = tuple(range(1, 301))
    d = running(IDS).model_copy(update={"placement": {f"n{i}": (i - 1,) for i in ids}})
    alive = ids[250:]
    torn = _torn(d, [st(i) for i in alive], ids=alive)
    gone = {f"n{i}" for i in ids[:250]}
    assert set(torn.lost_nodes) == gone
    read = _as_read(torn)
    assert len(read.cause) <= CAUSE_MAX and read.cause.startswith(LOST_WITHOUT_NOTICE)
    assert not all(n in read.cause for n in gone)  # the cause lost some names
    assert lost_nodes(read, nodes(*ids), ()) == gone  # every node back: still known lost


def test_the_peers_sigabrts_of_a_lost_node_back_by_now_are_no_hang() -> None:
    """n4 vanished, n1-n3 report SIGABRTs in the TEARDOWN; n4's lease is back. A new leader
    took over the state (its cause replaced by nothing that names n4): the record says n4
    was lost, so nobody is charged."""
    torn = _torn(running(IDS), [st(1), st(2), st(3)], ids=(1, 2, 3))
    assert torn.lost_nodes == ("n4",)
    taken = _as_read(torn).model_copy(update={"cause": "aborted"})
    back = obs(nodes(*IDS), [_sigabrt(1), _sigabrt(2), _sigabrt(3), st(4, state="idle")])
    states = _states(decide(taken, back, CFG))
    assert states  # the SIGABRTs are recorded, and counted against nobody
    assert states[-1].sigabrt_reports.nodes == ("n1", "n2", "n3")
    for s in states:
        assert s.job_health == NodeHealth() and s.node_health == {}


def test_an_older_leaders_cause_is_still_parsed_and_recorded_on_takeover() -> None:
    """A state of a leader before wire version 4 names its lost nodes in the cause only:
    read as before, and recorded when a leader of this release takes it over. A state of
    this version is never parsed (its cause is for people)."""
    torn = _torn(running(IDS), [st(1), st(2), st(3)], ids=(1, 2, 3))
    old = torn.model_copy(update={"lost_nodes": (), "schema_version": 3})
    assert lost_nodes(old, nodes(*IDS), ()) == {"n4"}
    new = upgraded(old)
    assert new.lost_nodes == ("n4",) and new.schema_version == SCHEMA_VERSION
    assert lost_nodes(new.model_copy(update={"cause": ""}), nodes(*IDS), ()) == {"n4"}
    mute = torn.model_copy(update={"lost_nodes": ()})
    assert lost_nodes(mute, nodes(*IDS), ()) == frozenset()


def test_an_older_leaders_launch_after_an_abort_records_no_lost_node() -> None:
    """A version-3 state in LAUNCH still has ``aborted`` and the cause of the abort before
    it: its lost nodes are not the new generation's (before, a takeover recorded them, and
    the new generation's SIGABRTs after them were taken for no hang)."""
    torn = _torn(running(IDS), [st(1), st(2), st(3)], ids=(1, 2, 3))
    old = torn.model_copy(update={"lost_nodes": (), "schema_version": 3, "phase": Phase.LAUNCH})
    assert old.aborted and old.cause.startswith(LOST_WITHOUT_NOTICE)
    new = upgraded(old)
    assert new.lost_nodes == () and new.schema_version == SCHEMA_VERSION


def test_the_next_launch_forgets_the_aborts_memory() -> None:
    torn = _torn(running(IDS), [_sigabrt(1), st(2), st(3)], ids=(1, 2, 3))
    assert torn.lost_nodes == ("n4",) and torn.sigabrt_reports.nodes == ("n1",)
    ready = torn.model_copy(
        update={
            "next_plan": torn.plan,
            "next_placement": dict(torn.placement),
            "next_membership": torn.membership,
        }
    )
    idle = obs(nodes(*IDS), [st(i, state="idle") for i in IDS])
    (launch,) = [s for s in _states(decide(ready, idle, CFG)) if s.phase is Phase.LAUNCH]
    assert launch.lost_nodes == () and launch.sigabrt_reports == SigabrtReports()


# ---- a generation's SIGABRTs count across the abort's passes ----


def test_a_hang_whose_sigabrts_arrive_over_two_passes_is_charged_to_the_job() -> None:
    """n1 and n2's watchdogs fired first: 2 of 4, not more than half, the abort charges
    nobody. Their Aborts clear their reports; n3's SIGABRT comes in the next pass. 3 of 4
    placed nodes reported only SIGABRTs: a hang of the job (before, each pass saw too few)."""
    torn = _torn(running(IDS), [_sigabrt(1), _sigabrt(2), st(3), st(4)])
    assert torn.job_health == NodeHealth()
    assert torn.sigabrt_reports == SigabrtReports(
        generation=1, nodes=("n1", "n2"), cause=torn.sigabrt_reports.cause
    )
    later = [st(1, state="idle"), st(2, state="idle"), _sigabrt(3), st(4)]
    (after,) = _states(decide(_as_read(torn), obs(nodes(*IDS), later), CFG))
    assert after.sigabrt_reports.nodes == ("n1", "n2", "n3")
    assert after.job_health.failures == 1 and after.job_health.generation == 1
    assert after.node_health == {}
    # counted once: the next pass changes nothing
    assert _states(decide(after, obs(nodes(*IDS), later), CFG)) == []


def test_one_nodes_sigabrts_over_several_passes_are_no_hang() -> None:
    """Only n1 ever reports a SIGABRT, pass after pass: one node, never the job's. A
    regression guard, not a fix: the code before the memory forgot each pass's reports and
    got this right; a memory that added up reports rather than nodes would make it a hang."""
    torn = _torn(running(IDS), [_sigabrt(1), st(2), st(3), st(4)])
    assert torn.sigabrt_reports.nodes == ("n1",) and torn.job_health == NodeHealth()
    again = [_sigabrt(1), st(2, state="idle"), st(3, state="idle"), st(4)]
    for _ in range(3):  # the same report, pass after pass: nothing to write
        assert _states(decide(torn, obs(nodes(*IDS), again), CFG)) == []


def test_a_new_sigabrt_counted_against_nobody_is_kept_for_the_later_passes() -> None:
    """A SIGABRT reported after the abort that charges nobody yet is written all the same
    (the pass after may not see it), once."""
    torn = _torn(running(IDS), [_sigabrt(1), st(2), st(3), st(4)])
    later = [st(1, state="idle"), _sigabrt(2), st(3), st(4)]
    (kept,) = _states(decide(torn, obs(nodes(*IDS), later), CFG))
    assert kept.sigabrt_reports.nodes == ("n1", "n2") and kept.job_health == NodeHealth()
    assert _states(decide(kept, obs(nodes(*IDS), later), CFG)) == []


def test_an_older_generations_reports_are_not_counted() -> None:
    """Reports of generation 1 in a state of generation 2 (none of its own): ignored."""
    old = SigabrtReports(generation=1, nodes=("n1", "n2"), cause="Signal: SIGABRT")
    d = running(IDS, gen=2, sigabrt_reports=old)
    abrt = _sigabrt(3).model_copy(update={"generation": 2})
    torn = _torn(d, [abrt, st(1, gen=2), st(2, gen=2), st(4, gen=2)])
    assert torn.job_health == NodeHealth()
    assert torn.sigabrt_reports.generation == 2 and torn.sigabrt_reports.nodes == ("n3",)


def test_kept_reports_without_a_cause_stop_no_pass() -> None:
    """The schema allows SIGABRT reports with nodes and no cause: with no SIGABRT reported
    in the pass, ``charge`` raised ValueError (``min`` of nothing), and a leader failed on
    every pass. They are SIGABRTs all the same: a third one makes the hang."""
    mute = SigabrtReports(generation=1, nodes=("n1", "n2"), cause="")
    d = running(IDS).model_copy(update={"phase": Phase.TEARDOWN, "aborted": True})
    d = d.model_copy(update={"sigabrt_reports": mute})
    c = charge(d, {}, 1000.0, CFG.exclusion)
    assert c.job == NodeHealth() and c.health == {} and c.sigabrts is not None
    assert c.sigabrts.nodes == ("n1", "n2") and "SIGABRT" in c.sigabrts.cause
    c = charge(d, {"n3": _sigabrt(3).failure}, 1000.0, CFG.exclusion)
    assert c.job.failures == 1 and c.health == {}


# ---- a node lost during the TEARDOWN is recorded once, as one lost at the abort ----


def test_a_node_lost_only_during_the_teardown_is_recorded_and_its_return_changes_nothing() -> None:
    """n1's SIGABRT aborts n1..n4 (nobody charged: the node at fault is not known). In a
    TEARDOWN pass n4's registration is gone (its lease expired) while n2's SIGABRT comes in:
    the loss is recorded (``lost_nodes``). n4 is back by the next pass, where n3's SIGABRT
    makes three of four: the record says n4 was lost, so their SIGABRTs are no hang of the
    job. Before, the loss was worked out again in each pass from the registrations alone:
    n4 back, it was forgotten, and the job was charged with a hang."""
    torn = _torn(running(IDS), [_sigabrt(1), st(2), st(3), st(4)])
    assert torn.lost_nodes == ()
    three = obs(nodes(1, 2, 3), [_sigabrt(2), st(3)])
    states = _states(decide(torn, three, CFG))
    assert states and states[-1].lost_nodes == ("n4",), states
    assert any(
        a.reason.startswith("lost during the teardown: n4")
        for a in decide(torn, three, CFG)
        if isinstance(a, SetDesired)
    )
    seen = states[-1]
    back = obs(nodes(*IDS), [_sigabrt(3), st(4, state="idle")])
    for s in _states(decide(seen, back, CFG)):
        assert s.job_health == NodeHealth() and s.node_health == {}, s.job_health
        assert s.lost_nodes == ("n4",)
    # recorded once: the next pass, n4 still gone, writes no state for it again
    again = _states(decide(seen, obs(nodes(1, 2, 3), [st(3, state="idle")]), CFG))
    assert all(s.lost_nodes == ("n4",) for s in again)
    assert not any(s.lost_nodes != seen.lost_nodes for s in again)
