"""Scatter + gather delivers the exact tensor, also when its size is not a multiple of the
boundary's chunk count (the flattened tensor is padded, the padding never reaches the stage).

Ranks of a two-stage plan run as threads of this process over an in-memory backend: a send
is queued on its (sender, receiver) channel, the ``k``-th receive takes the ``k``-th send of
that channel, and an all-gather meets its group at a barrier. Fast, and values are compared
bitwise; the ordering rules are the NCCL replay's business (``test_comm_schedule``).
"""

from __future__ import annotations

import queue
import threading
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from sailor.comm import api as comm
from sailor.comm.strict import DryGroup
from sailor.megatron_patch.roles import role_of
from sailor.megatron_patch.schedule import P2P
from sailor.schemas.plan import Pipeline, Plan, ReplicaGroup, Stage


class _Received:
    def __init__(self, q: queue.Queue[torch.Tensor], buf: torch.Tensor) -> None:
        self.q, self.buf = q, buf

    def wait(self) -> None:
        got = self.q.get(timeout=30)
        if got.shape != self.buf.shape or got.dtype != self.buf.dtype:
            raise AssertionError(f"received {got.dtype}{tuple(got.shape)} into {self.buf.shape}")
        self.buf.copy_(got)


class _Sent:
    def wait(self) -> None:
        return None


class _ThreadBackend:
    """The calls P2P makes, between threads; ``local.rank`` is the calling thread's rank."""

    def __init__(self) -> None:
        self.local = threading.local()
        self.lock = threading.Lock()
        self.channels: dict[tuple[int, int], queue.Queue[torch.Tensor]] = defaultdict(queue.Queue)
        self.barriers: dict[tuple[int, ...], threading.Barrier] = {}
        self.slots: dict[tuple[int, ...], dict[int, torch.Tensor]] = defaultdict(dict)

    def _channel(self, src: int, dst: int) -> queue.Queue[torch.Tensor]:
        with self.lock:
            return self.channels[(src, dst)]

    def batch_isend_irecv(self, ops: Sequence[comm.P2POp]) -> list[Any]:
        me: int = self.local.rank
        works: list[Any] = []
        for o in ops:
            if o.kind == "send":
                self._channel(me, o.peer).put(o.tensor.clone())
                works.append(_Sent())
            else:
                works.append(_Received(self._channel(o.peer, me), o.tensor))
        return works

    def all_gather_into_tensor(self, out: torch.Tensor, tensor: torch.Tensor, group: Any) -> None:
        ranks: tuple[int, ...] = group.ranks
        with self.lock:
            barrier = self.barriers.setdefault(ranks, threading.Barrier(len(ranks), timeout=30))
        self.slots[ranks][self.local.rank] = tensor.clone()
        barrier.wait()
        out.copy_(torch.cat([self.slots[ranks][r] for r in ranks]))
        barrier.wait()


def _plan(a: int, b: int) -> Plan:
    def stage(lo: int, hi: int, tp: int) -> Stage:
        return Stage(
            first_layer=lo,
            last_layer=hi,
            replica=ReplicaGroup(gpu_type="cpu", zone="z", tp=tp, gpus_per_node=4),
        )

    pipe = Pipeline(stages=(stage(0, 2, a), stage(3, 5, b)), microbatch_size=1, num_microbatches=1)
    return Plan(model="tiny-gpt", global_batch_size=1, pipelines=(pipe,))


@pytest.mark.parametrize(
    ("a", "b", "shape"),
    [
        (2, 4, (1, 3, 5)),  # 15 elements in 4 chunks
        (4, 1, (2, 3, 5)),  # 30 in 4
        (1, 2, (1, 1, 7)),  # 7 in 2
        (4, 2, (1, 3, 3)),  # 9 in 4
        (2, 2, (2, 4, 8)),  # divisible: no padding
        (1, 1, (1, 2, 3)),
    ],
)
def test_the_whole_tensor_arrives_both_ways(a: int, b: int, shape: tuple[int, ...]) -> None:
    plan = _plan(a, b)
    x = torch.arange(1, 1 + torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    grad = -0.5 * x
    backend = _ThreadBackend()
    got: dict[int, torch.Tensor | None] = {}
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            backend.local.rank = rank
            role = role_of(plan, rank)
            group = DryGroup(role.tp_group) if role.tp > 1 else None
            p2p = P2P(role, shape, torch.device("cpu"), tp_group=group)
            if role.is_first_stage:
                p2p.send_forward(x)
                got[rank] = p2p.recv_backward()
            else:
                got[rank] = p2p.recv_forward()
                p2p.send_backward(grad)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    with comm.use_backend(backend):  # type: ignore[arg-type]
        threads = [threading.Thread(target=run, args=(r,)) for r in range(a + b)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    assert not errors, errors
    for rank in range(a + b):
        want = grad if rank < a else x
        out = got[rank]
        assert out is not None and out.shape == shape and torch.equal(out, want), rank


def test_a_tp_stage_with_neighbours_needs_its_group() -> None:
    with pytest.raises(ValueError, match="needs the TP group"):
        P2P(role_of(_plan(2, 1), 0), (1, 2, 2), torch.device("cpu"))
