"""Hugging Face weight names and layouts <-> the engine's layer-keyed full tensors.

The engine names every parameter ``"{global_layer}.{param}"`` (0 = embedding, 1..L =
blocks, L+1 = final norm and head) with q, k and v as three ``[out, in]`` matrices. Each
family's checkpoint differs only in names and layouts, undone here:

- GPT-2 stores ``Conv1D`` weights as ``[in, out]`` (transposed) and q, k, v fused in one
  ``c_attn`` of ``[h, 3h]`` (q columns, then k, then v);
- GPT-NeoX fuses them per head: ``query_key_value`` rows are ``[head0: q, k, v, head1: ...]``;
- OPT and Llama store separate ``[out, in]`` projections under their own names.

Other spellings are read too (:func:`canonical_name`): the original GPT-2 files without the
``transformer.`` prefix, and a GPT-NeoX head named ``lm_head`` (transformers 5's name for
the ``embed_out`` of the published checkpoints, which export keeps).

Tied embeddings: a checkpoint may omit the head (``lm_head.weight``); the engine's head copy
is then the embedding. On export a tied head is left out, as ``save_pretrained`` does.

The engine's embedding table and LM head have the padded vocabulary's rows
(:mod:`~sailor.megatron_patch.vocab_parallel`): zero rows are appended on import and cut on
export.

Pure functions on tensors; no I/O, no process group.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from sailor.megatron_patch.architecture import Architecture
from sailor.megatron_patch.vocab_parallel import pad_rows, unpad_rows
from sailor.schemas.model import ModelSpec

__all__ = [
    "canonical_name",
    "engine_to_hf",
    "has_head_weight",
    "hf_layer_of",
    "hf_to_engine",
]

Tensors = Mapping[str, torch.Tensor]

# Per family: where the blocks live, the embedding/head names, and the block names that map
# one to one (engine param -> HF suffix; "T" marks a transposed Conv1D matrix).
_BLOCK_PREFIX = {
    "gpt2": "transformer.h.",
    "opt": "model.decoder.layers.",
    "gpt_neox": "gpt_neox.layers.",
    "llama": "model.layers.",
}
_EMBED = {  # engine param of layer 0 -> HF name
    "gpt2": {"wte.weight": "transformer.wte.weight", "wpe.weight": "transformer.wpe.weight"},
    "opt": {
        "wte.weight": "model.decoder.embed_tokens.weight",
        "wpe.weight": "model.decoder.embed_positions.weight",
        "project_in.weight": "model.decoder.project_in.weight",
    },
    "gpt_neox": {"wte.weight": "gpt_neox.embed_in.weight"},
    "llama": {"wte.weight": "model.embed_tokens.weight"},
}
_HEAD = {  # engine param of layer L+1 -> HF name
    "gpt2": {
        "norm.weight": "transformer.ln_f.weight",
        "norm.bias": "transformer.ln_f.bias",
        "lm_head.weight": "lm_head.weight",
    },
    "opt": {
        "norm.weight": "model.decoder.final_layer_norm.weight",
        "norm.bias": "model.decoder.final_layer_norm.bias",
        "project_out.weight": "model.decoder.project_out.weight",
        "lm_head.weight": "lm_head.weight",
    },
    "gpt_neox": {
        "norm.weight": "gpt_neox.final_layer_norm.weight",
        "norm.bias": "gpt_neox.final_layer_norm.bias",
        "lm_head.weight": "embed_out.weight",
    },
    "llama": {"norm.weight": "model.norm.weight", "lm_head.weight": "lm_head.weight"},
}
_GPT2_BARE = ("h.", "wte.", "wpe.", "ln_f.")
"""The original GPT-2 checkpoints store the base model's names without ``transformer.``."""

_LN = {
    "gpt2": ("ln_1", "ln_2"),
    "opt": ("self_attn_layer_norm", "final_layer_norm"),
    "gpt_neox": ("input_layernorm", "post_attention_layernorm"),
    "llama": ("input_layernorm", "post_attention_layernorm"),
}
_LINEAR = {  # engine module -> (HF module, transposed)
    "gpt2": {
        "attn_out": ("attn.c_proj", True),
        "mlp_in": ("mlp.c_fc", True),
        "mlp_out": ("mlp.c_proj", True),
    },
    "opt": {
        "attn_q": ("self_attn.q_proj", False),
        "attn_k": ("self_attn.k_proj", False),
        "attn_v": ("self_attn.v_proj", False),
        "attn_out": ("self_attn.out_proj", False),
        "mlp_in": ("fc1", False),
        "mlp_out": ("fc2", False),
    },
    "gpt_neox": {
        "attn_out": ("attention.dense", False),
        "mlp_in": ("mlp.dense_h_to_4h", False),
        "mlp_out": ("mlp.dense_4h_to_h", False),
    },
    "llama": {
        "attn_q": ("self_attn.q_proj", False),
        "attn_k": ("self_attn.k_proj", False),
        "attn_v": ("self_attn.v_proj", False),
        "attn_out": ("self_attn.o_proj", False),
        "mlp_gate": ("mlp.gate_proj", False),
        "mlp_in": ("mlp.up_proj", False),
        "mlp_out": ("mlp.down_proj", False),
    },
}
_FUSED_QKV = {"gpt2": "attn.c_attn", "gpt_neox": "attention.query_key_value"}


def _family(arch: Architecture) -> str:
    if arch.family not in _BLOCK_PREFIX:
        raise ValueError(f"Architecture.family={arch.family!r}: not a transformers family")
    return arch.family


def canonical_name(arch: Architecture, hf_name: str) -> str:
    """The name this module uses for an HF tensor name of another spelling of the family."""
    fam = _family(arch)
    if fam == "gpt2" and hf_name.startswith(_GPT2_BARE):
        return "transformer." + hf_name
    if fam == "gpt_neox" and hf_name == "lm_head.weight":
        return "embed_out.weight"
    if fam == "opt" and hf_name.startswith("decoder."):
        # the published facebook/opt-* weights were saved from OPTModel: no ``model.``
        return "model." + hf_name
    return hf_name


def has_head_weight(arch: Architecture, hf_names: Iterable[str]) -> bool:
    """Whether ``hf_names`` hold the LM head's own weight (else the head takes the
    embedding's, as :func:`hf_to_engine` does)."""
    want = _HEAD[_family(arch)]["lm_head.weight"]
    return any(canonical_name(arch, n) == want for n in hf_names)


def hf_layer_of(arch: Architecture, spec: ModelSpec, hf_name: str) -> int | None:
    """The engine's global layer of an HF tensor name (None: not a model weight)."""
    fam = _family(arch)
    hf_name = canonical_name(arch, hf_name)
    prefix = _BLOCK_PREFIX[fam]
    if hf_name.startswith(prefix):
        return int(hf_name[len(prefix) :].split(".", 1)[0]) + 1
    if hf_name in _EMBED[fam].values():
        return 0
    if hf_name in _HEAD[fam].values():
        return spec.num_all_layers - 1
    return None


def _split_qkv(fam: str, spec: ModelSpec, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q, k, v (each ``[out, ...]``) of a fused qkv weight or bias in the engine's layout."""
    h, hd, n = spec.hidden_size, spec.head_dim, spec.num_heads
    if fam == "gpt2":  # Conv1D [h, 3h] (bias [3h]): columns q | k | v
        t = t.t() if t.dim() == 2 else t
        return tuple(x.contiguous() for x in torch.split(t, h, dim=0))
    per_head = t.reshape(n, 3, hd, *t.shape[1:])  # NeoX: [head, (q, k, v), head_dim, ...]
    return tuple(per_head[:, j].reshape(n * hd, *t.shape[1:]).contiguous() for j in range(3))


def _fuse_qkv(
    fam: str, spec: ModelSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> torch.Tensor:
    """The fused qkv weight or bias in the family's layout (inverse of :func:`_split_qkv`)."""
    if fam == "gpt2":
        cat = torch.cat([q, k, v], dim=0)
        return (cat.t() if cat.dim() == 2 else cat).contiguous()
    n, hd = spec.num_heads, spec.head_dim
    parts = [x.reshape(n, 1, hd, *x.shape[1:]) for x in (q, k, v)]
    return torch.cat(parts, dim=1).reshape(3 * n * hd, *q.shape[1:]).contiguous()


def hf_to_engine(
    spec: ModelSpec, arch: Architecture, hf: Tensors, layers: Iterable[int] | None = None
) -> dict[str, torch.Tensor]:
    """Full engine tensors (``"{layer}.{param}"``) of ``layers`` (all by default) from an
    HF state dict (which need only hold those layers' tensors, plus the embedding for a
    tied head)."""
    fam = _family(arch)
    hf = {canonical_name(arch, k): v for k, v in hf.items()}
    head = spec.num_all_layers - 1
    wanted = sorted(set(range(spec.num_all_layers) if layers is None else layers))
    out: dict[str, torch.Tensor] = {}
    for layer in wanted:
        if layer == 0:
            for mine, theirs in _EMBED[fam].items():
                if theirs in hf:
                    out[f"0.{mine}"] = hf[theirs]
        elif layer == head:
            for mine, theirs in _HEAD[fam].items():
                if theirs in hf:
                    out[f"{head}.{mine}"] = hf[theirs]
            if spec.tie_embeddings or f"{head}.lm_head.weight" not in out:
                out[f"{head}.lm_head.weight"] = hf[_EMBED[fam]["wte.weight"]]
        else:
            out.update(_block_from_hf(fam, spec, hf, layer))
    for key in ("0.wte.weight", f"{head}.lm_head.weight"):
        if key in out:
            out[key] = pad_rows(out[key], spec.vocab_size)
    return out


def _block_from_hf(fam: str, spec: ModelSpec, hf: Tensors, layer: int) -> dict[str, torch.Tensor]:
    pre = f"{_BLOCK_PREFIX[fam]}{layer - 1}."
    out: dict[str, torch.Tensor] = {}
    for mine, theirs in zip(("ln1", "ln2"), _LN[fam], strict=True):
        for leaf in ("weight", "bias"):
            if f"{pre}{theirs}.{leaf}" in hf:
                out[f"{layer}.{mine}.{leaf}"] = hf[f"{pre}{theirs}.{leaf}"]
    for mine, (theirs, transposed) in _LINEAR[fam].items():
        w = hf[f"{pre}{theirs}.weight"]
        out[f"{layer}.{mine}.weight"] = w.t().contiguous() if transposed else w
        if f"{pre}{theirs}.bias" in hf:
            out[f"{layer}.{mine}.bias"] = hf[f"{pre}{theirs}.bias"]
    if fam in _FUSED_QKV:
        fused = f"{pre}{_FUSED_QKV[fam]}"
        for leaf in ("weight", "bias"):
            if f"{fused}.{leaf}" in hf:
                parts = _split_qkv(fam, spec, hf[f"{fused}.{leaf}"])
                for n, t in zip("qkv", parts, strict=True):
                    out[f"{layer}.attn_{n}.{leaf}"] = t
    return out


def engine_to_hf(spec: ModelSpec, arch: Architecture, params: Tensors) -> dict[str, torch.Tensor]:
    """An HF state dict from the engine's full tensors of every layer (tied head left out)."""
    fam = _family(arch)
    head = spec.num_all_layers - 1
    out: dict[str, torch.Tensor] = {}
    for key, t in params.items():
        layer_s, mine = key.split(".", 1)
        layer = int(layer_s)
        if mine in ("wte.weight", "lm_head.weight"):
            t = unpad_rows(t, spec.vocab_size)
        if layer == 0:
            out[_EMBED[fam][mine]] = t
        elif layer == head and not (spec.tie_embeddings and mine == "lm_head.weight"):
            out[_HEAD[fam][mine]] = t
    for layer in range(1, head):
        out.update(_block_to_hf(fam, spec, params, layer))
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


def _block_to_hf(fam: str, spec: ModelSpec, params: Tensors, layer: int) -> dict[str, torch.Tensor]:
    pre = f"{_BLOCK_PREFIX[fam]}{layer - 1}."
    out: dict[str, torch.Tensor] = {}
    for mine, theirs in zip(("ln1", "ln2"), _LN[fam], strict=True):
        for leaf in ("weight", "bias"):
            if f"{layer}.{mine}.{leaf}" in params:
                out[f"{pre}{theirs}.{leaf}"] = params[f"{layer}.{mine}.{leaf}"]
    for mine, (theirs, transposed) in _LINEAR[fam].items():
        w = params[f"{layer}.{mine}.weight"]
        out[f"{pre}{theirs}.weight"] = w.t() if transposed else w
        if f"{layer}.{mine}.bias" in params:
            out[f"{pre}{theirs}.bias"] = params[f"{layer}.{mine}.bias"]
    if fam in _FUSED_QKV:
        fused = f"{pre}{_FUSED_QKV[fam]}"
        for leaf in ("weight", "bias"):
            names = [f"{layer}.attn_{n}.{leaf}" for n in "qkv"]
            if all(n in params for n in names):
                q, k, v = (params[n] for n in names)
                out[f"{fused}.{leaf}"] = _fuse_qkv(fam, spec, q, k, v)
    return out
