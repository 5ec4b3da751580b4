"""Pipeline p2p and the 1F1B schedule of one pipeline, run by each of its ranks.

Why our own 1F1B and not ``torch.distributed.pipelining``: a Sailor plan gives each pipeline
its own microbatch size and count and each stage its own TP degree, with one activation
send per receiver across a TP-degree change (``roles``). ``pipelining`` schedules assume one
stage per rank connected to the neighbour ranks of a uniform pipeline group and take the
microbatch split from the whole batch; fitting the mixed-TP fan-out into it would mean
subclassing its stage I/O anyway. The schedule itself is ~60 lines (below) and is exact,
which is what the correctness tests check.

Schedule (PipeDream-flush / Megatron 1F1B): stage ``s`` of ``P`` runs
``w = min(P - s - 1, m)`` warm-up forwards, then alternates one forward and one backward
``m - w`` times, then runs the ``w`` remaining backwards. Sends are asynchronous (their
handles are kept until the end of the iteration) and receives are blocking, so no rank can
wait on a send and the schedule cannot deadlock. Activations cross stages in fp32.

Every receive is bounded by the process-group timeout: a dead neighbour makes it raise
instead of hanging.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist

from sailor.megatron_patch.model import GPTStage
from sailor.megatron_patch.roles import RankRole

__all__ = ["P2P", "run_1f1b", "schedule_order"]

_FWD, _BWD = 0, 1


class P2P:
    """Activation and gradient exchange of one rank with its neighbour stages."""

    def __init__(self, role: RankRole, shape: tuple[int, ...], device: torch.device) -> None:
        self.role = role
        self.shape = shape
        self.device = device
        self._pending: list[tuple[Any, torch.Tensor]] = []

    def _recv(self, src: int, tag: int) -> torch.Tensor:
        buf = torch.empty(self.shape, dtype=torch.float32, device=self.device)
        dist.recv(buf, src=src, tag=tag)
        return buf

    def _send(self, t: torch.Tensor, dsts: tuple[int, ...], tag: int) -> None:
        t = t.detach().to(torch.float32).contiguous()
        for dst in dsts:
            self._pending.append((dist.isend(t, dst=dst, tag=tag), t))

    def recv_forward(self, mb: int) -> torch.Tensor:
        if self.role.fwd_recv_from is None:
            raise ValueError("the first stage receives no activations")
        return self._recv(self.role.fwd_recv_from, 2 * mb + _FWD)

    def send_forward(self, t: torch.Tensor, mb: int) -> None:
        self._send(t, self.role.fwd_send_to, 2 * mb + _FWD)

    def recv_backward(self, mb: int) -> torch.Tensor:
        if self.role.bwd_recv_from is None:
            raise ValueError("the last stage receives no gradients")
        return self._recv(self.role.bwd_recv_from, 2 * mb + _BWD)

    def send_backward(self, t: torch.Tensor, mb: int) -> None:
        self._send(t, self.role.bwd_send_to, 2 * mb + _BWD)

    def wait_sends(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()


def schedule_order(num_stages: int, stage: int, num_microbatches: int) -> list[tuple[str, int]]:
    """The 1F1B order of ("F"|"B", microbatch) for one stage (pure)."""
    warm = min(num_stages - stage - 1, num_microbatches)
    order: list[tuple[str, int]] = [("F", i) for i in range(warm)]
    for i in range(num_microbatches - warm):
        order.append(("F", warm + i))
        order.append(("B", i))
    order.extend(("B", num_microbatches - warm + j) for j in range(warm))
    return order


def run_1f1b(
    stage: GPTStage,
    role: RankRole,
    p2p: P2P,
    get_microbatch: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    loss_scale: float,
    autocast: Callable[[], AbstractContextManager[Any]] | None = None,
) -> float:
    """Run one iteration's forwards and backwards; gradients accumulate in ``stage``.

    ``get_microbatch(m)`` returns ``(inputs, labels)`` of microbatch ``m`` (only called on
    the first and last stage). Each microbatch's mean loss is multiplied by ``loss_scale``
    before backward. Returns the sum of the scaled losses (0.0 off the last stage).
    """
    ctx = autocast or nullcontext
    saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    total = 0.0
    for op, mb in schedule_order(role.num_stages, role.stage, role.num_microbatches):
        if op == "F":
            labels = None
            if role.is_first_stage:
                x, labels = get_microbatch(mb)
            else:
                x = p2p.recv_forward(mb).requires_grad_()
            if role.is_last_stage and labels is None:
                labels = get_microbatch(mb)[1]
            with ctx():
                out = stage(x, labels if role.is_last_stage else None)
            if role.is_last_stage:
                out = out * loss_scale
                total += float(out.detach())
            else:
                p2p.send_forward(out, mb)
            saved[mb] = (x, out)
        else:
            x, out = saved.pop(mb)
            if role.is_last_stage:
                out.backward()  # type: ignore[no-untyped-call]
            else:
                torch.autograd.backward(out, p2p.recv_backward(mb).to(out.dtype))
            if not role.is_first_stage:
                if x.grad is None:
                    raise RuntimeError(f"stage {role.stage}: no input gradient for mb {mb}")
                p2p.send_backward(x.grad, mb)
    return total
