"""The worker's failure record names the step it failed at, not the last boundary's.

A real worker (``rank_main.main``, one gloo rank, tiny-gpt) fails inside its second iteration.
The record said ``step: 1`` (the boundary the iteration started from: on a run's first
iteration, the step it started from), while the engine's own errors name the iteration they
compute (``step 2: ...``). Now ``step`` is 2 and ``last_step`` keeps 1 (the last step the rank
finished: what a parent's record of a killed rank calls its step).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sailor.megatron_patch.launch import free_port
from sailor.schemas import Pipeline, Plan, ReplicaGroup, Stage
from tests.spawn import spawn

PLAN = Plan(
    plan_id="one",
    model="tiny-gpt",
    global_batch_size=2,
    pipelines=(
        Pipeline(
            stages=(
                Stage(
                    first_layer=0,
                    last_layer=5,
                    replica=ReplicaGroup(gpu_type="cpu", zone="z", tp=1, gpus_per_node=1),
                ),
            ),
            microbatch_size=1,
            num_microbatches=2,
        ),
    ),
)
FAIL_IN = 2
"""The iteration that fails (from step FAIL_IN - 1 to FAIL_IN)."""


def _worker(_rank: int, plan: str, err: str, port: int) -> None:
    from sailor.megatron_patch import engine, rank_main

    step = engine.Trainer.train_step

    def failing(self: engine.Trainer) -> engine.StepResult:
        if self.step == FAIL_IN - 1:
            raise RuntimeError(f"failed inside iteration {FAIL_IN}")
        return step(self)

    engine.Trainer.train_step = failing  # type: ignore[method-assign]
    argv = ["--plan", plan, "--rank", "0", "--world-size", "1", "--steps", "4"]
    rank_main.main([*argv, "--master", f"127.0.0.1:{port}", "--error-file", err])


def test_the_record_names_the_step_of_the_failing_iteration(tmp_path: Path) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text(PLAN.model_dump_json())
    err = tmp_path / "error-0.json"
    with pytest.raises(Exception, match=r"exit code 1|exited with"):
        spawn(_worker, args=(str(plan), str(err), free_port()), nprocs=1)
    record = json.loads(err.read_text())
    assert record["message"] == f"failed inside iteration {FAIL_IN}", record
    assert record["step"] == FAIL_IN, record
    assert record["last_step"] == FAIL_IN - 1, record
