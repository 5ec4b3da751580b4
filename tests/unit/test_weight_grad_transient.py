"""The weight-gradient transient the simulator adds at a stage's backward peak, against the
engine's own layers on CPU.

With gradients kept between steps (``zero_grad(set_to_none=False)``), a layer's backward
makes its weight's gradient as autograd computes it (in the compute dtype under autocast,
then cast to fp32) and adds it into the fp32 gradient: beyond autocast's weight copies (the
layer's own is released before the cast) the GPU holds 4 bytes per element of its largest
matrix for a moment. The layers here keep few
activations (a sequence of 2, a wide vocabulary and MLP), so the transient and autocast's
weight copies are what their backward's peak is made of: the simulator's two terms must
match it, neither short nor over.
"""

from __future__ import annotations

import pytest
import torch

from sailor.megatron_patch.model import GPTStage, tiny_model
from sailor.profiler.memory import peak_growth_bytes
from sailor.simulator.memory import copied_params, weight_copy_bytes, weight_grad_bytes

SPEC = tiny_model("tiny-gpt").model_copy(
    update={
        "vocab_size": 8192,
        "hidden_size": 64,
        "ffn_hidden_size": 1024,
        "seq_length": 2,
        "precision": "bf16",
    }
)


def _peak(layer: int, autocast: bool, device: torch.device | None = None) -> int:
    device = device or torch.device("cpu")
    stage = GPTStage(SPEC, layer, layer).to(device)
    for p in stage.parameters():
        p.grad = torch.zeros_like(p)  # as between the engine's steps
    s, h, v = SPEC.seq_length, SPEC.hidden_size, SPEC.vocab_size
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, v, (1, s), generator=gen) if layer == 0 else torch.randn(1, s, h) * 1.0
    x = x.to(device)
    labels = torch.randint(0, v, (1, s), generator=gen).to(device)
    head = layer == SPEC.num_all_layers - 1

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            out = stage(x, labels) if head else stage(x)
        (out if head else out.float().sum()).backward()

    step()
    return peak_growth_bytes(step, device)


@pytest.mark.parametrize("autocast", [True, False], ids=["autocast bf16", "fp32"])
@pytest.mark.parametrize("kind", ["embedding", "block", "head"])
def test_the_backward_peak_holds_the_weight_gradient_transient(kind: str, autocast: bool) -> None:
    check_peak(kind, autocast, torch.device("cpu"))


def check_peak(kind: str, autocast: bool, device: torch.device) -> None:
    """The measured peak against the simulator's copies + transient (also run on CUDA by
    ``tests/gpu``)."""
    layer = {"embedding": 0, "block": 1, "head": SPEC.num_all_layers - 1}[kind]
    spec = SPEC if autocast else SPEC.model_copy(update={"precision": "fp32"})
    want = weight_grad_bytes(spec, layer, 1, True, "autocast")
    got = _peak(layer, autocast, device)
    # with autocast's copies of the layer's weights (the simulator's weight copies: the
    # largest one's is released before its gradient's cast) and a few activations (sequence
    # of 2); the transient alone is not more than what the layer holds at its peak
    copies = weight_copy_bytes(spec, copied_params(spec, layer, spec.layer_params(layer)))
    assert 0.97 * (want + copies) <= got <= 1.15 * (want + copies), (kind, got, want, copies)


def test_no_transient_is_added_under_fp16_optimizer() -> None:
    assert weight_grad_bytes(SPEC, SPEC.num_all_layers - 1, 1, True, "fp16_optimizer") == 0
