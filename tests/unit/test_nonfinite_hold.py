"""A job whose ranks keep raising ``NonFiniteGradientsError`` is held, through the real
sequence of passes (LOAD's checkpoint -> VERIFY -> RUNNING -> the error), generation after
generation.

Before, every such generation "trained": the skipped steps advance ``step``, so VERIFY ->
RUNNING came at the first one past the checkpoint and reset the job's count
(``forgetting.trained``), and the error came ``max_skips`` + 1 iterations later. The count
never reached the policy's: relaunched at full rate forever. Now the job's record keeps
the step its agreed failure was reported at (``NodeHealth.step``) and its count until a
generation gets past that step; a changed training config (a lower learning rate) forgets
it. Each test fails on the code before. The record is the agreed error's own
(``DesiredState.agreed_health``), apart from the hangs and stalls of ``job_health``: two
non-finite failures and a hang no longer hold the job, and non-finite failures alternating
with hangs do.
"""

from __future__ import annotations

import json

from sailor.controller.agreed_health import holds
from sailor.controller.decide import decide
from sailor.controller.decision_types import SetDesired
from sailor.controller.failing_nodes import apply_readmits, forget, nothing_usable
from sailor.controller.failure_text import abort_signal
from sailor.controller.forgetting import trained
from sailor.megatron_patch.errors import failure_record
from sailor.megatron_patch.nonfinite import NonFiniteGradientsError, nonfinite_message
from sailor.schemas.runtime import AgentStatus, DesiredState, NodeHealth, Phase, ReadmitRequest
from sailor.schemas.training import BuiltinModel, OptimizerConfig, TrainingConfig
from tests.unit.test_controller_decide import CFG, NOW, _sigabrt, nodes, obs, running, st

IDS = (1, 2)
IDS_N = tuple(f"n{i}" for i in IDS)
LOAD = 30
FAILED_AT = LOAD + 4  # max_skips 3: three skipped steps, the fourth raises
NF = "NonFiniteGradientsError"


def _nonfinite(i: int, gen: int) -> AgentStatus:
    exc = NonFiniteGradientsError(nonfinite_message(FAILED_AT, 4, 3))
    rec = json.dumps(failure_record(exc, i - 1, LOAD, True))[:2000]
    return st(i, gen=gen, state="failed", step=FAILED_AT).model_copy(update={"failure": rec})


def _set(actions: list[object]) -> DesiredState:
    (state,) = [a.state for a in actions if isinstance(a, SetDesired)]
    return state


def _generation(
    gen: int, agreed: dict[str, NodeHealth], job: NodeHealth | None = None
) -> tuple[DesiredState, DesiredState]:
    """One generation through VERIFY -> RUNNING (the first skipped step) -> the error:
    the RUNNING state and the torn-down one."""
    d = running(IDS, gen=gen, phase=Phase.VERIFY, phase_deadline=NOW + 50, load_step=LOAD)
    d = d.model_copy(update={"agreed_health": agreed, "job_health": job or NodeHealth()})
    up = _set(decide(d, obs(nodes(*IDS), [st(i, gen=gen, step=LOAD + 1) for i in IDS]), CFG))
    assert up.phase is Phase.RUNNING
    torn = _set(decide(up, obs(nodes(*IDS), [_nonfinite(i, gen) for i in IDS]), CFG))
    assert torn.phase is Phase.TEARDOWN
    return up, torn


def test_the_job_is_held_after_the_policys_count_of_generations_through_verify() -> None:
    agreed: dict[str, NodeHealth] = {}
    count = CFG.exclusion.failures
    for gen in range(1, count + 1):
        up, torn = _generation(gen, agreed)
        assert up.agreed_health.get(NF, NodeHealth()).failures == gen - 1  # kept at RUNNING
        agreed = torn.agreed_health
        job = agreed[NF]
        assert torn.node_health == {} and torn.job_health == NodeHealth()  # never a node's
        assert job.failures == gen
        assert bool(holds(torn.job_health, agreed, NOW + 1)) is (gen == count), gen
    assert job.step == FAILED_AT
    assert job.exclusions == 1 and job.excluded_until == NOW + CFG.exclusion.exclude_s


def test_a_generation_that_gets_past_the_failed_step_resets_the_count() -> None:
    _, torn = _generation(1, {})
    up, _ = _generation(2, torn.agreed_health)
    assert up.agreed_health[NF].failures == 1
    at = obs(nodes(*IDS), [st(i, gen=2, step=FAILED_AT) for i in IDS])
    assert decide(up, at, CFG) == []  # at the failed step: not past it yet
    past = obs(nodes(*IDS), [st(i, gen=2, step=FAILED_AT + 1) for i in IDS])
    a = decide(up, past, CFG)
    assert [type(x) for x in a] == [SetDesired]
    assert a[0].state.agreed_health == {}  # type: ignore[union-attr]
    assert f"trained past the step where the job last raised {NF}" in a[0].reason  # type: ignore[union-attr]
    assert decide(a[0].state, past, CFG) == []  # type: ignore[union-attr]


def test_a_record_without_the_step_resets_at_the_first_step_as_before() -> None:
    """A version-3 leader's record (no ``step``): nothing says where the failure was."""
    job = NodeHealth(failures=2, generation=3, cause="NonFiniteGradientsError: at step 9")
    assert trained({}, job, ["n1"], 5) == ({}, NodeHealth())
    kept = job.model_copy(update={"step": 9})
    assert trained({}, kept, ["n1"], 9) == ({}, kept)
    assert trained({}, kept, ["n1"], 10) == ({}, NodeHealth())


def test_a_changed_training_config_forgets_the_held_job() -> None:
    """The error's message says to lower the learning rate: a controller restarted with
    another training config forgets the job's record (and its generation's reports)."""
    _, torn = _generation(3, {})
    job = NodeHealth(
        failures=3,
        generation=3,
        exclusions=1,
        excluded_until=NOW + 600,
        cause=torn.agreed_health[NF].cause,
        origin="local",
    )
    t_old = TrainingConfig(model=BuiltinModel(name="tiny-gpt"), optimizer=OptimizerConfig(lr=3e-4))
    d = torn.model_copy(update={"training": t_old, "agreed_health": {NF: job}})
    assert holds(d.job_health, d.agreed_health, NOW + 1)
    assert forget(d, nodes(*IDS), NOW + 1, CFG.exclusion, t_old) is None
    lower = t_old.model_copy(update={"optimizer": OptimizerConfig(lr=1e-4)})
    out = forget(d, nodes(*IDS), NOW + 1, CFG.exclusion, lower)
    assert out is not None
    assert out[0].agreed_health == {} and out[0].forgiven_through == 3
    assert "training config changed" in out[1] and f"the job ({NF})" in out[1]


def test_a_status_with_no_step_resets_nothing() -> None:
    """``trained_past`` with step -1 (a placed status with no workers reports no step) keeps
    the job's agreed record: -1 is no step, not a step past the failure (review)."""
    from sailor.controller.forgetting import trained_past

    cause = f"NonFiniteGradientsError: {nonfinite_message(FAILED_AT, 4, 3)}"[:200]
    job = NodeHealth(failures=2, generation=3, cause=cause, step=FAILED_AT)
    assert trained_past(job, -1) is None
    assert trained_past(job, FAILED_AT) is None
    reset = trained_past(job, FAILED_AT + 1)
    assert reset is not None and reset.failures == 0


def _hung(gen: int, agreed: dict[str, NodeHealth], job: NodeHealth) -> DesiredState:
    """One generation through VERIFY -> RUNNING that then hangs: every placed node reports
    only NCCL's watchdog's SIGABRT (the job's hang, counted in ``job_health``)."""
    d = running(IDS, gen=gen, phase=Phase.VERIFY, phase_deadline=NOW + 50, load_step=LOAD)
    d = d.model_copy(update={"agreed_health": agreed, "job_health": job})
    up = _set(decide(d, obs(nodes(*IDS), [st(i, gen=gen, step=LOAD + 1) for i in IDS]), CFG))
    aborts = [_sigabrt(i).model_copy(update={"generation": gen, "step": LOAD + 2}) for i in IDS]
    torn = _set(decide(up, obs(nodes(*IDS), aborts), CFG))
    assert torn.phase is Phase.TEARDOWN and abort_signal(torn.job_health.cause)
    return torn


def test_two_nonfinite_failures_and_a_hang_do_not_hold_the_job() -> None:
    """Before, they shared ``job_health``'s count: the hang was the third failure in a row
    and held the job as if it had diverged three times."""
    _, torn = _generation(1, {})
    _, torn = _generation(2, torn.agreed_health, torn.job_health)
    torn = _hung(3, torn.agreed_health, torn.job_health)
    assert torn.agreed_health[NF].failures == 2  # the hang neither added to it nor reset it
    assert torn.job_health.failures == 1  # the hang's own count
    assert holds(torn.job_health, torn.agreed_health, NOW + 1) == []


def test_nonfinite_failures_alternating_with_hangs_hold_the_job() -> None:
    """Before, each hang's generation reached RUNNING and its cause (a SIGABRT) was not an
    agreed one, so the shared count was reset: the job diverged for ever, relaunched at
    full rate. Now the third non-finite failure without a generation past its step holds
    it, whatever hangs came between."""
    agreed: dict[str, NodeHealth] = {}
    job = NodeHealth()
    gen = 0
    for k in range(1, CFG.exclusion.failures + 1):
        gen += 1
        _, torn = _generation(gen, agreed, job)
        agreed, job = torn.agreed_health, torn.job_health
        assert agreed[NF].failures == k
        held_by = holds(job, agreed, NOW + 1)
        assert [n for n, _ in held_by] == ([f"the job ({NF})"] if k == 3 else []), k
        if k == 3:
            break
        gen += 1
        torn = _hung(gen, agreed, job)
        agreed, job = torn.agreed_health, torn.job_health
    assert agreed[NF].excluded_until == NOW + CFG.exclusion.exclude_s
    # no layout while it holds; the reason names the agreed error's record
    why = nothing_usable(torn, nodes(*IDS), {}, frozenset(IDS_N), NOW + 1)
    assert f"held the job ({NF}) until" in why
    # an operator's `sailor node readmit --all` forgets it (and its generation's reports)
    out, outcome = apply_readmits(torn, {"r1": ReadmitRequest(all=True)})
    assert out is not None and out[0].agreed_health == {} and out[0].forgiven_through == gen
    assert f"the job ({NF})" in outcome["r1"]
