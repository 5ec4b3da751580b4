"""What the job is charged with, and what not, at the decide level (a review of the job's
charges: SIGABRTs after a lost node, a LAUNCH no node acked, a stall a node's own failure
explains, a deadline too short for a real cluster, a one-node job, an adopted VERIFY that got
through). Each test failed on the code before its fix."""

from __future__ import annotations

from dataclasses import replace

from sailor.controller.decide import decide
from sailor.controller.decision_types import Action, Observed, SetDesired
from sailor.controller.node_health import held
from sailor.controller.phases import PhaseDeadlines
from sailor.schemas.runtime import AgentStatus, DesiredState, NodeHealth, NoticeRecord, Phase
from tests.unit.test_controller_decide import CFG, NOW, _sigabrt, fails, nodes, obs, running, st

IDS = (1, 2, 3, 4)
LATE = NOW + 1
NO_STRETCH = CFG.model_copy(update={"deadlines": PhaseDeadlines(stretch_cap=1)})
"""Deadlines that are never stretched: a stall charges at once (the rule before the stretch)."""


def _states(actions: list[Action]) -> list[DesiredState]:
    return [a.state for a in actions if isinstance(a, SetDesired)]


def _abrt(i: int, gen: int = 1) -> AgentStatus:
    return _sigabrt(i).model_copy(update={"generation": gen})


def _ecc(i: int, gen: int = 1) -> AgentStatus:
    return fails(i, gen=gen, message="CUDA error: uncorrectable ECC error encountered")


def _late(statuses: list[AgentStatus], ids: tuple[int, ...] = IDS, **kw: object) -> Observed:
    return replace(obs(nodes(*ids), statuses, **kw), now=LATE)


def _launching(
    phase: Phase, gen: int = 2, ids: tuple[int, ...] = IDS, **kw: object
) -> DesiredState:
    length = {Phase.LAUNCH: 20.0, Phase.LOAD: 120.0, Phase.VERIFY: 120.0}[phase]
    fields = {"phase_deadline": NOW, "phase_since": NOW - length, "phase_epoch": 7, "load_step": 10}
    return running(ids, gen=gen, phase=phase, **(fields | kw))


def _torn(d: DesiredState, o: Observed, cfg: object = CFG) -> SetDesired:
    a = decide(d, o, cfg)  # type: ignore[arg-type]
    (done,) = [x for x in a if isinstance(x, SetDesired)]
    assert done.state.phase is Phase.TEARDOWN, done.reason
    return done


# ---- 1: a node lost without notice makes its peers' SIGABRTs its, not a hang of the job ----


def test_sigabrts_after_a_node_vanished_count_against_nobody() -> None:
    """n4's spot VM vanished; NCCL's watchdog on n1-n3 fired before the Abort landed: 3 of 4
    placed report SIGABRT. The fault is known (n4): not a hang of the job."""
    d = running(IDS)
    o = obs(nodes(1, 2, 3), [_abrt(1), _abrt(2), _abrt(3)])
    done = _torn(d, o)
    assert "node lost without notice: n4" in done.state.cause
    assert done.state.job_health == NodeHealth() and done.state.node_health == {}
    # the teardown's passes see the same reports: still nobody
    assert _states(decide(done.state, o, CFG)) == []
    # nor when n4 comes back (a new lease) while the others still report their SIGABRTs
    back = obs(nodes(*IDS), [_abrt(1), _abrt(2), _abrt(3), st(4, state="idle")])
    for s in _states(decide(done.state, back, CFG)):
        assert s.job_health == NodeHealth() and s.node_health == {}


def test_sigabrts_while_a_placed_node_has_a_notice_count_against_nobody() -> None:
    d = running(IDS, phase=Phase.QUIESCE, phase_deadline=NOW + 20, stop_step=12)
    notice = {"n4": NoticeRecord(node_id="n4", deadline=NOW + 10)}
    o = obs(nodes(*IDS), [_abrt(1), _abrt(2), _abrt(3), st(4)], notices=notice)
    done = _torn(d, o)
    assert done.state.job_health == NodeHealth() and done.state.node_health == {}


def test_a_hang_counted_before_the_loss_was_seen_is_taken_back() -> None:
    """The SIGABRTs came first (the abort counted a hang), then n4's lease expired during the
    teardown: the job's count is taken back."""
    d = running(IDS)
    sigs = [_abrt(1), _abrt(2), _abrt(3), st(4)]
    torn = _torn(d, obs(nodes(*IDS), sigs)).state
    assert torn.job_health.failures == 1
    after = _states(decide(torn, obs(nodes(1, 2, 3), sigs[:3]), CFG))
    assert after and after[-1].job_health.generation != torn.generation
    assert after[-1].job_health.failures == 0


# ---- 2: a LAUNCH no node acked is a command-bus or controller outage, not the job's ----


def test_a_launch_no_node_acked_charges_nobody_and_never_holds_the_job() -> None:
    job = NodeHealth()
    for gen in (2, 3, 4, 5):
        d = _launching(Phase.LAUNCH, gen=gen, job_health=job)
        done = _torn(d, _late([st(i, gen=gen - 1, state="idle") for i in IDS]))
        job = done.state.job_health
        assert job == NodeHealth() and done.state.node_health == {}
        assert "(the job is)" not in done.reason and "counted against the job" not in done.reason
        assert "the command bus's or the controller's fault" in done.reason
    assert not held(job, LATE)


# ---- 3: a node's own failure after a stall takes the job's stall count back ----


def test_a_nodes_own_failure_after_a_stalled_verify_takes_the_stall_back() -> None:
    """VERIFY hung with every worker running: the job is charged (stretched to its cap);
    then n2 reports an ECC error during the teardown: n2 is charged, the job's count goes."""
    d = _launching(Phase.VERIFY)
    done = _torn(d, _late([st(i, gen=2, step=10) for i in IDS]), NO_STRETCH)
    assert done.state.job_health.failures == 1
    late = _late([st(1, gen=2, step=10), _ecc(2, gen=2), st(3, gen=2), st(4, gen=2)])
    after = _states(decide(done.state, late, NO_STRETCH))
    assert after, "the late report is counted"
    assert set(after[-1].node_health) == {"n2"}
    assert after[-1].job_health.generation != 2 and after[-1].job_health.failures == 0


# ---- 4: a LOAD or VERIFY deadline no node got past stretches before anyone is charged ----


def test_a_stalled_load_doubles_its_next_deadline_up_to_the_cap_then_charges_the_job() -> None:
    assert CFG.deadlines.stretch_cap == 8 and CFG.deadlines.load == 120
    d = _launching(Phase.LOAD)
    lengths = []
    for gen in (2, 3, 4, 5):
        done = _torn(d, _late([st(i, gen=gen, state="idle") for i in IDS]))
        torn = done.state
        assert torn.node_health == {}
        if gen < 5:
            assert torn.job_health == NodeHealth(), done.reason
            assert torn.deadline_stretch == {"load": 2 ** (gen - 1)}
            assert "deadlines.load" in done.reason
        # the next launch of this generation: its LOAD deadline is the stretched one
        launch = torn.model_copy(
            update={"phase": Phase.LAUNCH, "generation": gen + 1, "phase_since": LATE}
        )
        acked = frozenset(f"e7-g{gen + 1}-launch-n{i}" for i in IDS)
        (load,) = _states(decide(launch, _late([], acked=acked), CFG))
        lengths.append(load.phase_deadline - load.phase_since)
        d = load.model_copy(update={"phase_deadline": NOW, "phase_since": NOW - lengths[-1]})
    assert lengths[:3] == [240.0, 480.0, 960.0]
    assert torn.job_health.failures == 1 and torn.deadline_stretch == {"load": 8}
    assert "deadlines.load x8" in done.reason and "raise deadlines.load" in done.reason


def test_the_stretch_is_dropped_once_the_phase_fits_its_configured_deadline() -> None:
    """Kept while the phase needs it (a load of 300 s on every reconfiguration), dropped once
    the phase took no longer than ``deadlines.load``."""
    slow = _launching(
        Phase.LOAD, phase_since=NOW - 300, phase_deadline=NOW + 180, deadline_stretch={"load": 4}
    )
    up = obs(nodes(*IDS), [st(i, gen=2) for i in IDS])
    (verify,) = _states(decide(slow, up, CFG))
    assert verify.phase is Phase.VERIFY and verify.deadline_stretch == {"load": 4}
    fast = slow.model_copy(update={"phase_since": NOW - 60})
    (verify,) = _states(decide(fast, up, CFG))
    assert verify.deadline_stretch == {}


# ---- 5: a one-node job's failures are its node's (the planner can use a spare) ----


def test_a_one_node_jobs_sigabrt_is_charged_to_its_node() -> None:
    d = running((1,))
    done = _torn(d, obs(nodes(1, 2), [_abrt(1), st(2, state="idle")]))
    assert set(done.state.node_health) == {"n1"} and done.state.job_health == NodeHealth()


def test_a_one_node_jobs_stall_is_charged_to_its_node() -> None:
    d = _launching(Phase.VERIFY, ids=(1,))
    done = _torn(d, _late([st(1, gen=2, step=10)], ids=(1,)), NO_STRETCH)
    assert set(done.state.node_health) == {"n1"} and done.state.job_health == NodeHealth()
    assert done.state.node_health["n1"].cause.startswith("DeadlineMissed: none of the 1")


# ---- 9: a forgiven generation's stall is not counted ----


def test_a_stall_of_a_forgiven_generation_is_not_counted() -> None:
    d = _launching(Phase.VERIFY, forgiven_through=2)
    done = _torn(d, _late([st(i, gen=2, step=10) for i in IDS]), NO_STRETCH)
    assert done.state.job_health == NodeHealth()
    assert "counted against the job" not in done.reason


# ---- 12: got through first, the deadline after ----


def test_an_adopted_verify_whose_nodes_all_stepped_past_runs_though_its_deadline_passed() -> None:
    """A VERIFY begun by the old leader (epoch 6): by the time this leader adopts it every
    node reported a step past the loaded one, and the deadline has passed: it trained."""
    d = _launching(Phase.VERIFY, phase_epoch=6)
    (run,) = _states(decide(d, _late([st(i, gen=2, step=11) for i in IDS]), CFG))
    assert run.phase is Phase.RUNNING and not run.aborted


# ---- a second review: the stretch clamped, shrunk, restart-path only; at the cap the
# ---- nodes still short are charged; a loss seen late takes a stall back ----


def test_a_stored_stretch_is_clamped_to_the_configured_cap_and_bounded() -> None:
    """A state written under a cap of 8 is read under a cap of 2 (or 1: charge at once): its
    deadline uses the cap it is read under; a factor no cap allows is refused on read."""
    import pytest
    from pydantic import ValidationError

    assert PhaseDeadlines(stretch_cap=2).of(Phase.LOAD, {"load": 8}) == 240.0
    assert PhaseDeadlines(stretch_cap=1).of(Phase.LOAD, {"load": 8}) == 120.0
    assert PhaseDeadlines().of(Phase.VERIFY, {"load": 8}) == 120.0
    with pytest.raises(ValidationError, match="deadline_stretch"):
        DesiredState.model_validate({"epoch": 1, "deadline_stretch": {"load": 10**400}})


def test_the_stretch_shrinks_to_what_the_phase_needed() -> None:
    """x8 learned at a stall; the load then took 130 s of a 120 s deadline: x2 is kept, not
    x8 (every real hang would wait 8x), and not none (the next would stall again)."""
    d = _launching(
        Phase.LOAD, phase_since=NOW - 130, phase_deadline=NOW + 830, deadline_stretch={"load": 8}
    )
    (verify,) = _states(decide(d, obs(nodes(*IDS), [st(i, gen=2) for i in IDS]), CFG))
    assert verify.phase is Phase.VERIFY and verify.deadline_stretch == {"load": 2}


def test_an_in_place_launch_neither_stretches_nor_fits_the_restart_paths_deadline() -> None:
    """An in-place generation reads no checkpoint: a quick one keeps the restart path's
    stretch, and a stalled one falls back to the restart path without stretching or
    charging the job."""
    quick = _launching(
        Phase.LOAD, path="in_place", phase_since=NOW - 60, deadline_stretch={"load": 8}
    )
    (verify,) = _states(decide(quick, obs(nodes(*IDS), [st(i, gen=2) for i in IDS]), CFG))
    assert verify.deadline_stretch == {"load": 8}
    stalled = _launching(Phase.LOAD, path="in_place", deadline_stretch={"load": 8})
    done = _torn(stalled, _late([st(i, gen=2, state="idle") for i in IDS]))
    assert done.state.deadline_stretch == {"load": 8} and done.state.in_place_failed
    assert done.state.job_health == NodeHealth() and done.state.node_health == {}


def test_at_the_cap_the_nodes_still_short_while_others_got_through_are_charged() -> None:
    """n4's checkpoint mount hangs: n1-n3 load and run, n4 stays starting. Below the cap the
    deadline stretches; at it, n4 is charged (it was relaunched at 8x for ever before)."""
    sts = [*(st(i, gen=2) for i in (1, 2, 3)), st(4, gen=2, state="idle")]
    below = _torn(_launching(Phase.LOAD), _late(sts))
    assert below.state.node_health == {} and below.state.deadline_stretch == {"load": 2}
    at_cap = _launching(Phase.LOAD, deadline_stretch={"load": 8})
    done = _torn(at_cap, _late(sts))
    assert set(done.state.node_health) == {"n4"} and done.state.job_health == NodeHealth()
    assert done.state.node_health["n4"].cause.startswith("DeadlineMissed")
    assert "n4 still short" in done.reason


def test_a_loss_seen_in_the_teardown_takes_a_stall_back() -> None:
    """LOAD stalled at the cap with every node starting: the job is charged; then n4's lease
    expires (a dead VM whose lease still held at the deadline): the stall was n4's."""
    d = _launching(Phase.LOAD, deadline_stretch={"load": 8})
    done = _torn(d, _late([st(i, gen=2, state="idle") for i in IDS]))
    assert done.state.job_health.failures == 1
    gone = replace(obs(nodes(1, 2, 3), [st(i, gen=2, state="idle") for i in (1, 2, 3)]), now=LATE)
    after = _states(decide(done.state, gone, CFG))
    assert after and after[-1].job_health.failures == 0
