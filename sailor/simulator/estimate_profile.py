"""Analytic per-layer profiles from the model's FLOPs and bytes and a GPU's spec sheet.

Used when a GPU type (or a TP degree) has no measured or imported profile, so that planning
and simulation work on a fresh install for every catalog GPU and model. Every value built
here is marked ``source="estimated"``; measured and imported entries always win.

The estimate is a roofline: a kernel takes the longer of its arithmetic time at peak FLOP/s
and its memory time at peak HBM bandwidth, both derated by ONE efficiency,
:data:`ROOFLINE_EFFICIENCY`. Nothing here does I/O or reads a catalog: the GPU spec is an
argument.
"""

from __future__ import annotations

from sailor.schemas import GPUSpec, LayerProfile, LayerSize, ModelSpec
from sailor.schemas.deployment import Activations

__all__ = [
    "ADAM_BYTES_PER_PARAM",
    "ROOFLINE_EFFICIENCY",
    "engine_block_bytes",
    "estimate_layer_size",
    "estimate_layer_timing",
]

ROOFLINE_EFFICIENCY = 0.5
"""Fraction of the spec-sheet peak (FLOP/s and HBM bandwidth) that training kernels reach.
Megatron-LM reports 44-52 % of A100 peak FLOP/s end to end for GPT models of 1.7B-1T
parameters (Narayanan et al., SC'21, Table 1); element-wise PyTorch kernels reach about half
of HBM bandwidth. Small models (hidden 1-2k) fall short of it, so the estimate is optimistic
for them; the profiler replaces it with measurements."""

ADAM_BYTES_PER_PARAM = 32
"""HBM traffic of one mixed-precision Adam step per parameter: read fp16 grad (2), fp32 master,
m, v (12); write fp32 master, m, v (12) and the fp16 weight copy (2); plus the fp32 gradient
cast (4). The step is memory-bound."""

_BWD_OVER_FWD = 2.0
"""Backward computes gradients of inputs and of weights: twice the forward's FLOPs and traffic."""


def _act_bytes_per_sample(model: ModelSpec, tp: int) -> float:
    """Activation bytes a transformer block keeps for backward, per sample, per TP rank.

    Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models"
    (MLSys'23), eq. 2 with tensor parallelism: s·h·(10 + 24/t + 5·a·s/(h·t)) bytes (fp16).
    """
    s, h, a = model.seq_length, model.hidden_size, model.num_heads
    return s * h * (10 + 24 / tp + 5 * a * s / (h * tp))


_ACT_TENSORS = {"gelu": 2, "relu": 1, "swiglu": 4}
"""Tensors of ``s x ffn/t`` the engine's MLP keeps per sample: GELU its input and output (the
down projection's input); ReLU its output, which serves both; SwiGLU the gate's output, the
SiLU's output, the up projection's output and their product."""


def engine_block_bytes(model: ModelSpec, tp: int) -> float:
    """Bytes per sample a block of Sailor's engine keeps for its backward, per TP rank
    (``megatron_patch.model.Block``; measured against the engine in
    ``tests/unit/test_estimate_engine_activations.py``).

    * each norm keeps its input in fp32 (the residual stream; under autocast too) and two
      fp32 statistics per token;
    * the attention and the MLP each keep their normalised input once, whole on every TP
      rank, in the compute dtype (``tp_layers.copy_to_tp`` casts it once under autocast;
      fp32 keeps the norm's output);
    * fused attention (``scaled_dot_product_attention``) keeps q, k and v (k and v
      repeated to every query head under grouped-query attention), its output and an fp32
      log-sum-exp per head and token, split over TP; the output projection's input is
      counted as a copy of that output (it is a view of it when the layout allows);
    * the MLP keeps :data:`_ACT_TENSORS` tensors of ``s x ffn/t``.

    A parallel-residual block (GPT-NeoX) normalises one input twice and keeps it once: an
    overcount of ``4·s·h``; rotary tables (per microbatch, ``s x head_dim``) are left out.
    """
    s, h, f = model.seq_length, model.hidden_size, model.ffn_hidden_size
    c = model.param_bytes()
    attn = model.num_heads * model.head_dim
    norms = 2 * (4 * s * h + 2 * 4 * s)
    inputs = 2 * c * s * h
    attention = (5 * c * s * attn + 4 * s * model.num_heads) / tp
    mlp = _ACT_TENSORS[model.activation] * c * s * f / tp
    return float(norms + inputs + attention + mlp)


def estimate_layer_size(
    model: ModelSpec,
    tp: int,
    layer: int,
    vocab_parallel: bool = True,
    activations: Activations = "megatron",
) -> LayerSize:
    """Parameters and activation sizes of one layer at TP degree ``tp`` (per TP rank).

    ``vocab_parallel`` (Megatron, Sailor's engine): the embedding and head are split over TP
    ranks by vocabulary. Else (an engine that replicates them) every TP rank holds them
    whole, and the head keeps
    the fp32 log-probabilities of the whole vocabulary (``4·s·V`` per sample) and its input
    for the backward. ``activations``: what a block keeps, Korthikanti et al.'s count for
    Megatron, or Sailor's engine's (:func:`engine_block_bytes`)."""
    kind = model.layer_kind(layer)
    s, h, v = model.seq_length, model.hidden_size, model.vocab_size
    bpe = model.param_bytes()
    params = model.layer_params(layer)
    split = tp if vocab_parallel else 1
    if kind == "embedding":
        # the vocabulary is split over TP ranks, or not; learned positions are replicated
        pos = s * h if model.position_embedding == "learned" else 0
        per_rank = (params - pos) // split + pos
        act = s * h * bpe
    elif kind == "head" and not vocab_parallel:
        per_rank = params
        act = s * v * 4 + s * h * bpe
    elif kind == "head":
        per_rank = (params - v * h) + v * h // tp
        if activations == "megatron":
            # logits in compute precision plus the fp32 softmax for the loss
            act = s * (v // tp) * (bpe + 4) + s * h * bpe
        else:
            # Sailor's engine (megatron_patch.vocab_parallel): the fp32 softmax of its rows
            # alone, the final norm's fp32 input and the head's compute-dtype input
            act = 4 * s * -(-v // tp) + s * h * (4 + bpe)
    else:
        per_rank = params // tp
        if activations == "engine":
            act = int(engine_block_bytes(model, tp))
        else:
            act = int(_act_bytes_per_sample(model, tp) * bpe / 2)
    return LayerSize(
        tp=tp,
        layer=layer,
        params=per_rank,
        activation_bytes_per_sample=int(act),
        output_bytes_per_sample=s * h * bpe,
        input_bytes_per_sample=s * h * bpe,
        source="estimated",
    )


def _layer_flops_fwd(model: ModelSpec, layer: int, mbs: int) -> float:
    """Forward FLOPs of one layer for one microbatch (whole layer, before TP split)."""
    kind = model.layer_kind(layer)
    s, h, v = model.seq_length, model.hidden_size, model.vocab_size
    tokens = mbs * s
    if kind == "embedding":
        return 0.0
    if kind == "head":
        return 2.0 * tokens * h * v
    kv = model.kv_heads * model.head_dim
    n_mat = 3 if model.activation == "swiglu" else 2
    matmul_params = h * (h + 2 * kv) + h * h + n_mat * h * model.ffn_hidden_size
    attention = 4.0 * mbs * s * s * h  # QK^T and AV
    return 2.0 * tokens * matmul_params + attention


def estimate_layer_timing(
    model: ModelSpec,
    gpu: GPUSpec,
    tp: int,
    mbs: int,
    layer: int,
    activations: Activations = "megatron",
) -> LayerProfile:
    """Roofline forward, backward and optimizer-update time of one layer (its memory
    traffic reads the activations ``activations`` counts, :func:`estimate_layer_size`)."""
    size = estimate_layer_size(model, tp, layer, activations=activations)
    peak_flops = gpu.peak_tflops(model.precision) * 1e12 * ROOFLINE_EFFICIENCY
    bw = gpu.memory_bandwidth_gbps * 1e9 * ROOFLINE_EFFICIENCY
    flops = _layer_flops_fwd(model, layer, mbs) / tp
    # forward traffic: weights read once, activations written once and read once
    traffic = size.params * model.param_bytes() + 2.0 * mbs * size.activation_bytes_per_sample
    fwd = max(flops / peak_flops, traffic / bw)
    update = size.params * ADAM_BYTES_PER_PARAM / bw
    return LayerProfile(
        gpu_type=gpu.name,
        tp=tp,
        microbatch_size=mbs,
        layer=layer,
        kind=model.layer_kind(layer),
        fwd_s=fwd,
        bwd_s=_BWD_OVER_FWD * fwd,
        update_s=update,
        source="estimated",
        precision=model.precision,
    )
