"""Dynamic loss scaling's state survives a checkpoint and an in-place relayout.

An fp16 run skips the update of an iteration whose gradients overflow under the loss scale:
AdamW then has taken fewer steps than the run has iterations, and the scale moves. Before,
the first save after a skipped step refused (``AdamW steps != iteration``), a resumed run
started its scale over at 2**16, and a relayout set AdamW's step to the iteration.

fp16 needs a GPU; on CPU the same code path runs in fp32 with ``loss_scaling.mode =
'dynamic'`` and a scale near fp32's range (2**125, doubling after each good step), so that
some iterations overflow and are skipped (1, 4 and 6 from the engine's initial weights), as
an fp16 run's first steps and periodic overflows are; the tests check that some skip falls
before the checkpoint and some after the relayout. Two ranks (gloo, tiny-gpt) run three
phases one after the other, each a new trainer in a world of its own:

- **A**: two pipeline stages, 9 iterations without stopping, a checkpoint at 4;
- **in place**: the same to 4, then the worker's in-place relayout (handshake, schedule,
  exchange) to two data-parallel replicas, to 9;
- **restart**: a new trainer of the data-parallel layout resumes from A's checkpoint at 4.

In place and restart run the same layout from the same state, so their losses, skips,
scales and final weights and moments must be equal bitwise; both must skip and scale as A
does, with losses within fp32 rounding of A's (another reduction order).
"""

from __future__ import annotations

import json
import math
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from sailor.checkpoint import LocalStorage, load, read_manifest
from sailor.comm import api as comm
from sailor.megatron_patch.engine import TrainConfig, Trainer
from sailor.megatron_patch.groups import build_process_groups
from sailor.megatron_patch.in_place import Held, exchange, handshake
from sailor.megatron_patch.launch import free_port
from sailor.megatron_patch.model import tiny_model
from sailor.megatron_patch.relayout import schedule
from sailor.megatron_patch.roles import role_of
from sailor.schemas import Plan
from sailor.schemas.training import LossScalingConfig
from sailor.training_process.ckpt_glue import LayerCheckpointIO
from tests.integration.test_in_place_worker import DP2, GBS, PP2
from tests.spawn import spawn

N, END = 4, 9
CFG = TrainConfig(
    seed=0,
    loss_scaling=LossScalingConfig(mode="dynamic", initial_scale_power=125, loss_scale_window=1),
)
LOSS_ATOL = 2e-6  # A against the other layout: fp32 rounding of another reduction order


def _trainer(plan: Plan, rank: int, step: int = 0, consumed: int = 0) -> Trainer:
    """A trainer of ``plan`` in a new world (one per phase, each at its own port)."""
    spec = tiny_model(PP2.model, GBS)
    role = role_of(plan, rank)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{_PORTS.pop(0)}",
        rank=rank,
        world_size=role.world_size,
        timeout=timedelta(seconds=60),
    )
    groups = build_process_groups(plan, role, spec.tie_embeddings, 60.0)
    return Trainer(plan, spec, role, groups, CFG, torch.device("cpu"), step, consumed)


_PORTS: list[int] = []


def _scaling(tr: Trainer) -> list[Any]:
    return [tr.skipped_steps, tr.scaler.scale if tr.scaler else None, tr.adam_step]


def _rank_main(rank: int, root: str, ports: list[int]) -> None:
    """The three runs, one after the other in the same two processes (each phase builds its
    trainer from scratch in a world of its own)."""
    torch.set_num_threads(1)
    _PORTS[:] = ports
    out: dict[str, Any] = {}

    def train(tr: Trainer, until: int, ckpt: Path, save_at: tuple[int, ...]) -> list[Any]:
        io = LayerCheckpointIO(keep=None)

        def hook(t: Trainer) -> bool:
            io.wait()
            if t.step in save_at:
                io.save(t, str(ckpt))
            return bool(t.step >= until)

        rows = [
            [r.step, r.loss, r.skipped, r.loss_scale] for r in tr.run(until - tr.step, hook=hook)
        ]
        io.close()
        return rows

    # A: never stops; its checkpoint at N is what the restart resumes from
    a_dir = Path(root, "a")
    out["a"] = train(_trainer(PP2, rank), END, a_dir, (N, END))
    dist.destroy_process_group()

    # in place: the same to N, then the worker's relayout to DP2 in this process
    old = _trainer(PP2, rank)
    rows = train(old, N, Path(root, "unused"), ())
    held = Held(old, rank, old.step, old.consumed_samples, False, 0)
    dist.destroy_process_group()
    new = _trainer(DP2, rank)
    comm.all_reduce(torch.zeros(1))
    peers = handshake(held, -1, rank, 2)
    assert peers.scaling is not None and peers.old_plan is not None
    new.step, new.consumed_samples = peers.step, peers.consumed_samples
    new.load_scaling_state(peers.scaling)
    sched = schedule(peers.old_plan, peers.holders, DP2)
    st = exchange(new, old, sched, new.adam_step, new.device)
    assert not st.checkpoint_layers
    out["in_place_restored"] = _scaling(new)
    out["in_place"] = rows + train(new, END, Path(root, "in_place"), (END,))
    dist.destroy_process_group()

    # restart: DP2 resumes from A's checkpoint at N
    io = LayerCheckpointIO(keep=None)
    step, consumed = io.position(str(a_dir), N)
    tr = _trainer(DP2, rank, step, consumed)
    io.restore(tr, str(a_dir), N)
    out["restart_restored"] = _scaling(tr)
    out["restart"] = train(tr, END, Path(root, "restart"), (END,))
    if rank == 0:
        Path(root, "runs.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def _state(root: Path, step: int) -> dict[str, torch.Tensor]:
    params = load(LocalStorage(root), range(PP2.num_layers), step=step).params
    return {
        f"{k}/{kind}": params[k].tensor(kind)
        for k in params
        for kind in ("weight", "exp_avg", "exp_avg_sq")
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("loss-scale")
    ports = [free_port() for _ in range(4)]
    spawn(_rank_main, args=(str(root), ports), nprocs=2)
    got: dict[str, Any] = json.loads((root / "runs.json").read_text())
    return root, got


def test_a_run_with_skipped_steps_checkpoints_its_scale(
    runs: tuple[Path, dict[str, Any]],
) -> None:
    root, got = runs
    rows = got["a"]
    assert [r[0] for r in rows] == list(range(1, END + 1))
    skipped_before_save = [r[0] for r in rows if r[2] and r[0] <= N]
    assert skipped_before_save, "the test needs a skipped iteration before the checkpoint"
    assert all(math.isfinite(r[1]) for r in rows if not r[2])
    extra = read_manifest(LocalStorage(root / "a"), N).globals
    assert json.loads(extra["skipped_steps"]) == len(skipped_before_save)
    assert json.loads(extra["adam_step"]) == N - len(skipped_before_save)
    # the scale after iteration N is the scale iteration N+1 runs under
    assert json.loads(extra["loss_scale"])["scale"] == rows[N][3]


def test_restart_and_in_place_continue_the_scale_exactly(
    runs: tuple[Path, dict[str, Any]],
) -> None:
    _, got = runs
    a, inp, rst = got["a"], got["in_place"], got["restart"]
    assert inp[:N] == a[:N]  # the same run up to the relayout
    after = a[N:]
    skipped_at_n = sum(1 for r in a[:N] if r[2])
    for restored in (got["in_place_restored"], got["restart_restored"]):
        assert restored == [skipped_at_n, after[0][3], N - skipped_at_n]
    assert inp[N:] == rst, "in place and restart differ"
    # the same skips and scales as the run that never stopped, losses within rounding
    assert [(r[0], r[2], r[3]) for r in rst] == [(r[0], r[2], r[3]) for r in after]
    assert any(r[2] for r in after), "the test needs a skipped iteration after the relayout"
    for x, y in zip(rst, after, strict=True):
        assert abs(x[1] - y[1]) <= LOSS_ATOL, (x, y)


def test_in_place_and_restart_end_in_the_same_state(runs: tuple[Path, dict[str, Any]]) -> None:
    root, _ = runs
    x, y = _state(root / "in_place", END), _state(root / "restart", END)
    assert x.keys() == y.keys()
    for k in x:
        assert torch.equal(x[k], y[k]), k
