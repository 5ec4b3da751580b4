"""GPT-style decoder built from a ``ModelSpec``, one pipeline stage at a time.

A :class:`GPTStage` builds only the global layers it owns (0 = embedding, 1..L = blocks,
L+1 = final norm + LM head + loss) in an ``nn.ModuleDict`` keyed by the global layer index,
so its parameters are named ``"{global_layer}.{param_name}"`` (e.g. ``"3.attn_q.weight"``,
``"0.wte.weight"``, ``"7.lm_head.weight"``) whatever the layout. That name, plus each
parameter's TP dimension (:func:`~sailor.megatron_patch.tp_layers.tp_dim_of`), is the
interface the checkpoint code and the gradient sync rely on.

Covered: learned or rotary positions, LayerNorm or RMSNorm, GELU/ReLU MLP or SwiGLU,
multi-head or grouped-query attention, tied or untied embeddings. Blocks are
tensor-parallel (q, k, v, MLP-in column-parallel; attention-out, MLP-out row-parallel); the
token embedding and the LM head are split by vocabulary over the TP ranks of a stage, with a
vocab-parallel cross entropy (:mod:`~sailor.megatron_patch.vocab_parallel`; their matrices
have the padded vocabulary's rows); norms and position embeddings are replicated.

Family details ``ModelSpec`` does not carry (biases, tanh GELU, post-norm, parallel residual,
partial rotary, rotary base, position offset, a narrower word embedding with
``project_in``/``project_out``) come from an :class:`~sailor.megatron_patch.architecture.
Architecture` (default: the engine's own decoder); that is how the ``transformers`` GPT-2,
OPT, GPT-NeoX and Llama families are built (``megatron_patch.hf``). Their weights keep the
names below whatever the family: q, k and v stay three column-parallel matrices (a fused
layout is a conversion concern, not the engine's).

Tied embeddings: the head keeps its own copy of the embedding matrix, initialised equal and
kept equal by summing both gradients (``sync_groups``: the tied group), as Megatron does.

Initialisation is layout-independent: element ``i`` of a full parameter is a pure function of
(seed, parameter name, ``i``) (:mod:`~sailor.megatron_patch.init_rng`), and each rank draws
only its own shard, on its own device, so every layout, and the single-process reference,
starts from bitwise the same model without any rank drawing (or holding) a whole parameter.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812
from torch.utils.checkpoint import checkpoint

from sailor import catalog
from sailor.megatron_patch.architecture import Architecture
from sailor.megatron_patch.init_rng import fill_normal_, key_of
from sailor.megatron_patch.tp_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    TPContext,
    copy_to_tp,
    set_tp_dim,
    tp_dim_of,
)
from sailor.megatron_patch.vocab_parallel import (
    embed,
    rows_per_rank,
    vocab_cross_entropy,
)
from sailor.schemas.model import ModelSpec

__all__ = [
    "TINY_MODELS",
    "Architecture",
    "Block",
    "Embedding",
    "GPTStage",
    "Head",
    "full_init",
    "full_shape",
    "init_block_",
    "init_stage",
    "shard",
    "shard_start",
    "tiny_model",
]

_INIT_STD = 0.02


_OWN = Architecture()


def _norm(spec: ModelSpec, arch: Architecture) -> nn.Module:
    if spec.norm == "rmsnorm":
        return nn.RMSNorm(spec.hidden_size, eps=arch.norm_eps)
    return nn.LayerNorm(spec.hidden_size, eps=arch.norm_eps)


def _rope(x: torch.Tensor, theta: float = 10000.0, dim: int | None = None) -> torch.Tensor:
    """Rotary position embedding on ``x`` of shape [batch, heads, seq, head_dim].

    The first ``dim`` features of each head rotate (all of them by default), in the
    "rotate half" pairing of GPT-NeoX and Llama (feature ``i`` with ``i + dim/2``); the rest
    pass through (GPT-NeoX's partial rotary).
    """
    _, _, s, d = x.shape
    half = (dim or d) // 2
    freqs = 1.0 / theta ** (torch.arange(half, device=x.device, dtype=torch.float32) / half)
    ang = torch.arange(s, device=x.device, dtype=torch.float32)[:, None] * freqs[None, :]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half : 2 * half]
    rot = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return torch.cat([rot, x[..., 2 * half :]], dim=-1)


_NO_TP = TPContext()


class Embedding(nn.Module):
    """Global layer 0: token embedding split by vocabulary over the TP ranks (+ learned
    position embedding, replicated)."""

    def __init__(self, spec: ModelSpec, tp: TPContext = _NO_TP, arch: Architecture = _OWN) -> None:
        super().__init__()
        width = arch.embed_dim or spec.hidden_size
        self.tp = tp
        pad = arch.padding_idx  # a negative one counts from the end, as nn.Embedding's
        self.padding_idx = pad + spec.vocab_size if pad is not None and pad < 0 else pad
        # the table's rows only: ``nn.Embedding``'s padding_idx is a local row, applied in
        # ``embed`` (a shard may not hold it)
        self.wte = nn.Embedding(rows_per_rank(spec.vocab_size, tp), width)
        set_tp_dim(self.wte.weight, 0)
        self.project_in: nn.Linear | None = None
        if width != spec.hidden_size:
            self.project_in = nn.Linear(width, spec.hidden_size, bias=False)
            set_tp_dim(self.project_in.weight, None)
        self.wpe: nn.Embedding | None = None
        self.offset = arch.position_offset
        if spec.position_embedding == "learned":
            rows = (arch.max_positions or spec.seq_length) + arch.position_offset
            if rows < spec.seq_length + arch.position_offset:
                raise ValueError(
                    f"seq_length={spec.seq_length} exceeds the {arch.max_positions} "
                    "learned positions"
                )
            self.wpe = nn.Embedding(rows, spec.hidden_size)
            set_tp_dim(self.wpe.weight, None)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = embed(tokens, self.wte.weight, self.tp, self.padding_idx)
        if self.project_in is not None:
            x = self.project_in(x)
        if self.wpe is not None:
            pos = torch.arange(tokens.shape[1], device=tokens.device) + self.offset
            x = x + self.wpe(pos)[None]
        return x


class Block(nn.Module):
    """Pre-norm transformer block with Megatron-style tensor parallelism."""

    def __init__(self, spec: ModelSpec, tp: TPContext, arch: Architecture = _OWN) -> None:
        super().__init__()
        h, hd = spec.hidden_size, spec.head_dim
        if spec.num_heads % tp.size or spec.kv_heads % tp.size:
            raise ValueError(
                f"TP degree {tp.size} must divide num_heads={spec.num_heads} "
                f"and kv_heads={spec.kv_heads}"
            )
        self.tp = tp
        self.heads = spec.num_heads // tp.size
        self.kv_heads = spec.kv_heads // tp.size
        self.head_dim = hd
        self.rope = spec.position_embedding == "rope"
        self.rope_theta, self.rotary_dim = arch.rope_theta, arch.rotary_dim
        self.pre_norm, self.parallel = arch.pre_norm, arch.parallel_residual
        if self.parallel and not self.pre_norm:
            raise ValueError("a parallel residual needs pre-norm blocks")
        self.swiglu = spec.activation == "swiglu"
        self.act = F.relu if spec.activation == "relu" else F.gelu
        self.gelu_approx = "tanh" if arch.gelu_tanh and spec.activation == "gelu" else "none"
        bias = not self.swiglu if arch.mlp_bias is None else arch.mlp_bias
        ab = arch.attn_bias
        self.ln1 = _norm(spec, arch)
        self.attn_q = ColumnParallelLinear(h, spec.num_heads * hd, tp, bias=ab)
        self.attn_k = ColumnParallelLinear(h, spec.kv_heads * hd, tp, bias=ab)
        self.attn_v = ColumnParallelLinear(h, spec.kv_heads * hd, tp, bias=ab)
        self.attn_out = RowParallelLinear(spec.num_heads * hd, h, tp, bias=ab)
        self.ln2 = _norm(spec, arch)
        self.mlp_in = ColumnParallelLinear(h, spec.ffn_hidden_size, tp, bias=bias)
        self.mlp_gate = (  # HF Llama: gate_proj has the bias up_proj and down_proj have
            ColumnParallelLinear(h, spec.ffn_hidden_size, tp, bias=bias) if self.swiglu else None
        )
        self.mlp_out = RowParallelLinear(spec.ffn_hidden_size, h, tp, bias=bias)
        for p in (*self.ln1.parameters(), *self.ln2.parameters()):
            set_tp_dim(p, None)

    def _attention(self, a: torch.Tensor) -> torch.Tensor:
        b, s, _ = a.shape
        a = copy_to_tp(a, self.tp)
        q = self.attn_q(a).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.attn_k(a).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.attn_v(a).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        if self.rope:
            q = _rope(q, self.rope_theta, self.rotary_dim)
            k = _rope(k, self.rope_theta, self.rotary_dim)
        if self.kv_heads != self.heads:
            rep = self.heads // self.kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out: torch.Tensor = self.attn_out(
            o.transpose(1, 2).reshape(b, s, self.heads * self.head_dim)
        )
        return out

    def _mlp(self, m: torch.Tensor) -> torch.Tensor:
        m = copy_to_tp(m, self.tp)
        if self.mlp_gate is not None:
            hid = F.silu(self.mlp_gate(m)) * self.mlp_in(m)
        elif self.act is F.gelu:
            hid = F.gelu(self.mlp_in(m), approximate=self.gelu_approx)
        else:
            hid = self.act(self.mlp_in(m))
        out: torch.Tensor = self.mlp_out(hid)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel:  # GPT-NeoX: both branches read the block's input
            return x + self._attention(self.ln1(x)) + self._mlp(self.ln2(x))
        if not self.pre_norm:  # post-norm (OPT-350m): normalise after each residual
            x = self.ln1(x + self._attention(x))
            out: torch.Tensor = self.ln2(x + self._mlp(x))
            return out
        x = x + self._attention(self.ln1(x))
        return x + self._mlp(self.ln2(x))


class Head(nn.Module):
    """Global layer L+1: final norm (replicated), LM head split by vocabulary over the TP
    ranks, and the mean cross entropy (vocab-parallel at TP > 1)."""

    def __init__(self, spec: ModelSpec, tp: TPContext = _NO_TP, arch: Architecture = _OWN) -> None:
        super().__init__()
        width = arch.embed_dim or spec.hidden_size
        self.tp = tp
        self.vocab_size = spec.vocab_size
        self.norm = _norm(spec, arch) if arch.final_norm else None
        self.project_out: nn.Linear | None = None
        if width != spec.hidden_size:
            self.project_out = nn.Linear(spec.hidden_size, width, bias=False)
        self.lm_head = nn.Linear(width, rows_per_rank(spec.vocab_size, tp), bias=False)
        for p in self.parameters():
            set_tp_dim(p, None)
        set_tp_dim(self.lm_head.weight, 0)

    def local_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of this rank's vocabulary rows (padding included)."""
        if self.norm is not None:
            x = self.norm(x)
        if self.project_out is not None:
            x = self.project_out(x)
        logits: torch.Tensor = self.lm_head(copy_to_tp(x, self.tp))
        return logits

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The real vocabulary's logits (TP 1 only: at TP > 1 a rank holds a slice)."""
        if self.tp.size != 1:
            raise ValueError(f"whole logits need TP 1, this head has TP {self.tp.size}")
        return self.local_logits(x)[..., : self.vocab_size]

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.local_logits(x).float()
        return vocab_cross_entropy(logits, labels, self.vocab_size, self.tp)


def build_layer(spec: ModelSpec, layer: int, tp: TPContext, arch: Architecture = _OWN) -> nn.Module:
    """The module of one global layer (sharded for ``tp``), uninitialised."""
    kind = spec.layer_kind(layer)
    if kind == "embedding":
        return Embedding(spec, tp, arch)
    if kind == "head":
        return Head(spec, tp, arch)
    return Block(spec, tp, arch)


class GPTStage(nn.Module):
    """Global layers ``first..last`` of the model on one TP rank.

    ``forward(x, labels)``: ``x`` is token ids on the stage holding layer 0, else the hidden
    states from the previous stage; returns the mean loss on the stage holding the head, else
    the hidden states for the next stage.
    """

    def __init__(
        self,
        spec: ModelSpec,
        first_layer: int,
        last_layer: int,
        tp: TPContext | None = None,
        recompute: bool = False,
        seed: int = 0,
        tie_in_module: bool = False,
        arch: Architecture | None = None,
        init: bool = True,
    ) -> None:
        super().__init__()
        if not 0 <= first_layer <= last_layer < spec.num_all_layers:
            raise ValueError(
                f"layers {first_layer}..{last_layer} outside 0..{spec.num_all_layers - 1}"
            )
        self.spec = spec
        self.arch = arch or _OWN
        self.first_layer, self.last_layer = first_layer, last_layer
        self.tp = tp or TPContext()
        self.recompute = recompute
        self.layers = nn.ModuleDict(
            {
                str(i): build_layer(spec, i, self.tp, self.arch)
                for i in range(first_layer, last_layer + 1)
            }
        )
        if init:  # False: the caller fills every parameter (a stage built on ``meta``)
            init_stage(self, seed)
        head_key = str(spec.num_all_layers - 1)
        if tie_in_module and spec.tie_embeddings and "0" in self.layers and head_key in self.layers:
            # Single-process reference: one shared matrix, as a plain tied model.
            head = self.layers[head_key]
            emb = self.layers["0"]
            if isinstance(head, Head) and isinstance(emb, Embedding):
                head.lm_head.weight = emb.wte.weight

    @property
    def holds_head(self) -> bool:
        return self.last_layer == self.spec.num_all_layers - 1

    def keyed_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """``("{global_layer}.{param_name}", parameter)`` for every parameter (no dedup)."""
        for key, module in self.layers.items():
            for name, p in module.named_parameters(remove_duplicate=False):
                yield f"{key}.{name}", p

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        head_key = str(self.spec.num_all_layers - 1)
        for key, module in self.layers.items():
            if key == head_key:
                if labels is None:
                    raise ValueError("the stage holding the head needs labels")
                return module(x, labels)  # type: ignore[no-any-return]
            if isinstance(module, Block) and self.recompute and torch.is_grad_enabled():
                x = checkpoint(module, x, use_reentrant=False)
            else:
                x = module(x)
        return x


def _init_rule(spec: ModelSpec, name: str) -> tuple[str, float | None, int | None]:
    """How parameter ``name`` ("{layer}.{param}") starts: ``(stream name, std, first
    zero row)``; std None: a constant (zero bias, unit norm weight: see ``_constant``)."""
    _, pname = name.split(".", 1)
    vocab_matrix = pname in ("wte.weight", "lm_head.weight")
    if spec.tie_embeddings and pname == "lm_head.weight":
        name = "0.wte.weight"
    leaf = pname.rsplit(".", 1)[-1]
    if leaf == "bias" or pname.startswith(("ln", "norm")):
        return name, None, None
    std = _INIT_STD
    if pname.startswith(("attn_out", "mlp_out")):
        std = _INIT_STD / (2 * spec.num_layers) ** 0.5  # GPT-2 residual scaling
    # a vocabulary matrix's padding rows are zero (``vocab_parallel``), whatever the layout
    return name, std, spec.vocab_size if vocab_matrix else None


def _constant(name: str) -> float:
    return 0.0 if name.rsplit(".", 1)[-1] == "bias" else 1.0


@torch.no_grad()
def init_block_(
    out: torch.Tensor,
    spec: ModelSpec,
    name: str,
    full: tuple[int, ...],
    start: tuple[int, ...],
    seed: int,
) -> torch.Tensor:
    """Fill ``out`` with its block (at ``start``) of parameter ``name``'s initial value of
    shape ``full``, drawn where ``out`` is (``init_rng``: a pure function of the seed, the
    name and each element's index in the full tensor, so any block of any layout on any
    device holds the same numbers)."""
    stream, std, zero_from = _init_rule(spec, name)
    if std is None:
        return out.fill_(_constant(name))
    return fill_normal_(out, key_of(seed, stream), full, start, std, zero_from)


def full_init(spec: ModelSpec, name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The full (unsharded) initial value of parameter ``name`` ("{layer}.{param}"), on the
    host (what a process that holds the whole parameter starts from)."""
    out = torch.empty(shape, device="cpu")
    return init_block_(out, spec, name, shape, (0,) * len(shape), seed)


def shard(full: torch.Tensor, tp_dim: int | None, tp_size: int, tp_rank: int) -> torch.Tensor:
    """This TP rank's contiguous chunk of ``full`` along ``tp_dim`` (all of it if None)."""
    if tp_dim is None or tp_size == 1:
        return full
    return full.chunk(tp_size, dim=tp_dim)[tp_rank]


def full_shape(p: torch.Tensor, tp_size: int) -> tuple[int, ...]:
    """Unsharded shape of a local parameter."""
    dim = tp_dim_of(p)
    shape = list(p.shape)
    if dim is not None:
        shape[dim] *= tp_size
    return tuple(shape)


def shard_start(p: torch.Tensor, tp_rank: int) -> tuple[int, ...]:
    """Where TP rank ``tp_rank``'s shard ``p`` starts in the full tensor (the contiguous
    chunks of :func:`shard`)."""
    dim = tp_dim_of(p)
    return tuple(tp_rank * n if d == dim else 0 for d, n in enumerate(p.shape))


@torch.no_grad()
def init_stage(stage: GPTStage, seed: int) -> None:
    """Initialise every parameter of ``stage`` to its shard of the layout-free full init,
    each rank drawing its own shard only, on the parameter's device, a bounded chunk at a
    time (a parameter on ``meta`` is left as it is)."""
    tp = stage.tp
    for name, p in stage.keyed_parameters():
        if p.is_meta:
            continue
        if p.is_contiguous():
            init_block_(
                p.data, stage.spec, name, full_shape(p, tp.size), shard_start(p, tp.rank), seed
            )
            continue
        block = torch.empty(p.shape, dtype=p.dtype, device=p.device)
        init_block_(block, stage.spec, name, full_shape(p, tp.size), shard_start(p, tp.rank), seed)
        p.copy_(block)


TINY_MODELS: dict[str, ModelSpec] = {
    name: spec for name, spec in catalog.models().items() if name.startswith("tiny-")
}
"""CPU test models of the catalog (GPT-2 and Llama shapes), by name."""


def tiny_model(name: str, global_batch_size: int | None = None) -> ModelSpec:
    """A tiny CPU model by name, optionally with another global batch size."""
    if name not in TINY_MODELS:
        raise ValueError(f"model={name!r}: not a tiny model (known: {sorted(TINY_MODELS)})")
    spec = TINY_MODELS[name]
    if global_batch_size is not None:
        spec = spec.model_copy(update={"global_batch_size": global_batch_size})
    return spec
