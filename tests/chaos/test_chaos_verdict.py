"""The chaos verdict's comparison of the final checkpoint with an uninterrupted run.

Runs in ``make test`` (not a scenario: no cluster, one process): a checkpoint written from
the reference itself, once as trained and once with its AdamW moments mangled the way a
broken save or resume would leave them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from sailor.checkpoint import Checkpointer, LocalStorage, ParamState, TrainingGlobals
from sailor.megatron_patch.engine import TrainConfig
from sailor.megatron_patch.model import tiny_model
from sailor.megatron_patch.reference import ReferenceRun, train_reference
from sailor.schemas import Pipeline, Plan, ReplicaGroup, Stage
from tests.chaos.harness import ALT_MICROBATCHES, GBS, _param_diffs

STEPS = 3


def _save(root: Path, params: dict[str, ParamState]) -> None:
    """Commit ``params`` as checkpoint STEPS of a one-rank tiny-gpt plan."""
    rg = ReplicaGroup(gpu_type="cpu", zone="z", tp=1, gpus_per_node=1)
    plan = Plan(
        model="tiny-gpt",
        global_batch_size=GBS,
        pipelines=(
            Pipeline(
                stages=(Stage(first_layer=0, last_layer=5, replica=rg),),
                microbatch_size=GBS,
                num_microbatches=1,
            ),
        ),
    )
    ck = Checkpointer(LocalStorage(root), plan, 0, keep=None)
    ck.save(params, TrainingGlobals(STEPS, STEPS * GBS, {"adam_step": STEPS, "seed": 0}))
    ck.close()


@pytest.fixture(scope="module")
def refs() -> tuple[ReferenceRun, ...]:
    """The verdict's uninterrupted references (whole batch; then smaller microbatches)."""
    spec = tiny_model("tiny-gpt", GBS)
    cfg = TrainConfig(seed=0)
    ref = train_reference(spec, GBS, STEPS, cfg, params_at=STEPS)
    alts = [
        train_reference(spec, GBS, STEPS, cfg, microbatch_size=m, params_at=STEPS)
        for m in ALT_MICROBATCHES
    ]
    return ref, *alts


@pytest.fixture(scope="module")
def reference(refs: tuple[ReferenceRun, ...]) -> dict[str, ParamState]:
    ref = refs[0]
    return {k: ParamState(w, *ref.moments[k]) for k, w in ref.params.items()}


def test_a_checkpoint_of_the_uninterrupted_run_passes(
    reference: dict[str, ParamState],
    refs: tuple[ReferenceRun, ...],
    tmp_path: Path,
) -> None:
    """The floors stay below the bounds, and the reference checks equal to itself."""
    _save(tmp_path, reference)
    diffs = _param_diffs(tmp_path, STEPS, refs[0], refs[1:])
    assert diffs.weights == 0.0 and diffs.moments == 0.0, diffs
    assert diffs.weights_ok and diffs.moments_ok, diffs


def _zero_moments(ps: ParamState) -> ParamState:
    """What ``trainer_params`` saves for a parameter the optimizer holds no state for."""
    return ParamState(ps.weight, torch.zeros_like(ps.weight), torch.zeros_like(ps.weight))


def _one_decay_too_many(ps: ParamState) -> ParamState:
    """``exp_avg_sq`` decayed once more by beta2 (0.95), as if saved a step off."""
    return ParamState(ps.weight, ps.exp_avg, ps.exp_avg_sq * 0.95)


@pytest.mark.parametrize("mangle", [_zero_moments, _one_decay_too_many])
def test_moments_saved_wrong_fail_with_the_right_weights(
    reference: dict[str, ParamState],
    refs: tuple[ReferenceRun, ...],
    tmp_path: Path,
    mangle: Callable[[ParamState], ParamState],
) -> None:
    """Catches a verdict that compares weights only: these checkpoints hold the reference's
    exact weights, so only the moments can tell them from the uninterrupted run."""
    _save(tmp_path, {k: mangle(ps) for k, ps in reference.items()})
    diffs = _param_diffs(tmp_path, STEPS, refs[0], refs[1:])
    assert diffs.weights == 0.0 and diffs.weights_ok, diffs
    assert not diffs.moments_ok, diffs
