"""Non-finite gradients: the skip-then-stop policy, its config, its error, and what the
controller does with that error (the job's failure, held with a backoff; never a node's).

Before, bf16 and fp32 runs had no policy (an inf or NaN gradient went into AdamW), and a
one-node job's divergence was charged to its node. Each test fails on the code before.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from pydantic import ValidationError

from sailor.controller.agreed_health import holds
from sailor.controller.forgetting import trained_agreed
from sailor.controller.node_health import ExclusionPolicy, charge
from sailor.megatron_patch.clipping import clip_by_global_norm
from sailor.megatron_patch.engine import TrainConfig
from sailor.megatron_patch.errors import classify, failure_record
from sailor.megatron_patch.model import GPTStage, tiny_model
from sailor.megatron_patch.nonfinite import (
    NonFiniteGradientsError,
    SkipStreak,
    nonfinite_message,
)
from sailor.megatron_patch.roles import role_of
from sailor.schemas.plan import Pipeline, Plan, ReplicaGroup, Stage
from sailor.schemas.runtime import DesiredState, NodeHealth
from sailor.schemas.training import BuiltinModel, NonFiniteConfig, TrainingConfig

POLICY = ExclusionPolicy(failures=2, exclude_s=100, max_exclude_s=300)


def test_up_to_max_skips_in_a_row_are_skipped_then_it_raises() -> None:
    s = SkipStreak(max_skips=2)
    s.observe(5, skipped=True)
    s.observe(6, skipped=True)
    s.observe(7, skipped=False)  # a good step ends the streak
    s.observe(8, skipped=True)
    s.observe(9, skipped=True)
    with pytest.raises(NonFiniteGradientsError) as e:
        s.observe(10, skipped=True)
    assert str(e.value) == nonfinite_message(10, 3, 2, "step 8")
    assert "step 10, 3 step(s) in a row" in str(e.value)
    assert "Lower the learning rate" in str(e.value) and "earlier checkpoint" in str(e.value)


def test_the_streak_is_carried_with_the_hosts_it_began_on_and_old_state_starts_at_zero() -> None:
    """What a checkpoint carries (``Trainer.scaling_state``): the streak and where it began,
    named once (a resumed run's ranks may be other hosts); a checkpoint written without it
    (or with no streak under way) resumes at 0."""
    calls: list[tuple[int, ...]] = []

    def where(ranks: tuple[int, ...]) -> str:
        calls.append(ranks)
        return "rank 1 (host-a)"

    s = SkipStreak(max_skips=2)
    assert s.state() == {}
    s.observe(8, skipped=True, ranks=(1,), where=where)
    s.observe(9, skipped=True, ranks=(0,), where=where)
    assert calls == [(1,)]  # named where it began, once
    resumed = SkipStreak(max_skips=2)
    resumed.load_state(s.state())
    with pytest.raises(NonFiniteGradientsError) as e:
        resumed.observe(10, skipped=True, where=lambda r: "rank 1 (another-host)")
    assert str(e.value) == nonfinite_message(10, 3, 2, "step 8 on rank 1 (host-a)")
    old = SkipStreak(max_skips=2)
    old.load_state(None)
    assert (old.streak, old.first_step, old.first_where) == (0, -1, "")
    with pytest.raises(ValueError, match="names its first step"):
        old.load_state({"streak": 2})


def test_zero_skips_fails_at_the_first_and_a_negative_limit_is_refused() -> None:
    with pytest.raises(NonFiniteGradientsError, match="step 1, 1 step"):
        SkipStreak(0).observe(1, skipped=True)
    with pytest.raises(ValueError, match="max_skips=-1"):
        SkipStreak(-1)


def test_a_loss_scalers_overflow_above_its_floor_is_not_counted() -> None:
    s = SkipStreak(max_skips=1)
    for step in range(1, 20):  # fp16's first steps: the scale halves, no streak
        s.observe(step, skipped=True, at_floor=False)
    s.observe(20, skipped=True, at_floor=True)
    with pytest.raises(NonFiniteGradientsError):
        s.observe(21, skipped=True, at_floor=True)


def test_the_limit_is_configured_and_validated() -> None:
    tc = TrainingConfig(model=BuiltinModel(name="tiny-gpt"), nonfinite=NonFiniteConfig(max_skips=7))
    assert TrainConfig.of(tc).max_nonfinite_skips == 7
    assert TrainConfig().max_nonfinite_skips == NonFiniteConfig().max_skips == 3
    with pytest.raises(ValidationError, match="max_skips"):
        NonFiniteConfig(max_skips=-1)
    with pytest.raises(ValidationError, match="max_nonfinite_skips"):
        TrainConfig(max_nonfinite_skips=-2)


def _one_rank_stage() -> tuple[GPTStage, object]:
    stage = Stage(
        first_layer=0,
        last_layer=5,
        replica=ReplicaGroup(gpu_type="A100", zone="z", tp=1, gpus_per_node=4),
    )
    pipe = Pipeline(stages=(stage,), microbatch_size=1, num_microbatches=2)
    plan = Plan(model="tiny-gpt", global_batch_size=4, pipelines=(pipe, pipe))
    spec = tiny_model("tiny-gpt", 4)
    return GPTStage(spec, 0, 5), plan


@pytest.mark.parametrize("pipeline", [0, 1])
def test_clipping_norm_is_inf_for_an_uncounted_nan_and_clips_nothing(
    monkeypatch: pytest.MonkeyPatch, pipeline: int
) -> None:
    """Pipeline 1's gradients are not counted in the norm (pipeline 0 holds the same sum):
    a NaN there still makes the norm non-finite. Nothing is scaled by a non-finite norm."""
    monkeypatch.setattr("sailor.comm.api.all_reduce", lambda t, **kw: None)
    stage, plan = _one_rank_stage()
    role = role_of(plan, pipeline)  # type: ignore[arg-type]
    for p in stage.parameters():
        p.grad = torch.ones_like(p)
    bad = next(iter(stage.parameters()))
    assert bad.grad is not None
    bad.grad[0] = math.nan
    norm = clip_by_global_norm(stage, role, 1e-3, torch.device("cpu"))
    assert not math.isfinite(norm)
    grads = [p.grad for p in stage.parameters() if p is not bad]
    assert all(g is not None and bool((g == 1).all()) for g in grads)


# ---- the controller: the error every rank raises is the job's --------------------------------


def _record(rank: int, step: int = 12) -> str:
    exc = NonFiniteGradientsError(nonfinite_message(step, 4, 3))
    return json.dumps(failure_record(exc, rank=rank, step=step, in_training=True))[:2000]


def _d(gen: int, placed: int, agreed: dict[str, NodeHealth] | None = None) -> DesiredState:
    return DesiredState(
        epoch=1,
        generation=gen,
        placement={f"n{i}": (i - 1,) for i in range(1, placed + 1)},
        agreed_health=agreed or {},
    )


def test_the_error_is_a_local_retried_failure_and_reads_alike_on_every_rank() -> None:
    exc = NonFiniteGradientsError(nonfinite_message(12, 4, 3))
    assert classify(exc, in_training=True) == "local"
    recs = [json.loads(_record(r)) for r in range(4)]
    assert all(r["retry"] for r in recs)
    assert len({r["message"] for r in recs}) == 1


@pytest.mark.parametrize("placed", [1, 3])
def test_the_job_is_charged_not_its_nodes_and_held_after_the_policys_count(placed: int) -> None:
    """Every placed node reports the error (each rank raised it): the job's failure, counted
    once a generation; at ``failures`` generations in a row the job is held (relaunching
    from the same checkpoint meets the same gradients), and no node is ever excluded. A
    one-node job too (before, its node was charged and excluded, and the job moved to a
    spare that diverged alike)."""
    agreed: dict[str, NodeHealth] = {}
    for gen in (1, 2):
        reports = {f"n{i}": _record(rank=i - 1) for i in range(1, placed + 1)}
        c = charge(_d(gen, placed, agreed), reports, 10.0 * gen, POLICY)
        assert c.health == {} and c.job == NodeHealth(), c.notes
        assert c.agreed is not None
        agreed = c.agreed
        job = agreed["NonFiniteGradientsError"]
        assert job.failures == gen and job.generation == gen
        assert job.cause.startswith("NonFiniteGradientsError: non-finite")
    assert holds(NodeHealth(), agreed, 25.0) and job.exclusions == 1
    # the backoff ends: relaunched, maybe with a new config
    assert not holds(NodeHealth(), agreed, 20.0 + 100.0)
    # a generation that trains (past its step: none known here) resets the job's streak
    assert trained_agreed(agreed, -1) == {
        "NonFiniteGradientsError": job.model_copy(update={"failures": 0})
    }


def test_the_metrics_carry_the_skipped_steps_without_a_loss_scaler_once_there_is_one() -> None:
    from sailor.megatron_patch.engine import StepResult
    from sailor.megatron_patch.rank_main import optimizer_metrics

    res = StepResult(3, 12, math.nan, 0.1, 0.05, 0.01, 0.01, 4, skipped=True)
    assert optimizer_metrics(res, 0) == {}
    assert optimizer_metrics(res, 1) == {"skipped_steps": 1}
