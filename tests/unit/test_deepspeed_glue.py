"""The DeepSpeed adapter's checkpoint IO (``training_process.deepspeed_glue``) restoring a
rank from a real checkpoint on disk, in one process (no DeepSpeed, no process group)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sailor.checkpoint import Checkpointer, LocalStorage, ParamState, TrainingGlobals
from sailor.megatron_patch.deepspeed_adapter import DSBlock, DSEmbedding, DSHead, ready_event
from sailor.megatron_patch.deepspeed_state import DeepSpeedRun
from sailor.megatron_patch.engine import TrainConfig
from sailor.megatron_patch.model import tiny_model
from sailor.schemas.data_identity import DataIdentity
from sailor.schemas.model import padded_vocab
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


def test_an_engine_checkpoint_from_before_vocabulary_padding_is_padded_on_resume(
    tmp_path: Path,
) -> None:
    """A checkpoint whose embedding and LM head have ``vocab_size`` rows (saved before the
    engine padded the vocabulary) resumes in the adapter's padded layers as the engine
    resumes it: the rows read whole, zero rows appended (weights and moments). It used to
    fail with a bare shape error."""
    spec = tiny_model("tiny-llama", GBS).model_copy(update={"vocab_size": 100})
    padded = padded_vocab(spec.vocab_size)
    assert padded > spec.vocab_size
    rg = ReplicaGroup(gpu_type="cpu", zone="z")
    last = spec.num_all_layers - 1
    stage = Stage(first_layer=0, last_layer=last, replica=rg)
    plan = Plan(
        model="tiny-llama",
        global_batch_size=GBS,
        pipelines=(Pipeline(stages=(stage,), microbatch_size=2, num_microbatches=2),),
    )
    blocks = [DSBlock(spec, i, 0) for i in range(1, spec.num_layers + 1)]
    module = torch.nn.Sequential(DSEmbedding(spec, 0), *blocks, DSHead(spec, 0))
    vocab_keys = {"0.wte.weight", f"{last}.lm_head.weight"}
    torch.manual_seed(2)
    saved = {}
    for key, p in module.named_parameters():
        t = p.detach()[: spec.vocab_size] if key in vocab_keys else p.detach()
        saved[key] = ParamState(torch.randn_like(t), torch.randn_like(t), torch.rand_like(t), None)
    ck = Checkpointer(LocalStorage(str(tmp_path)), plan, 0)
    ck.save(saved, TrainingGlobals(STEP, STEP * GBS, {"seed": 0, "adam_step": STEP}))
    ck.close()

    opt = torch.optim.AdamW(module.parameters())
    cfg = TrainConfig()
    run = DeepSpeedRun(plan, 0, module, opt, opt, cfg, "fp32", STEP, STEP * GBS, spec=spec)
    DeepSpeedLayerIO().restore(run, str(tmp_path), STEP)
    for key, p in module.named_parameters():
        st = opt.state[p]
        got = (p.detach(), st["exp_avg"], st["exp_avg_sq"])
        want = (saved[key].weight, saved[key].exp_avg, saved[key].exp_avg_sq)
        for g, w in zip(got, want, strict=True):
            if key in vocab_keys:
                assert g.shape[0] == padded, key
                torch.testing.assert_close(g[: spec.vocab_size], w, msg=key)
                assert not g[spec.vocab_size :].any(), key  # the padding is zero
            else:
                torch.testing.assert_close(g, w, msg=key)


def _synthetic(seed: int) -> DataIdentity:
    return DataIdentity(kind="synthetic", seq_length=16, seed=seed, vocab_size=64)


def test_a_resume_on_other_data_is_in_the_ready_event(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Under ``allow_data_change`` a checkpoint trained on other data (seed 0, this run's
    seed 5) resumes, and the adapter's ``ready`` event says what changed (``data_changed``,
    which the agent logs) as the engine's worker's does; before, only rank 0's stderr said
    it. The same data: no ``data_changed``."""
    module = _module()
    params = {
        k: ParamState(p.detach().clone(), torch.zeros_like(p), torch.zeros_like(p), None)
        for k, p in module.named_parameters()
    }
    ck = Checkpointer(LocalStorage(str(tmp_path)), _plan(), 0)
    ck.save(params, TrainingGlobals(STEP, STEP * GBS, {"seed": 0}, _synthetic(0)))
    ck.close()

    def resumed(seed: int) -> dict[str, object]:
        opt = torch.optim.AdamW(module.parameters())
        cfg = TrainConfig(allow_data_change=True)
        run = DeepSpeedRun(
            _plan(), 0, module, opt, opt, cfg, "fp32", STEP, STEP * GBS, data=_synthetic(seed)
        )
        DeepSpeedLayerIO().restore(run, str(tmp_path), STEP)
        return ready_event(run, "gloo", torch.device("cpu"), load_s=0.5, load_wait_s=0.1)

    ready = resumed(5)
    assert ready["data_changed"] == "data.seed: trained with seed=0, this run has seed=5"
    assert (ready["event"], ready["engine"], ready["start_step"]) == ("ready", "deepspeed", STEP)
    assert "resumed on other data" in capsys.readouterr().err
    assert "data_changed" not in resumed(0)
