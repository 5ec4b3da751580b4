"""Model FLOPs of training: per token, per layer, and per GPU type of a plan.

"Model FLOPs" are those the model needs, whatever the implementation does on top
(recomputation, padding): the numerator of MFU as PaLM defines it (Chowdhery et al. 2022,
appendix B): ``6 N + 12 L h s`` per token. Counted here layer by layer from the
``ModelSpec`` so a pipeline stage's share is known: a forward pass costs 2 FLOPs per weight
of every matrix a token meets (q, k, v, attention-out, the MLP's 2 or 3 matrices, the LM
head; embedding lookups, norms, biases and activations are not counted) plus ``4 s h`` per
token and block for ``Q K^T`` and ``A V`` over the full ``s x s`` score matrix (PaLM's and
Megatron-LM's convention; causal masking would halve it); training is 3 forward passes
(forward, and backward for inputs and weights). The simulator's roofline
(``simulator/estimate_profile._layer_flops_fwd``) uses the same forward count.

Pure: no I/O, no torch.
"""

from __future__ import annotations

from sailor.schemas.model import ModelSpec
from sailor.schemas.plan import Plan

__all__ = [
    "TRAIN_OVER_FORWARD",
    "flops_per_iteration_by_gpu_type",
    "gpus_by_type",
    "layer_flops_per_token",
    "model_flops_per_token",
]

TRAIN_OVER_FORWARD = 3.0
"""Backward = 2 forwards (gradients for the inputs and for the weights)."""


def layer_flops_per_token(spec: ModelSpec, layer: int) -> float:
    """Training FLOPs of global layer ``layer`` for one token (whole layer, before TP)."""
    h, s, v = spec.hidden_size, spec.seq_length, spec.vocab_size
    kind = spec.layer_kind(layer)
    if kind == "embedding":
        return 0.0
    if kind == "head":
        fwd = 2.0 * h * v
    else:
        kv = spec.kv_heads * spec.head_dim
        n_mat = 3 if spec.activation == "swiglu" else 2
        matrices = h * (h + 2 * kv) + h * h + n_mat * h * spec.ffn_hidden_size
        fwd = 2.0 * matrices + 4.0 * s * h
    return TRAIN_OVER_FORWARD * fwd


def model_flops_per_token(spec: ModelSpec) -> float:
    """Training FLOPs of the whole model per token."""
    return sum(layer_flops_per_token(spec, i) for i in range(spec.num_all_layers))


def flops_per_iteration_by_gpu_type(plan: Plan, spec: ModelSpec) -> dict[str, float]:
    """Model FLOPs of one iteration done by each GPU type: each pipeline's tokens through
    each stage's layers, credited to the stage's GPU type (TP ranks share it)."""
    per_layer = [layer_flops_per_token(spec, i) for i in range(spec.num_all_layers)]
    out: dict[str, float] = {}
    for p in plan.pipelines:
        tokens = p.samples * spec.seq_length
        for st in p.stages:
            g = st.replica.gpu_type
            out[g] = out.get(g, 0.0) + tokens * sum(per_layer[i] for i in st.layers)
    return out


def gpus_by_type(plan: Plan) -> dict[str, int]:
    """Devices of each GPU type the plan runs on (every stage's TP degree)."""
    out: dict[str, int] = {}
    for p in plan.pipelines:
        for st in p.stages:
            out[st.replica.gpu_type] = out.get(st.replica.gpu_type, 0) + st.replica.tp
    return out
