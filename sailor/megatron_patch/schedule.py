"""Pipeline p2p and the 1F1B schedule of one pipeline, run by each of its ranks.

Why our own 1F1B and not ``torch.distributed.pipelining``: a Sailor plan gives each pipeline
its own microbatch size and count and each stage its own TP degree, with a scatter + gather
across every boundary, TP-degree changes included (``roles.boundary_pieces``).
``pipelining`` schedules assume one stage per rank connected to the neighbour ranks of a
uniform pipeline group and take the microbatch split from the whole batch; fitting the
mixed-TP exchange into it would mean
subclassing its stage I/O anyway. The schedule itself is ~60 lines (below) and is exact,
which is what the correctness tests check.

Schedule (PipeDream-flush / Megatron 1F1B): stage ``s`` of ``P`` runs
``w = min(P - s - 1, m)`` warm-up forwards, then alternates one forward and one backward
``m - w`` times, then runs the ``w`` remaining backwards.

Exchanges are paired as Megatron pairs them (``send_forward_recv_backward``,
``send_backward_recv_forward``, plus the lone receive/send of warm-up and cool-down), each
posted as one ``batch_isend_irecv`` and waited before the schedule goes on. With NCCL both
directions between two ranks share one ordered channel and a large send completes only when
its receive has started: a lone send followed by a blocking receive deadlocks as soon as two
neighbours do it to each other (``sailor.comm.nccl_replay`` shows it at (2 stages, 2
microbatches)). Waiting each exchange also frees every sent tensor at once instead of
holding it to the end of the iteration. Activations and gradients cross stages in the
compute dtype (``wire_dtype``): fp32 runs send fp32, bf16/fp16 runs send bf16/fp16.

Scatter + gather (Megatron's ``scatter_gather_tensors_in_pipeline``, for any pair of TP
degrees): per microbatch exactly one activation crosses a boundary forward and one input
gradient backward, cut into ``lcm(tp_s, tp_{s+1})`` chunks of the flattened tensor (padded
to a multiple of that count; the padding is dropped on arrival). Each sender sends its
``1/tp_s`` slice, split among the receivers it overlaps; each receiver gets its
``1/tp_{s+1}`` slice and the receiving stage all-gathers the slices over its TP group,
inside one node (``all_gather_into_tensor``), after the exchange's wait. The gradient goes
back along the same pairs and the sending stage all-gathers it. Before, every receiver took
a full copy: ``tp_{s+1}`` activations forward and ``tp_s`` gradients backward. The TP ranks
of a stage run the same schedule, so their all-gathers come in the same order on all of
them; ``nccl_replay`` checks the exchanges and gathers together on every plan shape.

Every receive is bounded by the process-group timeout: a dead neighbour makes it raise
instead of hanging.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from sailor.comm import api as comm
from sailor.megatron_patch.clock import SpanTimer
from sailor.megatron_patch.model import GPTStage
from sailor.megatron_patch.roles import Piece, RankRole

__all__ = ["P2P", "run_1f1b", "run_forward", "schedule_order"]


class _Untimed:
    """The timer of an untimed run: nothing measured, nothing kept."""

    def begin(self) -> None:
        return None

    def end(self, name: str, mark: object) -> None:
        return None


_UNTIMED = _Untimed()


class P2P:
    """Activation and gradient exchange of one rank with its neighbour stages.

    Scatter + gather across every boundary (``roles.boundary_pieces``): a tensor is
    flattened, padded to a multiple of the boundary's chunk count, and each of this rank's
    pieces goes to its peer; a receiving rank fills its own slice and, if its stage has TP
    ranks, all-gathers the slices inside its TP group (``tp_group``) into the full tensor.

    Every method posts one ``batch_isend_irecv`` and waits on it (then all-gathers): when
    it returns, the sent tensors may be freed and the received one is whole. ``None``
    stands for "no such neighbour" (first stage backward, last stage forward).
    """

    def __init__(
        self,
        role: RankRole,
        shape: tuple[int, ...],
        device: torch.device,
        wire_dtype: torch.dtype = torch.float32,
        tp_group: Any = None,
    ) -> None:
        if role.tp > 1 and role.num_stages > 1 and tp_group is None:
            raise ValueError(
                f"rank {role.rank}: stage {role.stage} has tp={role.tp} and neighbours; "
                "its p2p all-gathers received slices and needs the TP group"
            )
        self.role = role
        self.shape = shape
        self.device = device
        self.wire_dtype = wire_dtype
        self.tp_group = tp_group
        self.numel = math.prod(shape)

    def _chunk(self, chunks: int) -> int:
        """Elements per chunk: the tensor padded up to a multiple of ``chunks``."""
        return -(-self.numel // chunks)

    def _send_ops(
        self, t: torch.Tensor | None, pieces: tuple[Piece, ...], chunks: int
    ) -> list[comm.P2POp]:
        if t is None or not pieces:
            return []
        c = self._chunk(chunks)
        flat = t.detach().to(self.wire_dtype).reshape(-1)
        if flat.numel() != self.numel:
            raise ValueError(f"rank {self.role.rank}: sending {tuple(t.shape)}, not {self.shape}")
        if c * chunks != self.numel:
            flat = torch.nn.functional.pad(flat, (0, c * chunks - self.numel))
        return [comm.P2POp("send", flat[p.lo * c : p.hi * c], p.peer) for p in pieces]

    def _recv_ops(
        self, pieces: tuple[Piece, ...], chunks: int, own: tuple[int, int]
    ) -> tuple[list[comm.P2POp], torch.Tensor | None]:
        if not pieces:
            return [], None
        c = self._chunk(chunks)
        lo = own[0]
        mine = torch.empty((own[1] - lo) * c, dtype=self.wire_dtype, device=self.device)
        ops = [comm.P2POp("recv", mine[(p.lo - lo) * c : (p.hi - lo) * c], p.peer) for p in pieces]
        return ops, mine

    def _whole(self, mine: torch.Tensor, chunks: int) -> torch.Tensor:
        """This rank's received slice, all-gathered over its TP group into the full tensor."""
        full = mine
        if self.role.tp > 1:
            full = torch.empty(self._chunk(chunks) * chunks, dtype=mine.dtype, device=self.device)
            comm.all_gather_into_tensor(full, mine, self.tp_group)
        return full[: self.numel].view(self.shape)

    def _exchange(
        self,
        t: torch.Tensor | None,
        send: tuple[tuple[Piece, ...], int],
        recv: tuple[tuple[Piece, ...], int, tuple[int, int]] | None,
    ) -> torch.Tensor | None:
        ops = self._send_ops(t, *send)
        recv_ops, mine = self._recv_ops(*recv) if recv is not None else ([], None)
        comm.wait_all(comm.batch_isend_irecv(ops + recv_ops))
        if mine is None or recv is None:
            return None
        return self._whole(mine, recv[1])

    def _from_prev(self) -> tuple[tuple[Piece, ...], int, tuple[int, int]]:
        r = self.role
        return r.prev_pieces, r.prev_chunks, r.prev_slice

    def _from_next(self) -> tuple[tuple[Piece, ...], int, tuple[int, int]]:
        r = self.role
        return r.next_pieces, r.next_chunks, r.next_slice

    def recv_forward(self) -> torch.Tensor | None:
        return self._exchange(None, ((), 1), self._from_prev())

    def send_forward(self, t: torch.Tensor | None) -> None:
        self._exchange(t, (self.role.next_pieces, self.role.next_chunks), None)

    def recv_backward(self) -> torch.Tensor | None:
        return self._exchange(None, ((), 1), self._from_next())

    def send_backward(self, t: torch.Tensor | None) -> None:
        self._exchange(t, (self.role.prev_pieces, self.role.prev_chunks), None)

    def send_forward_recv_backward(self, t: torch.Tensor | None) -> torch.Tensor | None:
        r = self.role
        return self._exchange(t, (r.next_pieces, r.next_chunks), self._from_next())

    def send_backward_recv_forward(self, t: torch.Tensor | None) -> torch.Tensor | None:
        r = self.role
        return self._exchange(t, (r.prev_pieces, r.prev_chunks), self._from_prev())


def schedule_order(num_stages: int, stage: int, num_microbatches: int) -> list[tuple[str, int]]:
    """The 1F1B order of ("F"|"B", microbatch) for one stage (pure)."""
    warm = min(num_stages - stage - 1, num_microbatches)
    order: list[tuple[str, int]] = [("F", i) for i in range(warm)]
    for i in range(num_microbatches - warm):
        order.append(("F", warm + i))
        order.append(("B", i))
    order.extend(("B", num_microbatches - warm + j) for j in range(warm))
    return order


class _Stage:
    """The forward and backward of one microbatch on this rank (no communication)."""

    def __init__(
        self,
        stage: GPTStage,
        role: RankRole,
        get_microbatch: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
        loss_scale: float,
        autocast: Callable[[], AbstractContextManager[Any]],
        total: torch.Tensor,
    ) -> None:
        self.stage, self.role, self.get = stage, role, get_microbatch
        self.loss_scale, self.autocast, self.total = loss_scale, autocast, total
        self.saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def forward(self, mb: int, received: torch.Tensor | None) -> torch.Tensor | None:
        """Run microbatch ``mb``; returns the activation to send (None on the last stage)."""
        role = self.role
        labels = None
        if received is None:
            if not role.is_first_stage:
                raise RuntimeError(f"stage {role.stage}: no activation received for mb {mb}")
            x, labels = self.get(mb)
        else:
            x = received.requires_grad_()
        if role.is_last_stage and labels is None:
            labels = self.get(mb)[1]
        with self.autocast():
            out: torch.Tensor = self.stage(x, labels if role.is_last_stage else None)
        self.saved[mb] = (x, out)
        if not role.is_last_stage:
            return out
        out = out * self.loss_scale
        self.saved[mb] = (x, out)
        # Summed on the device in float64 (as the float sum it replaces): no host sync here.
        self.total.add_(out.detach().to(self.total.dtype))
        return None

    def backward(self, mb: int, grad: torch.Tensor | None) -> torch.Tensor | None:
        """Backward of ``mb``; returns the input gradient to send (None on the first stage)."""
        x, out = self.saved.pop(mb)
        if self.role.is_last_stage:
            out.backward()  # type: ignore[no-untyped-call]
        else:
            if grad is None:
                raise RuntimeError(f"stage {self.role.stage}: no gradient received for mb {mb}")
            torch.autograd.backward(out, grad.to(out.dtype))
        if self.role.is_first_stage:
            return None
        if x.grad is None:
            raise RuntimeError(f"stage {self.role.stage}: no input gradient for mb {mb}")
        return x.grad


def run_1f1b(
    stage: GPTStage,
    role: RankRole,
    p2p: P2P,
    get_microbatch: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    loss_scale: float,
    autocast: Callable[[], AbstractContextManager[Any]] | None = None,
    timer: SpanTimer | None = None,
) -> torch.Tensor:
    """Run one iteration's forwards and backwards; gradients accumulate in ``stage``.

    ``get_microbatch(m)`` returns ``(inputs, labels)`` of microbatch ``m`` (only called on
    the first and last stage). Each microbatch's mean loss is multiplied by ``loss_scale``
    before backward. Returns the sum of the scaled losses as a float64 scalar on the
    stage's device (0 off the last stage); reading it is the caller's one host sync.
    The order of microbatches is :func:`schedule_order`'s. ``timer`` (optional) gets one
    ``fwd`` and one ``bwd`` span per microbatch (this rank's compute, data reads included)
    and one ``p2p`` span per exchange (transfers, the TP all-gather of what arrived, and any
    wait for a neighbour stage): what online calibration needs, apart.
    """
    device = p2p.device
    total = torch.zeros((), dtype=torch.float64, device=device)
    run = _Stage(stage, role, get_microbatch, loss_scale, autocast or nullcontext, total)
    t = timer or _UNTIMED
    m = role.num_microbatches
    warm = min(role.num_stages - role.stage - 1, m)
    rest = m - warm

    def fwd(i: int, x: torch.Tensor | None) -> torch.Tensor | None:
        mark = t.begin()
        out = run.forward(i, x)
        t.end("fwd", mark)
        return out

    def bwd(i: int, g: torch.Tensor | None) -> torch.Tensor | None:
        mark = t.begin()
        out = run.backward(i, g)
        t.end("bwd", mark)
        return out

    def xchg(fn: Callable[..., torch.Tensor | None], *a: torch.Tensor | None) -> Any:
        mark = t.begin()
        out = fn(*a)
        t.end("p2p", mark)
        return out

    for i in range(warm):
        xchg(p2p.send_forward, fwd(i, xchg(p2p.recv_forward)))
    received = xchg(p2p.recv_forward) if rest > 0 else None
    for i in range(rest):
        grad = xchg(p2p.send_forward_recv_backward, fwd(warm + i, received))
        dx = bwd(i, grad)
        if i == rest - 1:
            xchg(p2p.send_backward, dx)
        else:
            received = xchg(p2p.send_backward_recv_forward, dx)
    for j in range(warm):
        xchg(p2p.send_backward, bwd(rest + j, xchg(p2p.recv_backward)))
    return total


def run_forward(
    stage: GPTStage,
    role: RankRole,
    p2p: P2P,
    get_microbatch: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    loss_scale: float,
    autocast: Callable[[], AbstractContextManager[Any]] | None = None,
) -> torch.Tensor:
    """Forwards only (evaluation): every microbatch in order, no gradients kept.

    Returns the sum of the scaled microbatch losses on the last stage (0 elsewhere), as
    :func:`run_1f1b` does. Each stage receives microbatch ``i`` before it sends it on, so
    the chain of sends and receives has no cycle.
    """
    total = torch.zeros((), dtype=torch.float64, device=p2p.device)
    run = _Stage(stage, role, get_microbatch, loss_scale, autocast or nullcontext, total)
    with torch.no_grad():
        for i in range(role.num_microbatches):
            out = run.forward(i, p2p.recv_forward())
            run.saved.pop(i)
            p2p.send_forward(out)
    return total
