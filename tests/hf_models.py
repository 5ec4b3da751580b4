"""Tiny random ``transformers`` models of the four families (nothing is downloaded).

Each config exercises what its family adds to the engine: GPT-2's Conv1D layout, fused
qkv, tanh GELU and learned positions (tied); OPT's position offset of 2, post-norm blocks
without a final norm and a narrower word embedding with ``project_in``/``project_out``
(tied, ReLU); GPT-NeoX's parallel residual, partial rotary (half the head) and per-head
fused qkv (untied); Llama's RMSNorm, SwiGLU, grouped-query attention and rope theta
(untied). OPT and Llama have a pad token (its embedding row gets no gradient from the
lookup, as ``nn.Embedding(padding_idx=...)``), and the synthetic data contains it.
Dropout is 0 so the ``transformers`` model is deterministic in training mode.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

VOCAB = 96
SEQ = 16


def tiny_config(family: str) -> Any:
    import transformers

    common: dict[str, Any] = {"vocab_size": VOCAB, "bos_token_id": 0, "eos_token_id": 1}
    if family == "gpt2":
        return transformers.GPT2Config(
            n_positions=32,
            n_embd=32,
            n_layer=4,
            n_head=4,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            **common,
        )
    if family == "opt":
        return transformers.OPTConfig(
            hidden_size=32,
            num_hidden_layers=4,
            ffn_dim=64,
            max_position_embeddings=32,
            num_attention_heads=4,
            word_embed_proj_dim=16,
            do_layer_norm_before=False,
            dropout=0.0,
            pad_token_id=2,
            **common,
        )
    if family == "opt-prenorm":  # OPT-125m's block layout: pre-norm, final norm, no projections
        return transformers.OPTConfig(
            hidden_size=32,
            num_hidden_layers=4,
            ffn_dim=64,
            max_position_embeddings=32,
            num_attention_heads=4,
            dropout=0.0,
            pad_token_id=2,
            **common,
        )
    if family == "gpt_neox":
        return transformers.GPTNeoXConfig(
            hidden_size=32,
            num_hidden_layers=4,
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=32,
            rotary_pct=0.5,
            rotary_emb_base=5000,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            **common,
        )
    if family == "llama-mlp-bias":  # Llama with biases on every MLP projection
        cfg = tiny_config("llama")
        cfg.mlp_bias = True
        return cfg
    if family == "llama":
        return transformers.LlamaConfig(
            hidden_size=32,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=48,
            max_position_embeddings=32,
            rope_theta=500000.0,
            pad_token_id=2,
            **common,
        )
    raise ValueError(family)


def tiny_model(family: str, seed: int = 0) -> Any:
    """A randomly initialised causal LM of ``family`` in fp32 (training mode)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(family))
    return model.float().train()


def save_tiny(family: str, path: Path, seed: int = 0) -> Any:
    """Save a tiny model as a local directory (config.json + model.safetensors)."""
    model = tiny_model(family, seed)
    model.save_pretrained(str(path))
    return model


def lm_loss(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy of ``model`` on inputs ``x`` and labels ``y``."""
    logits = model(input_ids=x).logits.float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
