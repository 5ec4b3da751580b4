"""The real 1F1B schedule of every rank, recorded dry and replayed under NCCL's semantics.

The schedule that ran before (a lone ``isend`` per send, kept to the end of the iteration,
and a blocking ``recv`` per receive) is reproduced here through the same API: it must fail
the replay (the deadlock NCCL would hit on a GPU), while the paired schedule must pass on
every plan shape: 2-8 stages, 1-16 microbatches, TP changes between stages, uneven splits.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from sailor.comm import api as comm
from sailor.comm.nccl_replay import CommOp, replay
from sailor.comm.strict import CommRuleError
from sailor.megatron_patch.dry_run import META, record_iteration
from sailor.megatron_patch.model import GPTStage, tiny_model
from sailor.megatron_patch.roles import RankRole
from sailor.megatron_patch.schedule import P2P, schedule_order
from sailor.megatron_patch.tp_layers import TPContext
from sailor.schemas.model import ModelSpec
from sailor.schemas.plan import Pipeline, Plan, ReplicaGroup, Stage

Get = Callable[[int], tuple[torch.Tensor, torch.Tensor]]


def _stage(a: int, b: int, tp: int = 1, recompute: bool = False) -> Stage:
    return Stage(
        first_layer=a,
        last_layer=b,
        replica=ReplicaGroup(gpu_type="A100", zone="z", tp=tp, gpus_per_node=4),
        recompute=recompute,
    )


_TPS = (1, 2, 1, 4, 2, 1, 4, 1)


def _pipeline_plan(stages: int, microbatches: int, with_tp: bool = True) -> Plan:
    """One pipeline of ``stages`` uneven stages (1 or 2 layers) and changing TP degrees."""
    bounds, first = [], 0
    for s in range(stages):
        n = 1 + s % 2
        bounds.append((first, first + n - 1))
        first += n
    pipe = Pipeline(
        stages=tuple(_stage(a, b, _TPS[s] if with_tp else 1) for s, (a, b) in enumerate(bounds)),
        microbatch_size=1,
        num_microbatches=microbatches,
    )
    return Plan(model="tiny-gpt", global_batch_size=pipe.samples, pipelines=(pipe,))


class _StandIn(nn.Module):
    """A stage with the schedule's interface and a handful of ops (fast on meta)."""

    def __init__(self, role: RankRole, hidden: int) -> None:
        super().__init__()
        self.role = role
        self.w = nn.Parameter(torch.ones(hidden, device=META))

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if self.role.is_first_stage:
            x = x.unsqueeze(-1).to(self.w.dtype) + self.w
        y = x * self.w
        return y.mean() if self.role.is_last_stage else y


def _stand_in(spec: ModelSpec, role: RankRole, tp: TPContext) -> GPTStage:
    return _StandIn(role, spec.hidden_size)  # type: ignore[return-value]


def _old_1f1b(stage: GPTStage, role: RankRole, p2p: P2P, get: Get) -> None:
    """The schedule before the fix, through ``sailor.comm``: lone sends, blocking receives.

    Used on TP-1 plans only, where every boundary is one whole-tensor message per peer.
    """
    pending: list[comm.Work] = []

    def recv(src: int | None) -> torch.Tensor:
        assert src is not None
        buf = torch.empty(p2p.shape, device=p2p.device)
        comm.wait_all(comm.batch_isend_irecv([comm.P2POp("recv", buf, src)]))
        return buf

    def send(t: torch.Tensor, dsts: tuple[int, ...]) -> None:
        for dst in dsts:
            pending.extend(comm.batch_isend_irecv([comm.P2POp("send", t.detach(), dst)]))

    saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for op, mb in schedule_order(role.num_stages, role.stage, role.num_microbatches):
        if op == "F":
            x = get(mb)[0] if role.is_first_stage else recv(role.prev_peers[0]).requires_grad_()
            out = stage(x, get(mb)[1] if role.is_last_stage else None)
            if not role.is_last_stage:
                send(out, role.next_peers)
            saved[mb] = (x, out)
        else:
            x, out = saved.pop(mb)
            if role.is_last_stage:
                out.backward()
            else:
                torch.autograd.backward(out, recv(role.next_peers[0]))
            if not role.is_first_stage:
                assert x.grad is not None
                send(x.grad, role.prev_peers)
    comm.wait_all(pending)


def _record(plan: Plan, **kw: object) -> dict[int, list[CommOp]]:
    spec = tiny_model("tiny-gpt", plan.global_batch_size)
    return record_iteration(plan, spec, build_stage=_stand_in, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("stages", range(2, 9))
def test_paired_schedule_never_deadlocks(stages: int) -> None:
    """Catches the lone-send + blocking-receive 1F1B: every (stages, microbatches) replays."""
    for m in range(1, 17):
        plan = _pipeline_plan(stages, m)
        res = replay(_record(plan))
        assert res.ok, f"(stages={stages}, microbatches={m}): {res.message}"


@pytest.mark.parametrize(("stages", "microbatches"), [(2, 2), (3, 3), (4, 8)])
def test_old_schedule_deadlocks_under_nccl_rules(stages: int, microbatches: int) -> None:
    res = replay(_record(_pipeline_plan(stages, microbatches, with_tp=False), schedule=_old_1f1b))
    assert res.status == "deadlock", res
    assert len(res.stuck) >= 2


def test_old_schedule_passes_with_one_microbatch() -> None:
    """The replay is not just refusing everything: one microbatch never crosses sends."""
    assert replay(_record(_pipeline_plan(3, 1, with_tp=False), schedule=_old_1f1b)).ok


def test_no_sent_tensor_outlives_its_exchange() -> None:
    """Catches ``_pending``: every batch of the paired schedule is waited right after it."""
    for ops in _record(_pipeline_plan(4, 6)).values():
        open_batches: set[int] = set()
        for op in ops:
            if op.kind in ("send", "recv"):
                open_batches.add(op.batch)
            elif op.kind == "wait":
                open_batches.discard(op.batch)
            else:
                assert not open_batches
        assert not open_batches


def test_wire_dtype_is_the_compute_dtype() -> None:
    logs = _record(_pipeline_plan(3, 2), wire_dtype=torch.bfloat16)
    p2p = [op for ops in logs.values() for op in ops if op.kind in ("send", "recv")]
    assert p2p and {op.dtype for op in p2p} == {"torch.bfloat16"}
    assert replay(logs).ok


def _two_pipelines() -> Plan:
    a = Pipeline(
        stages=(_stage(0, 1), _stage(2, 3, tp=2), _stage(4, 5)),
        microbatch_size=1,
        num_microbatches=4,
    )
    b = Pipeline(
        stages=(_stage(0, 3, recompute=True), _stage(4, 5, tp=2)),
        microbatch_size=2,
        num_microbatches=2,
    )
    return Plan(model="tiny-gpt", global_batch_size=a.samples + b.samples, pipelines=(a, b))


def _three_pipelines() -> Plan:
    a = Pipeline(stages=(_stage(0, 5, tp=2),), microbatch_size=1, num_microbatches=2)
    b = Pipeline(stages=(_stage(0, 2), _stage(3, 5)), microbatch_size=3, num_microbatches=1)
    c = Pipeline(
        stages=(_stage(0, 1, tp=2), _stage(2, 3, tp=4), _stage(4, 5)),
        microbatch_size=1,
        num_microbatches=5,
    )
    samples = a.samples + b.samples + c.samples
    return Plan(model="tiny-gpt", global_batch_size=samples, pipelines=(a, b, c))


@pytest.mark.parametrize(
    ("model", "make"),
    [
        ("tiny-gpt", _two_pipelines),
        ("tiny-llama", _two_pipelines),
        ("tiny-gpt", _three_pipelines),
    ],
)
def test_real_stages_on_meta_pass_replay_and_device_checks(
    model: str, make: Callable[[], Plan]
) -> None:
    """The real GPTStage (TP collectives, recompute, tied embeddings, grad sync) on meta."""
    plan = make().model_copy(update={"model": model})
    logs = record_iteration(plan, tiny_model(model, plan.global_batch_size))
    res = replay(logs)
    assert res.ok, res.message
    ops = [op for log in logs.values() for op in log if op.kind != "wait"]
    assert {op.device for op in ops if op.device} == {"meta"}
    grads = [op for op in ops if op.kind == "all_reduce" and op.numel > 1 and op.detail == "sum"]
    assert grads


def test_a_host_tensor_handed_to_a_collective_is_refused() -> None:
    """The meta trick: a ``.cpu()`` before a collective is what NCCL would refuse."""
    from sailor.comm.strict import StrictBackend

    with comm.use_backend(StrictBackend(0, META, 2)):
        comm.all_reduce(torch.zeros(2, device=META))
        with pytest.raises(CommRuleError, match="rank's device is meta"):
            comm.all_reduce(torch.zeros(2))


def test_padded_vocabulary_shards_pass_replay() -> None:
    """A vocabulary of 30 is padded to 64 rows: at TP 2 rank 1's rows of the embedding and
    the head are padding only, a branch of their own in the split cross entropy (no real
    logit to take the max of) that must still make the same three TP all-reduces; the
    tiny models' vocabulary (64) has no padding, so the grid above never takes it."""
    plan = _three_pipelines()
    spec = tiny_model("tiny-gpt", plan.global_batch_size).model_copy(update={"vocab_size": 30})
    logs = record_iteration(plan, spec)
    res = replay(logs)
    assert res.ok, res.message
    # pipeline a is one stage at TP 2 (ranks 0, 1): rank 1 holds padding rows only; its
    # cross entropy's max runs on the TP group like rank 0's
    maxes = {
        r: [op for op in logs[r] if op.kind == "all_reduce" and op.group == (0, 1)] for r in (0, 1)
    }
    assert [op.detail for op in maxes[0]] == [op.detail for op in maxes[1]]
    assert "max" in {op.detail for op in maxes[1]}
