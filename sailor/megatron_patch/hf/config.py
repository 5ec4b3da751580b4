"""A ``transformers`` config -> the engine's ``ModelSpec`` and ``Architecture``.

Four families: GPT-2 (``gpt2``), OPT (``opt``), GPT-NeoX (``gpt_neox``) and Llama
(``llama``). A config field the engine cannot reproduce exactly (a rope scaling type, a
scaled-by-layer attention, a norm without affine weights, a non-zero dropout, ...) is refused
with its name and value, never approximated. Training choices that a model config does not
hold (sequence length, global batch) are arguments.

Reads the config object only: no weights, no I/O (``hf.checkpoint`` does those).
"""

from __future__ import annotations

from typing import Any

from sailor.megatron_patch.architecture import Architecture
from sailor.schemas.model import ModelSpec

__all__ = ["FAMILIES", "UnsupportedConfigError", "from_hf_config", "max_positions"]

FAMILIES = ("gpt2", "opt", "gpt_neox", "llama")
"""``config.model_type`` values the engine builds."""


class UnsupportedConfigError(ValueError):
    """A config field (named, with its value) the engine cannot reproduce exactly."""

    def __init__(self, model_type: str, field: str, value: Any, why: str) -> None:
        super().__init__(f"{model_type}: {field}={value!r} is not supported ({why})")
        self.model_type, self.field, self.value = model_type, field, value


def _refuse_if(cond: bool, cfg: Any, field: str, why: str) -> None:
    if cond:
        raise UnsupportedConfigError(cfg.model_type, field, getattr(cfg, field, None), why)


def _gelu(cfg: Any, field: str) -> tuple[str, bool]:
    """(ModelSpec activation, tanh approximation) of an HF activation name."""
    act = getattr(cfg, field)
    if act in ("gelu", "gelu_python"):
        return "gelu", False
    if act in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"):
        return "gelu", True
    if act == "relu":
        return "relu", False
    raise UnsupportedConfigError(cfg.model_type, field, act, "gelu, gelu_new or relu expected")


def _rope(cfg: Any) -> dict[str, Any]:
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    kind = params.get("rope_type", "default")
    _refuse_if(kind != "default", cfg, "rope_parameters", f"rope_type={kind!r}: only default")
    return params


def max_positions(cfg: Any) -> int:
    """The longest sequence the config's positions cover."""
    if cfg.model_type == "gpt2":
        return int(cfg.n_positions)
    return int(cfg.max_position_embeddings)


def _gpt2(cfg: Any) -> tuple[dict[str, Any], Architecture]:
    _refuse_if(
        bool(cfg.scale_attn_by_inverse_layer_idx),
        cfg,
        "scale_attn_by_inverse_layer_idx",
        "attention scaled per layer",
    )
    _refuse_if(not cfg.scale_attn_weights, cfg, "scale_attn_weights", "unscaled attention")
    act, tanh = _gelu(cfg, "activation_function")
    h = int(cfg.n_embd)
    sizes = {
        "num_layers": cfg.n_layer,
        "hidden_size": h,
        "num_heads": cfg.n_head,
        "ffn_hidden_size": cfg.n_inner or 4 * h,
        "activation": act,
        "norm": "layernorm",
        "position_embedding": "learned",
    }
    arch = Architecture(
        family="gpt2",
        norm_eps=float(cfg.layer_norm_epsilon),
        gelu_tanh=tanh,
        max_positions=int(cfg.n_positions),
    )
    return sizes, arch


def _opt(cfg: Any) -> tuple[dict[str, Any], Architecture]:
    _refuse_if(
        not cfg.layer_norm_elementwise_affine,
        cfg,
        "layer_norm_elementwise_affine",
        "norms without weights",
    )
    act, tanh = _gelu(cfg, "activation_function")
    pre = bool(cfg.do_layer_norm_before)
    h = int(cfg.hidden_size)
    width = int(cfg.word_embed_proj_dim or h)
    sizes = {
        "num_layers": cfg.num_hidden_layers,
        "hidden_size": h,
        "num_heads": cfg.num_attention_heads,
        "ffn_hidden_size": cfg.ffn_dim,
        "activation": act,
        "norm": "layernorm",
        "position_embedding": "learned",
    }
    arch = Architecture(
        family="opt",
        attn_bias=bool(cfg.enable_bias),
        mlp_bias=bool(cfg.enable_bias),
        gelu_tanh=tanh,
        pre_norm=pre,
        final_norm=pre and not getattr(cfg, "_remove_final_layer_norm", False),
        max_positions=int(cfg.max_position_embeddings),
        position_offset=2,  # OPTLearnedPositionalEmbedding: rows 0 and 1 are never used
        padding_idx=cfg.pad_token_id,
        embed_dim=None if width == h else width,
    )
    return sizes, arch


def _neox(cfg: Any) -> tuple[dict[str, Any], Architecture]:
    act, tanh = _gelu(cfg, "hidden_act")
    rope = _rope(cfg)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    rot = int(head_dim * float(rope.get("partial_rotary_factor", 1.0)))
    sizes = {
        "num_layers": cfg.num_hidden_layers,
        "hidden_size": cfg.hidden_size,
        "num_heads": cfg.num_attention_heads,
        "ffn_hidden_size": cfg.intermediate_size,
        "activation": act,
        "norm": "layernorm",
        "position_embedding": "rope",
    }
    arch = Architecture(
        family="gpt_neox",
        norm_eps=float(cfg.layer_norm_eps),
        attn_bias=bool(cfg.attention_bias),
        mlp_bias=True,
        gelu_tanh=tanh,
        parallel_residual=bool(cfg.use_parallel_residual),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        rotary_dim=None if rot == head_dim else rot,
    )
    return sizes, arch


def _llama(cfg: Any) -> tuple[dict[str, Any], Architecture]:
    _refuse_if(cfg.hidden_act != "silu", cfg, "hidden_act", "SwiGLU needs silu")
    head_dim = getattr(cfg, "head_dim", None)
    _refuse_if(
        head_dim not in (None, cfg.hidden_size // cfg.num_attention_heads),
        cfg,
        "head_dim",
        "must be hidden_size / num_attention_heads",
    )
    _refuse_if((getattr(cfg, "pretraining_tp", 1) or 1) != 1, cfg, "pretraining_tp", "must be 1")
    rope = _rope(cfg)
    kv = cfg.num_key_value_heads or cfg.num_attention_heads
    sizes = {
        "num_layers": cfg.num_hidden_layers,
        "hidden_size": cfg.hidden_size,
        "num_heads": cfg.num_attention_heads,
        "num_kv_heads": 0 if kv == cfg.num_attention_heads else kv,
        "ffn_hidden_size": cfg.intermediate_size,
        "activation": "swiglu",
        "norm": "rmsnorm",
        "position_embedding": "rope",
    }
    arch = Architecture(
        family="llama",
        norm_eps=float(cfg.rms_norm_eps),
        attn_bias=bool(cfg.attention_bias),
        mlp_bias=bool(cfg.mlp_bias),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        padding_idx=cfg.pad_token_id,
    )
    return sizes, arch


_BUILDERS = {"gpt2": _gpt2, "opt": _opt, "gpt_neox": _neox, "llama": _llama}

_DROPOUTS = {
    "gpt2": ("resid_pdrop", "embd_pdrop", "attn_pdrop"),
    "opt": ("dropout", "attention_dropout", "activation_dropout", "layerdrop"),
    "gpt_neox": ("hidden_dropout", "attention_dropout"),
    "llama": ("attention_dropout",),
}
"""The dropout (and layer-drop) fields of each family's model, which the engine does not
have: ``transformers`` and Megatron train with them, so a non-zero one is refused rather
than silently dropped (GPT-2's and OPT's defaults are 0.1)."""


def _no_dropout(cfg: Any) -> None:
    for field in _DROPOUTS[cfg.model_type]:
        value = getattr(cfg, field, 0.0) or 0.0
        _refuse_if(
            float(value) != 0.0,
            cfg,
            field,
            "the engine trains without dropout; set it to 0 in the model's config.json to "
            "train without it",
        )


def from_hf_config(
    cfg: Any,
    seq_length: int | None = None,
    global_batch_size: int = 1,
    name: str | None = None,
    precision: str = "fp16",
) -> tuple[ModelSpec, Architecture]:
    """``(ModelSpec, Architecture)`` of a ``transformers`` config (``PretrainedConfig``).

    ``seq_length`` defaults to the positions the config covers. ``precision`` is the
    requested one, as ``ModelSpec``'s: mixed by default (the plan's GPUs decide between
    bf16 and fp16; CPU ranks run fp32), ``"fp32"`` to keep full precision everywhere. (It
    was ``"fp32"``: every model loaded from a checkpoint then trained in fp32 on GPUs.)
    """
    kind = getattr(cfg, "model_type", None)
    if kind not in _BUILDERS:
        raise UnsupportedConfigError(str(kind), "model_type", kind, f"known: {list(FAMILIES)}")
    sizes, arch = _BUILDERS[kind](cfg)
    _no_dropout(cfg)
    longest = max_positions(cfg)
    seq = seq_length or longest
    if seq > longest:
        raise UnsupportedConfigError(kind, "max_position_embeddings", longest, f"< seq {seq}")
    spec = ModelSpec(
        name=name or f"hf-{kind}",
        vocab_size=int(cfg.vocab_size),
        seq_length=seq,
        tie_embeddings=bool(getattr(cfg, "tie_word_embeddings", True)),
        global_batch_size=global_batch_size,
        precision=precision,
        **sizes,
    )
    return spec, arch
