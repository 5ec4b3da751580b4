"""A checkpoint saved before the engine padded the vocabulary still resumes.

Before the vocabulary was split over TP ranks, the embedding table and the LM head were
stored whole (``vocab_size`` rows, no TP dim). A run upgraded mid-training must resume from
such a checkpoint: ``restore_trainer`` reads those two matrices whole, pads them with zero
rows and slices its shard. One rank; the "old" checkpoint is this release's state with the
two matrices cut back to the old shape.
"""

from __future__ import annotations

from pathlib import Path

import torch

from sailor.checkpoint import Checkpointer, ParamState, TrainingGlobals, open_storage
from sailor.megatron_patch.engine import TrainConfig, Trainer
from sailor.megatron_patch.groups import build_process_groups
from sailor.megatron_patch.model import tiny_model
from sailor.megatron_patch.roles import role_of
from sailor.training_process.ckpt_glue import restore_trainer, trainer_params
from tests.integration.test_in_place_worker import GBS, ONE

VOCAB = 50  # padded to 64


def _trainer(step: int = 0, consumed: int = 0) -> Trainer:
    spec = tiny_model("tiny-gpt", GBS).model_copy(update={"vocab_size": VOCAB})
    role = role_of(ONE, 0)
    groups = build_process_groups(ONE, role, spec.tie_embeddings, 30.0)
    return Trainer(ONE, spec, role, groups, TrainConfig(), torch.device("cpu"), step, consumed)


def test_resumes_from_a_checkpoint_with_unpadded_vocabulary(
    gloo_world: None, tmp_path: Path
) -> None:
    tr = _trainer()
    list(tr.run(2))
    head = tr.stage.spec.num_all_layers - 1
    vocab_keys = {"0.wte.weight", f"{head}.lm_head.weight"}
    params = trainer_params(tr)
    old: dict[str, ParamState] = {}
    for key, ps in params.items():
        if key in vocab_keys:
            assert ps.weight.shape[0] == 64 and ps.tp_dim == 0
            assert not ps.weight[VOCAB:].any() and not ps.exp_avg_sq[VOCAB:].any()
            ps = ParamState(*(t[:VOCAB].clone() for t in (ps.weight, ps.exp_avg, ps.exp_avg_sq)))
        old[key] = ps
    root = str(tmp_path / "ckpt")
    ck = Checkpointer(open_storage(root), ONE, 0)
    extra = {"adam_step": tr.adam_step, "seed": tr.cfg.seed, **tr.scaling_state()}
    ck.save(old, TrainingGlobals(tr.step, tr.consumed_samples, extra))
    ck.wait()
    ck.close()

    again = _trainer(tr.step, tr.consumed_samples)
    restore_trainer(again, root, tr.step)
    state = again.optimizer.state
    for (k, a), (_, b) in zip(
        tr.stage.keyed_parameters(), again.stage.keyed_parameters(), strict=True
    ):
        assert torch.equal(a, b), k
        for m in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(tr.optimizer.state[a][m], state[b][m]), (k, m)
    # and it trains on, as the uninterrupted run does
    list(tr.run(1))
    list(again.run(1))
    for (k, a), (_, b) in zip(
        tr.stage.keyed_parameters(), again.stage.keyed_parameters(), strict=True
    ):
        assert torch.equal(a, b), k


def test_a_checkpoint_of_another_precision_is_refused(gloo_world: None, tmp_path: Path) -> None:
    """A checkpoint trained in bf16 is not resumed by a run computing in another precision
    (here the CPU's fp32) unless the config allows the change: a bf16 model resumed in fp16
    overflows where it did not, and the reverse changes the numerics silently."""
    import pytest

    tr = _trainer()
    list(tr.run(1))
    root = str(tmp_path / "ckpt")
    ck = Checkpointer(open_storage(root), ONE, 0)
    extra = {"adam_step": tr.adam_step, "seed": tr.cfg.seed, **tr.scaling_state()}
    assert extra["precision"] == tr.precision == "fp32"
    extra["precision"] = "bf16"  # as a GPU run of this job saved it
    ck.save(trainer_params(tr), TrainingGlobals(tr.step, tr.consumed_samples, extra))
    ck.wait()
    ck.close()
    with pytest.raises(ValueError, match=r"precision='bf16' of the state being loaded"):
        restore_trainer(_trainer(tr.step, tr.consumed_samples), root, tr.step)
    allowed = _trainer(tr.step, tr.consumed_samples)
    allowed.cfg = allowed.cfg.model_copy(update={"allow_precision_change": True})
    restore_trainer(allowed, root, tr.step)  # the config says so: resumed


def test_two_roots_keep_one_snapshot_of_host_copies(gloo_world: None, tmp_path: Path) -> None:
    """Periodic checkpoints and the controller's go to two roots, each with its own
    checkpointer; each kept the host copies of its last save for reuse, so a process held
    two snapshots (12 bytes per parameter it writes, each). The root saved to takes the
    other's copies: one snapshot's worth, whatever the roots."""
    from sailor.training_process.ckpt_glue import LayerCheckpointIO

    tr = _trainer()
    list(tr.run(1))
    io = LayerCheckpointIO()
    io.save(tr, str(tmp_path / "periodic"))
    io.wait()
    one = io.kept_bytes
    assert one > 0
    io.save(tr, str(tmp_path / "controller"))
    io.wait()
    assert io.kept_bytes == one  # before: 2 x one
    io.save(tr, str(tmp_path / "periodic"))
    io.wait()
    assert io.kept_bytes == one
    io.close()
