"""The DeepSpeed adapter's checkpoint IO (``training_process.deepspeed_glue``) restoring a
rank from a real checkpoint on disk, in one process (no DeepSpeed, no process group)."""

from __future__ import annotations

from pathlib import Path

import torch

from sailor.checkpoint import Checkpointer, LocalStorage, ParamState, TrainingGlobals
from sailor.megatron_patch.deepspeed_state import DeepSpeedRun
from sailor.megatron_patch.engine import TrainConfig
from sailor.schemas.plan import Pipeline, Plan, ReplicaGroup, Stage
from sailor.training_process.deepspeed_glue import DeepSpeedLayerIO

STEP, GBS = 2, 4


def _plan() -> Plan:
    rg = ReplicaGroup(gpu_type="cpu", zone="z")
    pipe = Pipeline(
        stages=(Stage(first_layer=0, last_layer=1, replica=rg),),
        microbatch_size=2,
        num_microbatches=2,
    )
    return Plan(model="m", global_batch_size=GBS, pipelines=(pipe,))


def _module() -> torch.nn.Module:
    # parameters named "{layer}.{param}" as DeepSpeed's PipelineModule names them
    return torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))


def _save(root: Path, extra: dict[str, object]) -> dict[str, ParamState]:
    torch.manual_seed(1)
    params = {
        k: ParamState(torch.randn_like(p), torch.randn_like(p), torch.rand_like(p), None)
        for k, p in _module().named_parameters()
    }
    ck = Checkpointer(LocalStorage(str(root)), _plan(), 0)
    ck.save(params, TrainingGlobals(STEP, STEP * GBS, extra))
    ck.close()
    return params


def _restore(root: Path) -> DeepSpeedRun:
    module = _module()
    opt = torch.optim.AdamW(module.parameters())
    io = DeepSpeedLayerIO()
    step, consumed = io.position(str(root), STEP)
    run = DeepSpeedRun(_plan(), 0, module, opt, opt, TrainConfig(), "fp32", step, consumed)
    io.restore(run, str(root), STEP)
    return run


def test_a_checkpoint_without_adam_step_or_skipped_steps_keeps_its_moments(
    tmp_path: Path,
) -> None:
    """Globals from before ``adam_step`` and ``skipped_steps`` were recorded: nothing was
    skipped, as the engine reads them (``ckpt_glue``), so AdamW resumes at the checkpoint's
    step with its moments; it used to restart AdamW from zero moments silently."""
    saved = _save(tmp_path, {"seed": 0})
    run = _restore(tmp_path)
    assert (run.step, run.skipped_steps, run.adam_step) == (STEP, 0, STEP)
    for key, p in run.keyed_parameters():
        st = run.optimizer.state[p]
        assert float(st["step"]) == STEP
        torch.testing.assert_close(p.detach(), saved[key].weight)
        torch.testing.assert_close(st["exp_avg"], saved[key].exp_avg)
        torch.testing.assert_close(st["exp_avg_sq"], saved[key].exp_avg_sq)


def test_a_checkpoint_with_adam_step_only_skipped_the_difference(tmp_path: Path) -> None:
    _save(tmp_path, {"seed": 0, "adam_step": 1})
    run = _restore(tmp_path)
    assert (run.skipped_steps, run.adam_step) == (1, 1)
