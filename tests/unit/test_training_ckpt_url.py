"""The worker's checkpoints go where ``checkpoint_dir`` says, a path or an fsspec URL.

``LayerCheckpointIO`` (what ``sailor worker`` saves and restores with) opens its root with
``open_storage``: ``s3://bucket/prefix`` in the controller's config must reach the object
store, not a local directory named ``s3:`` on each node (whose commit would then wait for
parts written to other nodes' disks). One rank, fsspec's in-memory filesystem standing in
for the object store: save, prune below a step, restore bitwise.
"""

from __future__ import annotations

import os
from pathlib import Path

import fsspec
import pytest
import torch

from sailor.checkpoint import committed_steps, open_storage
from sailor.megatron_patch.engine import TrainConfig, Trainer
from sailor.megatron_patch.groups import build_process_groups
from sailor.megatron_patch.model import tiny_model
from sailor.megatron_patch.roles import role_of
from sailor.training_process.ckpt_glue import LayerCheckpointIO
from tests.integration.test_in_place_worker import GBS, ONE

PLAN = ONE  # one stage of layers 0-5, 4 microbatches of 1


def _trainer(step: int = 0, consumed: int = 0, seed: int = 0) -> Trainer:
    spec = tiny_model("tiny-gpt", GBS)
    role = role_of(PLAN, 0)
    groups = build_process_groups(PLAN, role, spec.tie_embeddings, 30.0)
    return Trainer(
        PLAN, spec, role, groups, TrainConfig(seed=seed), torch.device("cpu"), step, consumed
    )


def test_saves_to_an_fsspec_url_prunes_and_restores(
    gloo_world: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    root = f"memory://sailor-ckpt-{os.getpid()}/job"
    io = LayerCheckpointIO()
    tr = _trainer()

    def hook(t: Trainer) -> bool:
        io.wait()
        if t.step in (1, 2, 3):
            io.save(t, root, prune_below=2 if t.step == 3 else -1)
        return t.step >= 3

    list(tr.run(3, hook=hook))
    io.close()
    assert not (tmp_path / "memory:").exists()  # not a local directory named after the URL
    storage = open_storage(root)
    assert committed_steps(storage) == [2, 3]  # step 1 pruned once step 3 committed
    assert fsspec.filesystem("memory").exists(f"sailor-ckpt-{os.getpid()}/job")

    again = _trainer(*io.position(root, 3))
    io.restore(again, root, 3)
    for (k, a), (k2, b) in zip(
        tr.stage.keyed_parameters(), again.stage.keyed_parameters(), strict=True
    ):
        assert k == k2 and torch.equal(a, b), k
    assert again.step == 3 and again.adam_step == tr.adam_step
    # another seed would train on other samples than the run resumed: refused, by name
    with pytest.raises(ValueError, match="trained with seed=0, this run has seed=7"):
        io.restore(_trainer(*io.position(root, 3), seed=7), root, 3)
    fsspec.filesystem("memory").rm(f"sailor-ckpt-{os.getpid()}", recursive=True)
