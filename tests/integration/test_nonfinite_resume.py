"""A streak of non-finite skips survives a checkpoint: two gloo ranks (tiny-gpt, PP2), rank 1's
gradient poisoned at every iteration from the second on, ``max_nonfinite_skips=3``.

The run saves at a step inside the streak (two skipped), then a new world resumes from that
checkpoint (an abort for any reason, a preemption) and meets the same gradients. The error
comes after three skips in all, at the fourth, naming the step the streak began at on rank
1's host. Before, the streak lived in the trainer's memory only: the resumed run counted from
0 and skipped three more (five in all), and the error named the resumed run's first skip, a
step past the checkpoint, so the controller's "trained past the failure" reset the job's
count too and the skips were unlimited.
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from sailor.megatron_patch.engine import TrainConfig, Trainer
from sailor.megatron_patch.groups import build_process_groups
from sailor.megatron_patch.launch import free_port
from sailor.megatron_patch.model import tiny_model
from sailor.megatron_patch.nonfinite import NonFiniteGradientsError
from sailor.megatron_patch.roles import role_of
from sailor.training_process.ckpt_glue import LayerCheckpointIO
from tests.integration.test_in_place_worker import GBS, PP2
from tests.integration.test_nonfinite_gradients import _poison

MAX_SKIPS = 3
POISONED = set(range(1, 20))
"""Iterations (``Trainer.step`` before each) whose rank-1 gradient holds a NaN: skipped at
steps 2, 3, ..."""


def _trainer(rank: int, cfg: TrainConfig, step: int = 0, consumed: int = 0) -> Trainer:
    spec = tiny_model(PP2.model, GBS)
    role = role_of(PP2, rank)
    groups = build_process_groups(PP2, role, spec.tie_embeddings, 60.0)
    return Trainer(PP2, spec, role, groups, cfg, torch.device("cpu"), step, consumed)


def _rank_main(rank: int, root: str, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=60),
    )
    cfg = TrainConfig(seed=0, max_nonfinite_skips=MAX_SKIPS)
    out: dict[str, Any] = {}
    tr = _trainer(rank, cfg)
    tr.after_grad_sync = _poison(1, POISONED)
    out["before"] = [[r.step, r.skipped] for r in tr.run(3)]  # 1 good, 2 and 3 skipped
    io = LayerCheckpointIO()
    io.save(tr, root)
    io.wait()
    io.close()
    dist.barrier()
    # the relaunch: a new trainer at the checkpoint's position, restored from it
    step, consumed = LayerCheckpointIO().position(root, 3)
    again = _trainer(rank, cfg, step, consumed)
    LayerCheckpointIO().restore(again, root, 3)
    out["resumed_streak"] = again.nonfinite.streak
    again.after_grad_sync = _poison(1, POISONED)
    try:
        again.run(10)
        out["error"] = None
    except NonFiniteGradientsError as exc:
        out["error"] = str(exc)
    out["stopped_at"], out["skipped_steps"] = again.step, again.skipped_steps
    Path(root, f"out-{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


def test_a_resumed_run_continues_the_streak_its_checkpoint_was_saved_in(tmp_path: Path) -> None:
    from tests.spawn import spawn

    spawn(_rank_main, args=(str(tmp_path), free_port()), nprocs=2)
    outs = [json.loads((tmp_path / f"out-{r}.json").read_text()) for r in (0, 1)]
    for out in outs:
        assert out["before"] == [[1, False], [2, True], [3, True]]
        assert out["resumed_streak"] == 2
        # one more skip (step 4): three in all; the fourth (step 5, its update skipped too)
        # raises
        assert (out["stopped_at"], out["skipped_steps"]) == (4, 4), out
    errors = [out["error"] for out in outs]
    assert errors[0] is not None and errors[0] == errors[1]
    assert f"step 5, 4 step(s) in a row (max_nonfinite_skips={MAX_SKIPS})" in errors[0]
    # where the streak began, before the checkpoint: rank 1 and its host
    assert "first seen at step 2 on rank 1 (" in errors[0] and "rank 0" not in errors[0]
