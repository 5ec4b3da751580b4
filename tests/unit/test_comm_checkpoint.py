"""The checkpoint's TP gather under NCCL's rules (strict dry backend, tensors on meta).

Catches the gather that moved the shards to the host (``.cpu()``) before ``dist.gather`` on
the TP group: NCCL refuses host tensors, so any save with TP > 1 failed on GPUs. On meta the
old code fails at its host copy before the collective; the fixed code gathers on the rank's
device and moves the gathered pieces to the host afterwards.
"""

from __future__ import annotations

from pathlib import Path

from sailor.checkpoint.checkpointer import Checkpointer
from sailor.checkpoint.state import ParamState
from sailor.checkpoint.storage import LocalStorage
from sailor.comm.api import use_backend
from sailor.comm.nccl_replay import replay
from sailor.comm.strict import DryGroup, StrictBackend
from sailor.megatron_patch.dry_run import META, _stage_on_meta
from sailor.megatron_patch.model import tiny_model
from sailor.megatron_patch.roles import role_of
from sailor.megatron_patch.tp_layers import TPContext, tp_dim_of
from sailor.schemas.plan import Pipeline, Plan, ReplicaGroup, Stage


def _plan() -> Plan:
    def st(a: int, b: int, tp: int) -> Stage:
        return Stage(
            first_layer=a,
            last_layer=b,
            replica=ReplicaGroup(gpu_type="A100", zone="z", tp=tp, gpus_per_node=4),
        )

    pipe = Pipeline(stages=(st(0, 1, 1), st(2, 5, 2)), microbatch_size=1, num_microbatches=2)
    return Plan(model="tiny-gpt", global_batch_size=2, pipelines=(pipe,))


def test_tp_gather_runs_on_the_device_and_lands_on_the_host(tmp_path: Path) -> None:
    plan = _plan()
    spec = tiny_model("tiny-gpt", plan.global_batch_size)
    logs = {}
    written: dict[int, dict[int, dict[str, ParamState]]] = {}
    for rank in (1, 2):
        role = role_of(plan, rank)
        group = DryGroup(role.tp_group)
        stage = _stage_on_meta(spec, role, TPContext(size=2, rank=role.tp_rank, group=group))
        params = {
            name: ParamState(p.detach(), p.detach(), p.detach(), tp_dim_of(p))
            for name, p in stage.keyed_parameters()
        }
        ck = Checkpointer(LocalStorage(tmp_path), plan, rank, keep=None, tp_group=group)
        backend = StrictBackend(rank, META, 3)
        with use_backend(backend):
            got, failure = ck._snapshot(ck._by_layer(params), {})
        assert failure is None and got is not None
        written[rank] = got
        ck.close()
        logs[rank] = backend.ops
    logs[0] = []
    assert replay(logs).ok
    gathers = [op for ops in logs.values() for op in ops if op.kind == "gather"]
    assert gathers and {op.device for op in gathers} == {"meta"}
    full = {n: p for layers in written.values() for lp in layers.values() for n, p in lp.items()}
    q = full["attn_q.weight"]
    assert q.weight.device.type == "cpu"
    assert q.weight.shape[0] == spec.hidden_size
