"""A checkpoint of another model is refused by name before anything is read.

Checkpoints are layout-free, not model-free. A run restarted with another model config in
the same checkpoint directory (LayerNorm changed to RMSNorm, GELU to SwiGLU, another hidden
size or depth) loaded what matched and silently dropped the rest (the LayerNorm biases), or
failed on a bare ``KeyError: '1.mlp_gate.weight'`` (counted as a node's failure and
retried), or on a GPU, where the load does not go into the parameters, on torch's "The size
of tensor a (64) must match the size of tensor b (32)" naming no tensor. Now every
difference is named in one ``ModelMismatchError``, a configuration error (``ValueError``:
the worker reports it as ``origin="config"``, so the job is held, and no step is marked
bad), raised before any byte of a shard is read.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sailor.checkpoint import Checkpointer, TrainingGlobals, open_storage, read_manifest
from sailor.checkpoint.errors import CorruptCheckpointError, ModelMismatchError
from sailor.checkpoint.fit import check_fit
from sailor.megatron_patch.engine import TrainConfig, Trainer
from sailor.megatron_patch.errors import classify
from sailor.megatron_patch.groups import build_process_groups
from sailor.megatron_patch.model import tiny_model
from sailor.megatron_patch.roles import role_of
from sailor.schemas.model import ModelSpec
from sailor.training_process.ckpt_glue import restore_trainer, trainer_params
from tests.integration.test_in_place_worker import GBS, ONE

SPEC = tiny_model("tiny-gpt", GBS)  # LayerNorm with biases, GELU MLP with biases


def _trainer(spec: ModelSpec, step: int = 0, consumed: int = 0) -> Trainer:
    role = role_of(ONE, 0)
    groups = build_process_groups(ONE, role, spec.tie_embeddings, 30.0)
    return Trainer(ONE, spec, role, groups, TrainConfig(), torch.device("cpu"), step, consumed)


def _saved(spec: ModelSpec, root: str) -> Trainer:
    tr = _trainer(spec)
    list(tr.run(1))
    ck = Checkpointer(open_storage(root), ONE, 0)
    extra = {"adam_step": tr.adam_step, "seed": tr.cfg.seed, **tr.scaling_state()}
    ck.save(trainer_params(tr), TrainingGlobals(tr.step, tr.consumed_samples, extra))
    ck.wait()
    ck.close()
    return tr


def _params(tr: Trainer) -> dict[str, torch.Tensor]:
    return {k: p.detach().clone() for k, p in tr.stage.keyed_parameters()}


@pytest.mark.parametrize(
    ("update", "named"),
    [
        # only the checkpoint has the biases: before, loaded silently without them
        ({"norm": "rmsnorm"}, r"layer 1: only the checkpoint has \['ln1.bias', 'ln2.bias'\]"),
        # the model has a gate the checkpoint lacks: before, KeyError: '1.mlp_gate.weight'
        ({"activation": "swiglu"}, r"layer 1: the checkpoint lacks \['mlp_gate.weight'\]"),
        # another width: before, a ReshardError on the first tensor read into the parameters
        ({"hidden_size": 64}, r"0.wpe.weight: shape \(16, 32\) in the checkpoint, \(16, 64\)"),
    ],
    ids=["rmsnorm-from-layernorm", "swiglu-from-gelu", "wider"],
)
def test_a_checkpoint_of_another_model_is_refused_by_name(
    gloo_world: None, tmp_path: Path, update: dict[str, object], named: str
) -> None:
    root = str(tmp_path / "ckpt")
    saved = _saved(SPEC, root)
    other = _trainer(SPEC.model_copy(update=update), saved.step, saved.consumed_samples)
    before = _params(other)
    with pytest.raises(ModelMismatchError, match=named) as info:
        restore_trainer(other, root, saved.step)
    msg = str(info.value)
    assert f"{root} step {saved.step}" in msg and "model 'tiny-gpt', plan 'one'" in msg
    # a configuration error, not a node's failure nor an unreadable step
    assert classify(info.value, in_training=False) == "config"
    assert not isinstance(info.value, CorruptCheckpointError) and not info.value.retryable
    # refused before anything was read into the live parameters
    after = _params(other)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_the_same_model_under_its_own_layout_still_restores(
    gloo_world: None, tmp_path: Path
) -> None:
    root = str(tmp_path / "ckpt")
    saved = _saved(SPEC, root)
    again = _trainer(SPEC, saved.step, saved.consumed_samples)
    restore_trainer(again, root, saved.step)
    want = _params(saved)
    assert all(torch.equal(want[k], v) for k, v in _params(again).items())


def test_check_fit_names_depth_missing_layers_and_moments(gloo_world: None, tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    saved = _saved(SPEC, root)
    m = read_manifest(open_storage(root), saved.step)
    shapes = {k: tuple(p.shape) for k, p in saved.stage.keyed_parameters()}
    check_fit(m, shapes, num_layers=m.num_layers, where="x")  # fits
    with pytest.raises(ModelMismatchError, match=r"num_layers: checkpoint 6, this model 8"):
        check_fit(m, shapes, num_layers=8, where="x")
    with pytest.raises(ModelMismatchError, match=r"layer 7: not in the checkpoint"):
        check_fit(m, {**shapes, "7.lm_head.weight": (64, 32)}, num_layers=6, where="x")
    # moments of another shape than their weight (a hand-made or foreign manifest)
    shard = m.shard_of(1)
    bad = tuple(
        t.model_copy(update={"shape": (1,)}) if t.name == "1.ln1.bias.exp_avg" else t
        for t in shard.tensors
    )
    m2 = m.model_copy(
        update={"shards": tuple(s.model_copy(update={"tensors": bad}) if s is shard else s
                                for s in m.shards)}
    )  # fmt: skip
    with pytest.raises(ModelMismatchError, match=r"1.ln1.bias: shape weight \(32,\) / exp_avg"):
        check_fit(m2, shapes, num_layers=6, where="x")
    # more than a few problems: the first named, the rest counted
    wide = {k: (*s[:-1], s[-1] + 1) for k, s in shapes.items()}
    with pytest.raises(ModelMismatchError, match=r"\(and \d+ more\)"):
        check_fit(m, wide, num_layers=6, where="x")
