"""DeepSpeed adapter: a Sailor plan through ``deepspeed.pipe.PipelineModule`` on CPU gloo.

Two pipelines of two uneven stages (layers 0..3 | 4..5), Sailor's rank order, real
multi-process DeepSpeed; the losses must match single-process training to rounding, the
parameters to within a few learning-rate steps (see the note in the test).
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
    plan = Plan(model="tiny-llama", global_batch_size=8, pipelines=(_pipeline(), _pipeline()))
    run = launch_local(
        plan, STEPS, tmp_path, module="sailor.megatron_patch.deepspeed_adapter", deadline_s=240
    )
    assert run.ok, (run.returncodes, run.errors)
    ref = train_reference(tiny_model("tiny-llama", 8), 8, STEPS, TrainConfig())
    for rank in range(4):
        losses = [s["loss"] for s in run.steps(rank)]
        assert losses == pytest.approx(ref.losses, rel=1e-5), rank
    # Stage 0 of pipeline 1 (rank 2) holds layers 0..3, stage 1 (rank 3) layers 4..5.
    for rank, layers in ((2, {"0", "1", "2", "3"}), (3, {"4", "5"})):
        state = torch.load(tmp_path / f"state-{rank}.pt")
        assert {k.split(".")[0] for k in state} == layers
        for key, (value, _) in state.items():
            # Known gap: DeepSpeed's updates differ from plain AdamW on elements whose
            # gradient is at the scale of Adam's eps (~1e-8), by up to ~0.5 lr per step;
            # the losses agree to 1e-5. Bounded here at 3 lr-steps, not to rounding.
            torch.testing.assert_close(value, ref.params[key], rtol=0, atol=3e-3, msg=key)
