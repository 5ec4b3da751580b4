"""The TP region's backward all-reduce moves the compute dtype under autocast.

Layer norm is on autocast's fp32 list, so a block's normalised input enters the TP region in
fp32 and its gradient came back fp32: the all-reduce moved twice Megatron's bytes. CPU
autocast in bf16 stands in for a GPU's here; the strict dry backend records the call."""

from __future__ import annotations

import torch

from sailor.comm.api import use_backend
from sailor.comm.strict import DryGroup, StrictBackend
from sailor.megatron_patch.tp_layers import TPContext, copy_to_tp


def _reduced_dtypes(autocast: bool) -> list[str]:
    backend = StrictBackend(0, torch.device("cpu"), 2)
    tp = TPContext(size=2, rank=0, group=DryGroup((0, 1)))
    x = torch.randn(2, 4, 8, requires_grad=True)
    w = torch.randn(16, 8)
    with use_backend(backend):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = torch.nn.functional.linear(copy_to_tp(torch.layer_norm(x, (8,)), tp), w)
        y.float().sum().backward()
    assert x.grad is not None and x.grad.dtype == torch.float32  # fp32 again outside
    return [op.dtype for op in backend.ops if op.kind == "all_reduce"]


def test_the_backward_all_reduce_is_16_bit_under_autocast() -> None:
    assert _reduced_dtypes(autocast=True) == ["torch.bfloat16"]
    assert _reduced_dtypes(autocast=False) == ["torch.float32"]  # fp32 training as it was
