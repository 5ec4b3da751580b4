"""DeepSpeed adapter: a Sailor plan through ``deepspeed.pipe.PipelineModule`` on CPU gloo.

Two pipelines of two uneven stages (layers 0..3 | 4..5), Sailor's rank order, real
multi-process DeepSpeed; the losses and the parameters must match single-process training
to rounding, within the bounds of the engine's own test (test_megatron_patch_training.py).
Skipped when deepspeed is not installed (it is optional: ``DS_BUILD_OPS=0``, pinned).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from sailor.megatron_patch.engine import TrainConfig
from sailor.megatron_patch.launch import launch_local
from sailor.megatron_patch.model import tiny_model
from sailor.megatron_patch.reference import train_reference
from sailor.schemas.plan import Pipeline, Plan, ReplicaGroup, Stage

pytest.importorskip("deepspeed")

STEPS = 3
# the load barrier's own poll (0.05 s), not a worker's 1 s: the ranks' waits for the world
# to form and load end up to a second sooner (test_deepspeed_checkpoints.py: FAST_POLL)
FAST_POLL = ["--load-poll-s", "0.05"]
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
        plan,
        STEPS,
        tmp_path,
        module="sailor.megatron_patch.deepspeed_adapter",
        extra_args=FAST_POLL,
        deadline_s=240,
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


def test_an_id_outside_the_datas_vocabulary_is_raised_alike_on_every_rank(
    tmp_path: Path,
) -> None:
    """Two replicas; replica 1 reads, at step 1, a sample holding id 350: inside the model's
    vocabulary (400), outside the data's (296). Before, replica 1 raised alone and replica 0
    failed on as a peer (``origin=peer``, charged elsewhere); now both ranks agree before
    DeepSpeed's train_batch and raise the same LabelOutOfRangeError, nothing applied."""
    from typer.testing import CliRunner

    from sailor.cli.main import app
    from sailor.data.prepared import open_prepared
    from sailor.data.scan import id_range

    # the CLI in this process: another Python starting to import Sailor tests nothing here
    prepared = CliRunner().invoke(
        app,
        ["data", "prepare", "--builtin-corpus", "python-docs", "--out", str(tmp_path / "ds"),
         "--vocab-size", "296", "--max-bytes", "20000", "--quiet"],
    )  # fmt: skip
    assert prepared.exit_code == 0, prepared.output
    spec = tiny_model("tiny-llama", 4).model_copy(update={"vocab_size": 400})
    (tmp_path / "model.json").write_text(spec.model_dump_json())
    train = {"model": {"kind": "spec", "path": "model.json"}, "data": {"kind": "indexed",
             "prefix": "ds"}, "seed": 0}  # fmt: skip
    (tmp_path / "train.json").write_text(json.dumps(train))
    pd = open_prepared(tmp_path / "ds")
    assert pd.splits["train"].start == 0
    window = int(pd.tokens("train", spec.seq_length, 0).windows([2])[0])  # replica 1, step 1
    toks = np.memmap(tmp_path / "ds.bin", dtype=pd.dataset.dtype, mode="r+")
    toks[window * spec.seq_length + 3] = 350
    toks.flush()
    del toks
    assert id_range(pd.dataset, 296).bad == 1
    rg = ReplicaGroup(gpu_type="cpu", zone="z")
    stage = Stage(first_layer=0, last_layer=spec.num_all_layers - 1, replica=rg)
    pipe = Pipeline(stages=(stage,), microbatch_size=1, num_microbatches=2)
    plan = Plan(model=spec.name, global_batch_size=4, pipelines=(pipe, pipe))
    run = launch_local(
        plan, 2, tmp_path / "run", module="sailor.megatron_patch.deepspeed_adapter",
        extra_args=["--train-config", str(tmp_path / "train.json"), *FAST_POLL], deadline_s=200,
        timeout_s=30,
    )  # fmt: skip
    assert run.returncodes == [1, 1], (run.returncodes, run.errors)
    errors = [e or {} for e in run.errors]
    assert [e.get("error_type") for e in errors] == ["LabelOutOfRangeError"] * 2, errors
    assert errors[0]["message"] == errors[1]["message"]
    msg = errors[0]["message"]
    assert "step 1: " in msg and "read on rank 1 (" in msg and "the first id 350" in msg
    assert "outside the vocabulary [0, 296)" in msg and "nothing was applied" in msg
