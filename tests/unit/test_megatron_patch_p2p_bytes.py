"""Bytes that cross each stage boundary, measured from the recorded op logs of a dry run.

Scatter + gather (``roles.boundary_pieces``): per microbatch one activation crosses a
boundary forward and one input gradient backward, whatever the TP degrees on each side;
the rest is an all-gather inside the receiving stage's TP group (one node). Before, each
receiver took a full copy: ``tp_{s+1}`` activations forward and ``tp_s`` gradients
backward. The real ``GPTStage`` runs on meta under the strict dry backend and the logs
replay clean under NCCL's rules.
"""

from __future__ import annotations

import pytest
import torch

from sailor.comm.nccl_replay import CommOp, replay
from sailor.megatron_patch.dry_run import record_iteration
from sailor.megatron_patch.model import tiny_model
from sailor.megatron_patch.roles import replica_ranks, role_of
from sailor.schemas.plan import Pipeline, Plan, ReplicaGroup, Stage


def _stage(a: int, b: int, tp: int) -> Stage:
    return Stage(
        first_layer=a,
        last_layer=b,
        replica=ReplicaGroup(gpu_type="A100", zone="z", tp=tp, gpus_per_node=4),
    )


def _pipe(tps: tuple[int, ...], mbs: int, m: int) -> Pipeline:
    """``len(tps)`` stages over the tiny model's 6 layers (embedding, 4 blocks, head)."""
    cuts = {2: [(0, 2), (3, 5)], 3: [(0, 1), (2, 3), (4, 5)], 4: [(0, 1), (2, 2), (3, 3), (4, 5)]}
    bounds = cuts[len(tps)]
    stages = tuple(_stage(a, b, tp) for (a, b), tp in zip(bounds, tps, strict=True))
    return Pipeline(stages=stages, microbatch_size=mbs, num_microbatches=m)


# Every TP change of the issue: 2 -> 4 -> 1, 4 -> 1, 1 -> 2 -> 2, 4 -> 2 -> 1 -> 4, and TP 1.
PIPELINES = (
    _pipe((2, 4, 1), 1, 3),
    _pipe((4, 1), 2, 2),
    _pipe((1, 2, 2), 1, 2),
    _pipe((4, 2, 1, 4), 1, 4),
    _pipe((1, 1), 1, 2),
)


def _bytes(ops: list[CommOp], kind: str, peers: tuple[int, ...]) -> int:
    size = {"torch.float32": 4, "torch.bfloat16": 2}
    return sum(op.numel * size[op.dtype] for op in ops if op.kind == kind and op.peer in peers)


@pytest.mark.parametrize("wire", [torch.float32, torch.bfloat16])
def test_one_activation_and_one_gradient_cross_each_boundary(wire: torch.dtype) -> None:
    plan = Plan(
        model="tiny-gpt",
        global_batch_size=sum(p.samples for p in PIPELINES),
        pipelines=PIPELINES,
    )
    spec = tiny_model("tiny-gpt", plan.global_batch_size)
    logs = record_iteration(plan, spec, wire_dtype=wire, eval_batches=0)  # training only
    res = replay(logs)
    assert res.ok, res.message
    item = torch.tensor([], dtype=wire).element_size()
    checked = 0
    for pi, pipe in enumerate(plan.pipelines):
        act = pipe.microbatch_size * spec.seq_length * spec.hidden_size * item
        m = pipe.num_microbatches
        for s in range(pipe.depth - 1):
            a, b = pipe.stages[s].replica.tp, pipe.stages[s + 1].replica.tp
            senders, receivers = replica_ranks(plan, pi, s), replica_ranks(plan, pi, s + 1)
            fwd = sum(_bytes(logs[r], "send", receivers) for r in senders) // m
            bwd = sum(_bytes(logs[r], "send", senders) for r in receivers) // m
            assert fwd == sum(_bytes(logs[r], "recv", senders) for r in receivers) // m
            assert bwd == sum(_bytes(logs[r], "recv", receivers) for r in senders) // m
            full_copies_fwd, full_copies_bwd = b * act, a * act  # one full copy per receiver
            where = f"pipeline {pi} boundary {s} (tp {a} -> {b})"
            assert fwd == act == full_copies_fwd // b, f"{where}: {fwd} B forward"
            assert bwd == act == full_copies_bwd // a, f"{where}: {bwd} B backward"
            # Each sender sends 1/a of the activation, each receiver returns 1/b of the gradient.
            assert {_bytes(logs[r], "send", receivers) // m for r in senders} == {act // a}
            assert {_bytes(logs[r], "send", senders) // m for r in receivers} == {act // b}
            checked += 1
    assert checked == 2 + 1 + 2 + 3 + 1


def test_the_gather_stays_inside_the_receiving_tp_group() -> None:
    """One all-gather of 1/tp per received tensor, on the rank's own TP group (one node)."""
    plan = Plan(model="tiny-gpt", global_batch_size=PIPELINES[0].samples, pipelines=PIPELINES[:1])
    spec = tiny_model("tiny-gpt", plan.global_batch_size)
    logs = record_iteration(plan, spec, eval_batches=0)  # training only
    assert replay(logs).ok
    act = spec.seq_length * spec.hidden_size
    for rank, ops in logs.items():
        role = role_of(plan, rank)
        gathers = [op for op in ops if op.kind == "all_gather_into_tensor"]
        received = (not role.is_first_stage) + (not role.is_last_stage)
        expected = role.num_microbatches * received if role.tp > 1 else 0
        assert len(gathers) == expected, (rank, role.stage, role.tp)
        assert all(op.group == role.tp_group and op.numel * role.tp == act for op in gathers)
