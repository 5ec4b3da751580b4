"""The step phase's memory (``simulator.memory``): after the backward the activations are
freed, but a transient buffer takes their place: under autocast the engine's flat gradient
buffer of a sync group, then its foreach AdamW's temporary (4 B/param, one at a time);
under FP16_Optimizer the fp32 gradients. A stage whose activations are smaller than that
peaks in the step."""

from __future__ import annotations

from sailor import catalog
from sailor.schemas import LayerSize
from sailor.simulator.memory import (
    held_output_bytes,
    stage_memory,
    state_bytes_per_param,
    weight_grad_bytes,
)


def _block(params: int, act: int) -> LayerSize:
    return LayerSize(
        tp=1,
        layer=1,
        params=params,
        activation_bytes_per_sample=act,
        output_bytes_per_sample=act,
    )


def test_step_transient_per_scheme() -> None:
    bf16 = catalog.model("OPT-350").model_copy(update={"precision": "bf16"})
    fp32 = bf16.model_copy(update={"precision": "fp32"})
    assert state_bytes_per_param(bf16, "autocast") == (4, 4, 8, 4)
    assert state_bytes_per_param(fp32, "autocast") == (4, 4, 8, 4)
    assert state_bytes_per_param(bf16, "fp16_optimizer") == (6, 2, 8, 4)


def test_a_stage_with_few_activations_peaks_in_the_step() -> None:
    model = catalog.model("OPT-350").model_copy(update={"precision": "fp32"})
    params = 10_000_000

    def peak(act: int) -> tuple[int, int]:
        m = stage_memory(
            model=model,
            sizes=[_block(params, act)],
            microbatch_size=1,
            in_flight=1,
            recompute=False,
            alloc_factor=1.0,
            overhead_bytes=0,
            capacity_bytes=1 << 40,
            pipeline=0,
            stage=0,
            gpu_type="A100-40",
        )
        return m.total, m.overhead

    state = params * (4 + 4 + 8)
    # the stage ends at a block: the engine holds its fp32 output until the backward
    out = held_output_bytes(model, 1, "autocast")
    assert out == 4 * model.seq_length * model.hidden_size
    # tiny activations: the step's 4 B/param buffer sets the peak (as overhead)
    total, over = peak(1000)
    assert total == state + params * 4 and over == params * 4 - 2 * 1000 - out
    # large activations: the backward sets it, with its weight-gradient transient on top (the
    # block's largest matrix, h x f, as an fp32 gradient: fp32 training makes no cast)
    grad_t = weight_grad_bytes(model, 1, 1, True, "autocast")
    assert grad_t == 4 * model.hidden_size * model.ffn_hidden_size
    total, over = peak(10 * params)
    assert over == grad_t and total == state + 2 * 10 * params + out + grad_t
