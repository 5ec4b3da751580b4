"""A LAUNCH, LOAD or VERIFY deadline charges the placed nodes that held it up, and only them.

Before, such an abort charged no node: a node whose agent never acked its Launch (a hung
agent, a dead VM whose lease still held) or whose workers never came up had the controller
relaunch on it again and again. Every test here failed on that code."""

from __future__ import annotations

from dataclasses import replace

from sailor.controller.decide import decide
from sailor.controller.decision_types import DecideConfig, Observed, Send, SetDesired
from sailor.controller.launch import REFUSED_RESEND
from sailor.controller.node_health import held
from sailor.controller.phases import PhaseDeadlines
from sailor.schemas.runtime import AgentStatus, DesiredState, NodeHealth, Phase
from tests.unit.test_controller_decide import (
    CFG,
    NOW,
    _sigabrt,
    fails,
    kinds,
    nodes,
    obs,
    running,
    st,
)

LATE = NOW + 1  # past the deadline of the states below (NOW)
IDS = (1, 2, 3, 4)
NO_STRETCH = CFG.model_copy(update={"deadlines": PhaseDeadlines(stretch_cap=1)})
"""A stalled LOAD or VERIFY is charged at once, its deadline not stretched first (that rule:
``tests/unit/test_controller_job_charges.py``)."""


_LENGTH = {Phase.LAUNCH: 20.0, Phase.LOAD: 120.0, Phase.VERIFY: 120.0}
"""The phases' default deadlines (``deadlines.launch``, ``load``, ``verify``), s."""


def _launching(phase: Phase, gen: int = 2, **kw: object) -> DesiredState:
    """Generation ``gen`` placed on n1..n4 coming up, begun by this leader (epoch 7), its
    deadline at NOW (the phase's default length after it began), loading step 10."""
    fields: dict[str, object] = {
        "phase_deadline": NOW,
        "phase_since": NOW - _LENGTH[phase],
        "phase_epoch": 7,
        "load_step": 10,
    }
    return running(IDS, gen=gen, phase=phase, **(fields | kw))


def _job_counted(d: DesiredState) -> bool:
    """The job's record counts ``d``'s generation, for a missed deadline."""
    job = d.job_health
    return job.generation == d.generation and job.cause.startswith("DeadlineMissed")


def _acked(d: DesiredState, *ids: int) -> frozenset[str]:
    return frozenset(f"e{d.epoch}-g{d.generation}-launch-n{i}" for i in ids)


def _late(statuses: list[AgentStatus], **kw: object) -> Observed:
    return replace(obs(nodes(*IDS), statuses, **kw), now=LATE)


def _abort(d: DesiredState, o: Observed, cfg: DecideConfig = NO_STRETCH) -> SetDesired:
    a = decide(d, o, cfg)
    assert kinds(a) == ["set:teardown"]
    (done,) = a
    assert isinstance(done, SetDesired) and done.state.aborted
    return done


def test_a_node_that_never_acks_its_launch_is_charged_and_excluded_after_three() -> None:
    health: dict[str, NodeHealth] = {}
    for gen in (2, 3, 4):
        d = _launching(Phase.LAUNCH, gen=gen, node_health=health)
        idle = [st(i, gen=gen - 1, state="idle") for i in IDS]
        o = _late(idle, acked=_acked(d, 1, 3, 4))
        done = _abort(d, o)
        torn, reason = done.state, done.reason
        health = torn.node_health
        assert set(health) == {"n2"}, "only the node whose Launch was not acked"
        rec = health["n2"]
        assert rec.failures == gen - 1 and rec.generation == gen
        assert rec.cause.startswith("DeadlineMissed: still idle")
        assert "its Launch not acked" in rec.cause and "launch deadline" in rec.cause
        assert "launch deadline passed" in torn.cause
        assert "counted against n2 (still idle" in reason
        assert all(f"n{i}" not in reason for i in (1, 3, 4))
        assert torn.job_health == NodeHealth()
        # the teardown after it sees the same statuses: nothing counted again, nothing taken back
        after = decide(torn, o, CFG)
        assert "set:teardown" not in kinds(after)
        if gen < 4:
            assert rec.excluded_until == 0 and "excluded" not in reason
    # the policy's threshold (3 consecutive) reached: excluded, the next plan leaves it out
    assert CFG.exclusion.failures == 3
    assert health["n2"].excluded_until == LATE + CFG.exclusion.exclude_s
    assert "excluded n2 until" in reason and "3 consecutive failures" in reason
    a = decide(torn, _late([st(i, gen=4, state="idle") for i in IDS]), CFG)
    assert [n.node_id for n in a[-1].nodes] == ["n1", "n3", "n4"]  # type: ignore[union-attr]


def test_three_of_four_missing_the_launch_deadline_are_each_charged_not_the_job() -> None:
    """The same text on most placed nodes is not a failure of the job: a missed deadline
    is the node's, as a missed teardown is (not taken back at the teardown either)."""
    d = _launching(Phase.LAUNCH)
    o = _late([st(i, gen=1, state="idle") for i in IDS], acked=_acked(d, 1))
    torn = _abort(d, o).state
    assert set(torn.node_health) == {"n2", "n3", "n4"} and torn.job_health == NodeHealth()
    after = decide(torn, o, CFG)
    assert "set:teardown" not in kinds(after)


def test_a_node_whose_workers_are_not_running_at_the_load_deadline_is_charged() -> None:
    d = _launching(Phase.LOAD)
    o = _late([st(1, gen=2), st(2, gen=1, state="idle"), st(3, gen=2), st(4, gen=2)])
    done = _abort(d, o)
    assert set(done.state.node_health) == {"n2"}
    rec = done.state.node_health["n2"]
    assert rec.failures == 1 and rec.excluded_until == 0
    assert rec.cause == "DeadlineMissed: still idle (generation 1) at the load deadline"
    assert "counted against n2" in done.reason


def test_a_node_still_loading_at_the_load_deadline_is_not_charged() -> None:
    """Workers of this generation still starting (reported idle) may be loading the heaviest
    stage or waiting at a rendezvous a peer never joined: nobody to blame (review: charging
    the slowest loader excluded a healthy node after three relaunches of one plan)."""
    d = _launching(Phase.LOAD)
    o = _late([st(1, gen=2), st(2, gen=2, state="idle"), st(3, gen=2), st(4, gen=2)])
    done = _abort(d, o)
    assert done.state.node_health == {} and "counted against" not in done.reason
    # one that reports nothing at all is
    o = _late([st(1, gen=2), st(3, gen=2), st(4, gen=2)])
    assert set(_abort(d, o).state.node_health) == {"n2"}


def test_a_node_already_excluded_is_not_charged_again_at_the_load_deadline() -> None:
    """n3 was excluded after the layout was made (its record says so): not counted again."""
    out = NodeHealth(failures=3, generation=1, exclusions=1, excluded_until=NOW + 300, cause="x")
    d = _launching(Phase.LOAD, node_health={"n3": out})
    o = _late([st(1, gen=2), st(2, gen=1, state="idle"), st(3, gen=1, state="idle"), st(4, gen=2)])
    health = _abort(d, o).state.node_health
    assert set(health) == {"n2", "n3"} and health["n3"] == out
    assert health["n2"].failures == 1


def test_when_every_placed_node_misses_the_deadline_no_node_is_charged_the_job_is() -> None:
    """No node is to blame more than the others (the controller's, the network's or the
    job's fault, or a deadline too short): no node is charged, the job is, and the reason
    names the phase and the deadline (before: nobody, relaunched at full rate forever).
    Not at LAUNCH: no ack at all is the command bus's or the controller's fault."""
    d = _launching(Phase.LAUNCH)
    done = _abort(d, _late([st(i, gen=1, state="idle") for i in IDS]))
    assert done.state.node_health == {} and done.state.job_health == NodeHealth()
    assert "not counted against the 4 placed node(s)" in done.reason
    assert "every one missed the launch deadline" in done.reason
    assert "counted against the job" not in done.reason
    d = _launching(Phase.LOAD)
    done = _abort(d, _late([st(i, gen=1, state="idle") for i in IDS]))
    assert done.state.node_health == {} and "missed the load deadline" in done.reason
    assert _job_counted(done.state) and "by the load deadline (120 s, deadlines.load)" in (
        done.reason
    )
    assert done.state.job_health.cause.startswith("DeadlineMissed: none of the 4")


def test_the_verify_deadline_charges_only_a_strict_subset_not_running() -> None:
    """Every worker up and stuck at one step (a collective waits for the slowest rank)
    blames no node; one whose workers are not running at all is to blame."""
    d = _launching(Phase.VERIFY)
    stuck = _abort(d, _late([st(i, gen=2, step=10) for i in IDS]))
    assert stuck.state.node_health == {} and "counted against n" not in stuck.reason
    stopped = st(2, gen=2, state="stopped", step=10)
    o = _late([st(1, gen=2, step=10), stopped, st(3, gen=2), st(4, gen=2)])
    done = _abort(d, o)
    assert set(done.state.node_health) == {"n2"}
    assert "still stopped (generation 2) at the verify deadline" in done.reason


def test_a_launch_adopted_from_another_epoch_charges_nobody_for_missing_acks() -> None:
    """The acks of the epoch that began the LAUNCH are lost with its leader: a node may have
    acked its Launch, so none is charged for not having acked this epoch's. The LOAD that
    follows judges by the statuses, which no epoch change loses."""
    d = _launching(Phase.LAUNCH, phase_epoch=6)
    done = _abort(d, _late([st(i, gen=1, state="idle") for i in IDS], acked=_acked(d, 1)))
    assert done.state.node_health == {} and done.state.job_health == NodeHealth()
    # nor the job when none acked this epoch's: they may have acked the other's
    done = _abort(d, _late([st(i, gen=1, state="idle") for i in IDS]))
    assert done.state.node_health == {} and done.state.job_health == NodeHealth()
    d = _launching(Phase.LOAD, phase_epoch=6)
    o = _late([st(1, gen=2), st(2, gen=1, state="idle"), st(3, gen=2), st(4, gen=2)])
    assert set(_abort(d, o).state.node_health) == {"n2"}


def test_an_adopted_launch_takes_the_nodes_running_its_generation_as_launched() -> None:
    """After a failover in LAUNCH, a node whose status reports this generation's workers of
    this plan running applied its Launch (the ack went to the leader that died): it is sent
    none again, and once every node is so the phase moves on. Before, each was sent a
    Launch under the new epoch's id, which its agent applied a second time (the ranks just
    started were killed and started over). A LAUNCH this leader began counts its acks."""
    d = _launching(Phase.LAUNCH, phase_epoch=6, phase_deadline=NOW + 10)
    assert d.plan is not None
    up = [st(i, gen=2).model_copy(update={"plan_id": d.plan.plan_id}) for i in IDS]
    starting = [st(i, gen=2, state="idle") for i in (3, 4)]
    o = obs(nodes(*IDS), [*up[:2], *starting])
    assert kinds(decide(d, o, CFG)) == ["send:launch:n3", "send:launch:n4"]
    other = [s.model_copy(update={"plan_id": "another"}) for s in up]
    assert kinds(decide(d, obs(nodes(*IDS), other), CFG)) == [f"send:launch:n{i}" for i in IDS]
    assert kinds(decide(d, obs(nodes(*IDS), up), CFG)) == ["set:load"]
    mine = _launching(Phase.LAUNCH, phase_deadline=NOW + 10)
    assert kinds(decide(mine, obs(nodes(*IDS), up), CFG)) == [f"send:launch:n{i}" for i in IDS]


def test_a_missed_deadline_is_not_taken_back_when_the_node_then_fails_like_its_peers() -> None:
    """At the teardown every node reports the same failure of the generation (the
    rendezvous timed out waiting for n2): the job's, and n2's missed deadline stays its own
    (review: the late report replaced it as n2's evidence and the count was taken back)."""
    d = _launching(Phase.LOAD)
    o = _late([st(1, gen=2), st(2, gen=1, state="idle"), st(3, gen=2), st(4, gen=2)])
    torn = _abort(d, o).state
    assert set(torn.node_health) == {"n2"}
    late = _late([fails(i, gen=2, message="rendezvous store timeout") for i in IDS])
    states = [a.state for a in decide(torn, late, CFG) if isinstance(a, SetDesired)]
    assert states, "the late reports are counted"
    health = states[-1].node_health
    assert set(health) == {"n2"} and health["n2"] == torn.node_health["n2"]


def test_a_late_node_reporting_its_own_failure_is_counted_with_it_and_the_reason_says_so() -> None:
    """At a LAUNCH deadline n2 (not acked) still reports a failure of an older generation:
    that failure is what is counted, and the reason names it, not the missed deadline."""
    d = _launching(Phase.LAUNCH)
    old = fails(2, gen=1, message="CUDA error: uncorrectable ECC error encountered")
    o = _late(
        [st(1, gen=1, state="idle"), old, st(3, gen=1, state="idle"), st(4, gen=1, state="idle")],
        acked=_acked(d, 1, 3, 4),
    )
    done = _abort(d, o)
    rec = done.state.node_health["n2"]
    assert "ECC error" in rec.cause and "ECC error" in done.reason
    assert "still failed" not in done.reason


def test_a_late_nodes_peers_failing_like_it_are_the_jobs_not_each_charged() -> None:
    """Two nodes: n2 misses the LOAD deadline, then both report the rendezvous timeout its
    absence caused. The failure alike is the job's (n1 is not charged), and n2's missed
    deadline stays its own (review: keeping it had dropped n2 from the count of nodes
    failing alike, and charged n1)."""
    d = running((1, 2), gen=2, phase=Phase.LOAD, phase_deadline=NOW, phase_epoch=7, load_step=10)
    o = replace(obs(nodes(1, 2), [st(1, gen=2), st(2, gen=1, state="idle")]), now=LATE)
    torn = _abort(d, o).state
    late = replace(
        obs(nodes(1, 2), [fails(i, gen=2, message="rendezvous store timeout") for i in (1, 2)]),
        now=LATE,
    )
    states = [a.state for a in decide(torn, late, CFG) if isinstance(a, SetDesired)]
    assert states and set(states[-1].node_health) == {"n2"}
    assert states[-1].node_health["n2"] == torn.node_health["n2"]
    assert states[-1].job_health.failures == 1


def test_a_hung_node_with_an_old_sigabrt_is_charged_its_missed_deadline() -> None:
    """n2 never acks its Launch and still reports a SIGABRT of generation 1: a SIGABRT alone
    is counted against nobody, so the missed deadline is (review: it was spared at every
    LAUNCH deadline, and relaunched on forever)."""
    health: dict[str, NodeHealth] = {}
    for gen in (2, 3, 4):
        d = _launching(Phase.LAUNCH, gen=gen, node_health=health)
        abrt = _sigabrt(2).model_copy(update={"generation": 1})
        sts = [
            st(1, gen=1, state="idle"),
            abrt,
            st(3, gen=1, state="idle"),
            st(4, gen=1, state="idle"),
        ]
        done = _abort(d, _late(sts, acked=_acked(d, 1, 3, 4)))
        health = done.state.node_health
        assert set(health) == {"n2"} and health["n2"].cause.startswith("DeadlineMissed")
    assert health["n2"].excluded_until > LATE


# ---- a generation no placed node got through: the job's (each failed on the code before) ----


def test_a_generation_hung_in_verify_with_every_worker_running_counts_against_the_job() -> None:
    """Every worker up and stuck at the loaded step (a collective that never completes):
    no node is to blame, the job is, once (the teardown's passes do not count it again)."""
    d = _launching(Phase.VERIFY)
    o = _late([st(i, gen=2, step=10) for i in IDS])
    done = _abort(d, o)
    assert done.state.node_health == {} and _job_counted(done.state)
    assert (
        "none of the 4 placed node(s) reported a step past 10 by the verify deadline (120 s, "
        "deadlines.verify), stretched no further" in (done.reason)
    )
    assert [a for a in decide(done.state, o, NO_STRETCH) if isinstance(a, SetDesired)] == []
    # one node through (a step past 10): not every node alike, nobody is charged, as before
    o = _late([st(1, gen=2, step=11), *(st(i, gen=2, step=10) for i in IDS[1:])])
    some = _abort(d, o)
    assert some.state.node_health == {} and some.state.job_health == NodeHealth()


def test_every_node_still_starting_at_the_load_deadline_counts_against_the_job() -> None:
    """A rendezvous that never completes (or a checkpoint every node reads too slowly) keeps
    every node's workers starting: no node is to blame, the job is. One node that never
    started its workers while the others wait for it is charged instead, not the job."""
    d = _launching(Phase.LOAD)
    done = _abort(d, _late([st(i, gen=2, state="idle") for i in IDS]))
    assert done.state.node_health == {} and _job_counted(done.state)
    assert "none of the 4 placed node(s) had its workers running by the load deadline" in (
        done.reason
    )
    o = _late(
        [
            st(1, gen=2, state="idle"),
            st(2, gen=1, state="idle"),
            *(st(i, gen=2, state="idle") for i in (3, 4)),
        ]
    )
    one = _abort(d, o)
    assert set(one.state.node_health) == {"n2"} and one.state.job_health == NodeHealth()


def test_three_stalled_generations_hold_the_job_and_one_that_trains_resets_it() -> None:
    """``exclusion.failures`` (3) generations in a row that no node got through hold the job
    (no layout is launched: the teardown ends in IDLE naming the hold), with the policy's
    backoff; a generation that trains resets the job's count."""
    job = NodeHealth()
    for gen in (2, 3, 4):
        d = _launching(Phase.LOAD, gen=gen, job_health=job)
        done = _abort(d, _late([st(i, gen=gen, state="idle") for i in IDS]))
        job = done.state.job_health
        assert job.failures == gen - 1 and done.state.node_health == {}
    assert CFG.exclusion.failures == 3 and held(job, LATE)
    assert job.excluded_until == LATE + CFG.exclusion.exclude_s
    assert "held the job until" in done.reason and "3 consecutive failures" in done.reason
    idle = _late([st(i, gen=4, state="idle") for i in IDS])
    after = [a for a in decide(done.state, idle, NO_STRETCH) if isinstance(a, SetDesired)]
    assert after[-1].state.phase is Phase.IDLE and "held the job" in after[-1].state.cause
    # a generation that trains (VERIFY -> RUNNING) resets the count (the backoff stays)
    d = _launching(Phase.VERIFY, gen=5, job_health=job.model_copy(update={"excluded_until": 0}))
    trained = decide(d, obs(nodes(*IDS), [st(i, gen=5, step=11) for i in IDS]), CFG)
    (run,) = [a for a in trained if isinstance(a, SetDesired)]
    assert run.state.phase is Phase.RUNNING and run.state.job_health.failures == 0


def _killing(i: int) -> AgentStatus:
    """A node whose agent is still killing the previous generation's workers: it refuses a
    Launch until the kill ends (``workers being killed: ...``)."""
    return st(i, gen=1, state="stopped").model_copy(update={"killing": 1})


def test_a_node_refusing_its_launch_while_it_kills_is_waited_for_not_charged() -> None:
    """The agent's kill takes up to 3 s of SIGTERM grace plus 120 s; a node whose Launch it
    refused for a kill under way was charged at the 20 s LAUNCH deadline as if its ack had
    never come, and a healthy node slow to kill was excluded after three. Now the phase
    waits for the kill (its status says it goes on), re-sending the Launch, which is taken
    once the kill is over; only a kill still reported ``deadlines.teardown`` past the
    deadline (longer than the agent's bound) is charged."""
    d = _launching(Phase.LAUNCH)
    statuses = [
        st(1, gen=1, state="idle"),
        _killing(2),
        *(st(i, gen=1, state="idle") for i in (3, 4)),
    ]
    a = decide(d, _late(statuses, acked=_acked(d, 1, 3, 4)), NO_STRETCH)
    # no abort, nobody charged: n2 remembered as waited for, the Launch again
    assert kinds(a) == ["set:launch", "send:launch:n2"]
    assert a[0].state.launch_waited == ("n2",)  # type: ignore[union-attr]
    # the kill ended: the re-sent Launch is acked, and the launch goes on
    done = [st(i, gen=1, state="idle") for i in IDS]
    a = decide(d, _late(done, acked=_acked(d, *IDS)), NO_STRETCH)
    assert kinds(a) == ["set:load"]
    assert a[0].state.launch_waited == ()  # type: ignore[union-attr]
    # a kill reported past its bound is charged as a missing ack was
    bound = replace(_late(statuses, acked=_acked(d, 1, 3, 4)), now=NOW + 151)
    torn = _abort(d, bound).state
    assert set(torn.node_health) == {"n2"}
    assert torn.node_health["n2"].cause.startswith("DeadlineMissed: still stopped")


def test_a_killing_node_is_not_charged_when_another_misses_the_launch_deadline() -> None:
    d = _launching(Phase.LAUNCH)
    statuses = [
        st(1, gen=1, state="idle"),
        _killing(2),
        *(st(i, gen=1, state="idle") for i in (3, 4)),
    ]
    done = _abort(d, _late(statuses, acked=_acked(d, 1, 4)))
    assert set(done.state.node_health) == {"n3"}  # n3 never acked; n2 was still killing
    assert "not counted against n2: still killing workers" in done.reason


def test_a_node_whose_kill_just_ended_is_still_waited_for_until_its_launch_is_acked() -> None:
    """The kill's end wakes a pass (the agent publishes ``killing: 0`` at once) before the
    re-sent Launch is acked: a Launch is re-sent only by a pass. That pass aborted and charged
    n2 "its Launch not acked" (review: ``_waited`` read the status alone, which no longer
    said kill). Now the node waited for is remembered, and waited for until its ack or the
    kill's bound; a failure it reports then (``OutlivedKill``) is charged at once."""
    d = _launching(Phase.LAUNCH)
    statuses = [
        st(1, gen=1, state="idle"),
        _killing(2),
        *(st(i, gen=1, state="idle") for i in (3, 4)),
    ]
    acked = _acked(d, 1, 3, 4)
    a = decide(d, _late(statuses, acked=acked), NO_STRETCH)
    assert kinds(a)[-1:] == ["send:launch:n2"] and "set:teardown" not in kinds(a)
    waiting = next((x.state for x in a if isinstance(x, SetDesired)), d)
    # the kill ended, the re-sent Launch not acked yet: the Launch again, nobody charged
    ended = [*statuses[:1], st(2, gen=1, state="idle"), *statuses[2:]]
    a = decide(waiting, _late(ended, acked=acked), NO_STRETCH)
    assert kinds(a) == ["send:launch:n2"]
    assert waiting.launch_waited == ("n2",) and waiting.phase_deadline == d.phase_deadline
    # acked: the launch goes on
    a = decide(waiting, _late(ended, acked=_acked(d, *IDS)), NO_STRETCH)
    assert kinds(a) == ["set:load"]
    # still not acked at the kill's bound (deadlines.teardown past the deadline): charged
    bound = replace(_late(ended, acked=acked), now=NOW + CFG.deadlines.teardown + 1)
    torn = _abort(waiting, bound).state
    assert set(torn.node_health) == {"n2"}
    assert "its Launch not acked" in torn.node_health["n2"].cause
    # its kill outlived the agent's bound: that failure is charged at once
    outlived = st(2, gen=1, state="failed").model_copy(
        update={"failure": "OutlivedKill: process group 4242 outlived its SIGKILL"}
    )
    o = _late([*statuses[:1], outlived, *statuses[2:]], acked=acked)
    torn = _abort(waiting, o).state
    assert "OutlivedKill" in torn.node_health["n2"].cause
    # another node missing the deadline aborts: n2, waited for, is not charged
    done = _abort(waiting, _late(ended, acked=_acked(d, 1, 4)))
    assert set(done.state.node_health) == {"n3"}
    assert "not counted against n2: its kill just over" in done.reason


def test_a_launch_refused_during_a_kill_waits_for_its_end_and_a_refusal_is_named() -> None:
    """The agent's refusals (``Observed.refused``: its last reason per command) reach the
    decision. A Launch refused while the node kills workers was re-sent every ``resend_s``
    (0.5 s) and refused each time, a command and an ack record a time, for a kill of up to
    two minutes; now it waits for the status to say the kill is over. And at the LAUNCH
    deadline a refused Launch was charged as "not acked", as if it were lost on the bus:
    the abort now says why each node refused, and so does the charge."""
    d = _launching(Phase.LAUNCH, phase_deadline=NOW + 10)
    cid = "e7-g2-launch-n2"
    idle = [st(i, gen=1, state="idle") for i in IDS]
    killing = [idle[0], _killing(2), *idle[2:]]
    acked = _acked(d, 1, 3, 4)
    reason = "workers being killed: 1 process group(s) not gone yet"
    # not refused yet: sent (the status may lag the kill's end)
    assert kinds(decide(d, obs(nodes(*IDS), killing, acked=acked), CFG)) == ["send:launch:n2"]
    # refused while the status says the kill goes on: sent again slowly only
    o = obs(nodes(*IDS), killing, acked=acked, refused={cid: reason})
    assert [(x.command.node_id, x.resend_every) for x in decide(d, o, CFG)] == [  # type: ignore[attr-defined]
        ("n2", REFUSED_RESEND)
    ]
    # the kill is over (its status): sent again
    o = obs(nodes(*IDS), idle, acked=acked, refused={cid: reason})
    assert kinds(decide(d, o, CFG)) == ["send:launch:n2"]
    # past the deadline, refused for another reason (the plan unreadable there): charged,
    # with the reason in the charge and in the abort's cause (``sailor status``)
    why = "plan p-1: etcd unavailable"
    done = _abort(_launching(Phase.LAUNCH), _late(idle, acked=acked, refused={cid: why}))
    assert f"n2 refused its Launch: {why}" in done.state.cause
    assert done.state.node_health["n2"].cause.endswith(f"its Launch not acked, refused: {why}")
    # every node refused: not the command bus's fault, and each reason is given
    every = {f"e7-g2-launch-n{i}": why for i in IDS}
    done = _abort(_launching(Phase.LAUNCH), _late(idle, refused=every))
    assert "their agents' refusals say why" in done.reason and "command bus" not in done.reason
    assert all(f"n{i} refused its Launch" in done.reason for i in IDS[:3])
    assert "and 1 more" in done.state.cause


def test_a_refused_launch_is_still_re_sent_slowly_while_the_status_says_killing() -> None:
    """The agent writes its status only when it changes: when the update that says the
    kill is over is lost (etcd restored from a snapshot holding ``killing > 0``, a stale
    read), the status says ``killing`` for good. A Launch refused then was never sent again
    until the kill's bound, and the healthy node charged at it; now it goes out every
    ``REFUSED_RESEND`` x ``resend_s`` (the executor spaces the copies,
    ``Send.resend_every``), is taken by the agent whose kill is over, and the phase goes
    on. Sent at the usual pace once the status says the kill is over."""
    d = _launching(Phase.LAUNCH, phase_deadline=NOW + 10)
    cid = "e7-g2-launch-n2"
    idle = [st(i, gen=1, state="idle") for i in IDS]
    stuck = [idle[0], _killing(2), *idle[2:]]  # the kill is over, its status was lost
    acked = _acked(d, 1, 3, 4)
    reason = "workers being killed: 1 process group(s) not gone yet"
    o = obs(nodes(*IDS), stuck, acked=acked, refused={cid: reason})
    (send,) = decide(d, o, CFG)
    assert isinstance(send, Send) and send.command.command_id == cid
    assert send.resend_every == REFUSED_RESEND > 1
    # past the LAUNCH deadline, waited for (its status says killing): still re-sent slowly
    late = replace(o, now=d.phase_deadline + 1)
    sends = [x for x in decide(d, late, CFG) if isinstance(x, Send)]
    assert [(x.command.command_id, x.resend_every) for x in sends] == [(cid, REFUSED_RESEND)]
    # the agent takes it: the phase goes on
    taken = replace(late, acked=acked | {cid}, refused={})
    assert kinds(decide(d, taken, CFG)) == ["set:load"]
    # once the status says the kill is over: the usual pace
    (send,) = decide(d, obs(nodes(*IDS), idle, acked=acked, refused={cid: reason}), CFG)
    assert isinstance(send, Send) and send.resend_every == 1


def test_the_note_names_the_refusals_and_the_command_bus_when_some_refused() -> None:
    """No placed node acked its Launch: n2's agent refused it, the others' went
    unanswered. The note said "their agents' refusals say why" as soon as any node
    refused, so the command bus went unnamed for the three Launches lost on the way (the
    docs said: when every node refused). Now it says both: the refusal with its reason,
    and the silent nodes with the command bus, as when none refused."""
    idle = [st(i, gen=1, state="idle") for i in IDS]
    why = "plan p-1: etcd unavailable"
    done = _abort(_launching(Phase.LAUNCH), _late(idle, refused={"e7-g2-launch-n2": why}))
    assert done.state.node_health == {}  # every one late: nobody charged, as before
    assert f"1 refused (n2: {why}), 3 not answered (n1, n3, n4)" in done.reason, done.reason
    assert "not answered (n1, n3, n4): the command bus's or the controller's fault" in done.reason
    assert "their agents' refusals say why" not in done.reason
    # none refused: the command bus alone, as before
    done = _abort(_launching(Phase.LAUNCH), _late(idle))
    assert "(no Launch acked at all: the command bus's or the controller's fault)" in done.reason
    # many on each side: three named in each group, the others counted
    many = (1, 2, 3, 4, 5, 6, 7, 8)
    d = running(many, gen=2, phase=Phase.LAUNCH, phase_deadline=NOW, phase_epoch=7)
    d = d.model_copy(update={"phase_since": NOW - _LENGTH[Phase.LAUNCH], "load_step": 10})
    assert len(d.placement) == len(many)
    refused = {f"e7-g2-launch-n{i}": why for i in (1, 2, 3, 4)}
    o = replace(
        obs(nodes(*many), [st(i, gen=1, state="idle") for i in many], refused=refused), now=LATE
    )
    done = _abort(d, o)
    assert f"4 refused (n1: {why}; n2: {why}; n3: {why}; and 1 more)" in done.reason, done.reason
    assert "4 not answered (n5, n6, n7; and 1 more)" in done.reason
