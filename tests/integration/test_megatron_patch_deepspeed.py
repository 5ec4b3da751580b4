"""DeepSpeed adapter: a Sailor plan through ``deepspeed.pipe.PipelineModule`` on CPU gloo.

Two pipelines of two uneven stages (layers 0..3 | 4..5), Sailor's rank order, real
multi-process DeepSpeed; the losses and the parameters must match single-process training
to rounding, within the bounds of the engine's own test (test_megatron_patch_training.py).
Skipped when deepspeed is not installed (it is optional: ``DS_BUILD_OPS=0``, pinned).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sailor.megatron_patch.engine import TrainConfig
from sailor.megatron_patch.launch import launch_local
from sailor.megatron_patch.model import tiny_model
from sailor.megatron_patch.reference import train_reference
from sailor.schemas.plan import Pipeline, Plan, ReplicaGroup, Stage

pytest.importorskip("deepspeed")

STEPS = 3
# The engine's own bounds (test_megatron_patch_training.py): fp32 rounding, not lr steps.
RTOL, ATOL = 1e-4, 2e-5


def _pipeline() -> Pipeline:
    rg = ReplicaGroup(gpu_type="cpu", zone="z")
    return Pipeline(
        stages=(
            Stage(first_layer=0, last_layer=3, replica=rg),
            Stage(first_layer=4, last_layer=5, replica=rg),
        ),
        microbatch_size=2,
        num_microbatches=2,
    )


def test_deepspeed_runs_a_sailor_plan_like_one_process(tmp_path: Path) -> None:
    """DeepSpeed's losses and parameters equal single-process AdamW's to rounding.

    Catches any change DeepSpeed makes to the update that the losses barely show: its
    default global-norm clipping at 1.0 (the adapter turns it off) moved most elements
    ~0.4 lr from the reference in 3 steps while the losses still agreed to 3e-6; a run that
    skips or shrinks an update fails too, since every tensor's median element moves by
    more than 10 times its tolerance (checked below).
    """
    plan = Plan(model="tiny-llama", global_batch_size=8, pipelines=(_pipeline(), _pipeline()))
    run = launch_local(
        plan, STEPS, tmp_path, module="sailor.megatron_patch.deepspeed_adapter", deadline_s=240
    )
    assert run.ok, (run.returncodes, run.errors)
    spec = tiny_model("tiny-llama", 8)
    ref = train_reference(spec, 8, STEPS, TrainConfig())
    init = train_reference(spec, 8, 0, TrainConfig()).params
    for rank in range(4):
        losses = [s["loss"] for s in run.steps(rank)]
        assert losses == pytest.approx(ref.losses, rel=1e-5, abs=1e-6), rank
    # Stage 0 of pipeline 1 (rank 2) holds layers 0..3, stage 1 (rank 3) layers 4..5.
    seen: set[str] = set()
    for rank, layers in ((2, {"0", "1", "2", "3"}), (3, {"4", "5"})):
        state = torch.load(tmp_path / f"state-{rank}.pt")
        assert {k.split(".")[0] for k in state} == layers
        for key, (value, _) in state.items():
            torch.testing.assert_close(value, ref.params[key], rtol=RTOL, atol=ATOL, msg=key)
            # The bound means something only if training moved the parameters by much
            # more: a DeepSpeed run that never stepped would otherwise pass.
            tol = ATOL + RTOL * ref.params[key].abs()
            moved = ((ref.params[key] - init[key]).abs() / tol).median()
            assert moved > 10, (key, float(moved))
            seen.add(key)
    assert seen == set(ref.params)
