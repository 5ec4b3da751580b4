"""The dry run's record of an iteration is what a real iteration issues, call by call.

Four real gloo ranks run one ``Trainer.train_step`` of a heterogeneous plan (a TP-2 stage
beside TP-1 ones, two pipelines of different depth, tied embeddings) with clipping, an
evaluation and the control request agreed in the iteration (as a worker under an agent runs
it), each rank behind a forwarding ``StrictBackend`` that logs every call. The dry run
(``dry_run.record_iteration``, every rank in this process on ``meta``) must log the same
calls in the same order on every rank: kind, group, dtype, shape, peer, batch, reduce op
(the device aside: cpu there, meta here). Then ``nccl_replay`` accepts the record. With a
loss scaler, clipping's own all-reduce follows the agreement (an iteration without
overflow). Before, the record stopped at the step agreement: no control all-reduce, no
evaluation.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from sailor.comm.api import current_backend, use_backend
from sailor.comm.nccl_replay import CommOp, replay
from sailor.comm.strict import StrictBackend, read_logs
from sailor.megatron_patch.control import ControlRequest
from sailor.megatron_patch.dry_run import record_iteration
from sailor.megatron_patch.engine import TrainConfig
from sailor.megatron_patch.model import tiny_model
from sailor.schemas import Pipeline, Plan, ReplicaGroup, Stage
from sailor.schemas.training import LossScalingConfig
from tests.gloo_world import join_gloo, tiny_trainer
from tests.spawn import spawn

TIMEOUT_S = 30.0
CPU = torch.device("cpu")


def _stage(a: int, b: int, tp: int = 1) -> Stage:
    return Stage(
        first_layer=a,
        last_layer=b,
        replica=ReplicaGroup(gpu_type="cpu", zone="z", tp=tp, gpus_per_node=4),
    )


_A = Pipeline(stages=(_stage(0, 2, tp=2), _stage(3, 5)), microbatch_size=1, num_microbatches=2)
_B = Pipeline(stages=(_stage(0, 5),), microbatch_size=1, num_microbatches=1)
PLAN = Plan(model="tiny-gpt", global_batch_size=_A.samples + _B.samples, pipelines=(_A, _B))
WORLD = len(PLAN.ranks())


def _rank(rank: int, store: str, out: str, scaler: bool) -> None:
    join_gloo(store, rank, WORLD, TIMEOUT_S)
    scaling = LossScalingConfig(mode="dynamic") if scaler else LossScalingConfig()
    cfg = TrainConfig(seed=0, clip_grad_norm=0.5, eval_every=1, loss_scaling=scaling)
    tr = tiny_trainer(PLAN, rank, cfg, TIMEOUT_S)
    tr.control_source = ControlRequest  # an agent's control file asking nothing
    backend = StrictBackend(rank, CPU, WORLD, inner=current_backend())
    with use_backend(backend):
        res = tr.train_step()
    assert res.eval_loss is not None and not res.skipped
    backend.write(out)
    dist.destroy_process_group()


def _calls(log: list[CommOp]) -> list[CommOp]:
    return [dataclasses.replace(op, device="") for op in log]


@pytest.mark.parametrize("scaler", [False, True], ids=["agreement-clips", "loss-scaler"])
def test_the_dry_record_is_a_real_iterations_calls(tmp_path: Path, scaler: bool) -> None:
    out = tmp_path / "real"
    spawn(_rank, args=(str(tmp_path / "store"), str(out), scaler), nprocs=WORLD)
    real = read_logs(out)
    spec = tiny_model(PLAN.model, PLAN.global_batch_size)
    dry = record_iteration(PLAN, spec, loss_scaler=True) if scaler else record_iteration(PLAN, spec)
    assert sorted(real) == sorted(dry) == list(range(WORLD))
    for rank in range(WORLD):
        assert _calls(dry[rank]) == _calls(real[rank]), rank
    kinds = {(op.kind, op.detail) for log in dry.values() for op in log}
    assert ("all_reduce", "max") in kinds  # the control request's
    res = replay(dry)
    assert res.ok, res.message


def test_a_negative_evaluation_is_refused() -> None:
    spec = tiny_model(PLAN.model, PLAN.global_batch_size)
    with pytest.raises(ValueError, match="eval_batches=-1"):
        record_iteration(PLAN, spec, eval_batches=-1)
