"""Model architecture and training setup.

Layer indexing is global and fixed for the whole system (plans, profiles, checkpoints):
layer 0 is the embedding, layers 1..L the transformer blocks, layer L+1 the final norm,
the LM head and the loss. ``num_all_layers = L + 2``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from sailor.schemas._base import Frozen, field_error
from sailor.schemas.precision import Precision, compute_bytes

__all__ = [
    "MAX_GLOBAL_BATCH",
    "VOCAB_MULTIPLE",
    "LayerKind",
    "ModelSpec",
    "Precision",
    "padded_vocab",
]

LayerKind = Literal["embedding", "block", "head"]

VOCAB_MULTIPLE = 64
"""Sailor's engine pads the vocabulary of its embedding table and LM head to a multiple of
this (``megatron_patch.vocab_parallel``; Megatron pads to 128·t: a multiple that does not
depend on the layout keeps checkpoints reshardable). Every TP degree up to 64 splits it."""


def padded_vocab(vocab_size: int) -> int:
    """Rows of the engine's embedding table and LM head: ``vocab_size`` rounded up to
    :data:`VOCAB_MULTIPLE`."""
    return -(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


MAX_GLOBAL_BATCH = 1 << 20
"""Sequences per iteration at most (~1M: 16x today's largest runs), so that a typo is refused
by name instead of simulated microbatch by microbatch."""


class ModelSpec(Frozen):
    """A GPT-style decoder and how it is trained."""

    name: str = Field(min_length=1, description="Model name, e.g. 'OPT-350'.")
    num_layers: int = Field(
        gt=0, le=4096, description="Transformer blocks (without embedding and head)."
    )
    hidden_size: int = Field(gt=0, description="Hidden size.")
    num_heads: int = Field(gt=0, description="Attention heads.")
    num_kv_heads: int = Field(default=0, ge=0, description="KV heads (GQA); 0 means num_heads.")
    ffn_hidden_size: int = Field(gt=0, description="Feed-forward inner size.")
    seq_length: int = Field(gt=0, description="Training sequence length.")
    vocab_size: int = Field(gt=0, description="Vocabulary size.")
    activation: Literal["gelu", "relu", "swiglu"] = Field(
        default="gelu", description="Feed-forward activation; swiglu has three matrices."
    )
    norm: Literal["layernorm", "rmsnorm"] = Field(default="layernorm", description="Norm kind.")
    position_embedding: Literal["learned", "rope"] = Field(
        default="learned", description="Learned absolute positions or rotary."
    )
    tie_embeddings: bool = Field(default=True, description="LM head shares the embedding matrix.")
    global_batch_size: int = Field(
        gt=0, le=MAX_GLOBAL_BATCH, description="Samples (sequences) per iteration."
    )
    precision: Precision = Field(
        default="fp16",
        description="Requested compute precision. 'fp32' is kept; otherwise mixed precision, "
        "and the plan's GPUs decide between bf16 and fp16 (Plan.precision, "
        "schemas.precision.choose_precision). The plan's precision is what runs and is priced.",
    )
    optimizer: Literal["adam", "sgd"] = Field(default="adam", description="Optimizer.")

    @model_validator(mode="after")
    def _heads(self) -> ModelSpec:
        if self.hidden_size % self.num_heads:
            raise field_error(
                "num_heads", self.num_heads, f"must divide hidden_size={self.hidden_size}"
            )
        if self.num_kv_heads and self.num_heads % self.num_kv_heads:
            raise field_error(
                "num_kv_heads", self.num_kv_heads, f"must divide num_heads={self.num_heads}"
            )
        return self

    @property
    def num_all_layers(self) -> int:
        return self.num_layers + 2

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    def tp_problem(self, tp: int) -> str | None:
        """Why Sailor's engine cannot split this model over ``tp`` tensor-parallel ranks, or
        None if it can. The engine splits the attention's query heads and key/value heads
        (``megatron_patch.model.Block``), the FFN's inner width (``tp_layers``' column and
        row linears) and the padded vocabulary (``vocab_parallel.rows_per_rank``) evenly over
        the ranks; Megatron-LM asserts the same divisions. Planner and simulator refuse what
        this refuses, so a plan the planner emits is one the engine can build."""
        if tp < 1:
            return f"tp={tp}: must be >= 1"
        sizes = (
            ("num_heads", self.num_heads),
            ("kv_heads", self.kv_heads),
            ("ffn_hidden_size", self.ffn_hidden_size),
            ("padded vocabulary", padded_vocab(self.vocab_size)),
        )
        bad = [f"{name}={n}" for name, n in sizes if n % tp]
        if bad:
            return f"tp={tp} does not divide {', '.join(bad)} of model {self.name!r}"
        return None

    def layer_kind(self, layer: int) -> LayerKind:
        if layer < 0 or layer >= self.num_all_layers:
            raise field_error("layer", layer, f"outside 0..{self.num_all_layers - 1}")
        if layer == 0:
            return "embedding"
        if layer == self.num_all_layers - 1:
            return "head"
        return "block"

    def layer_params(self, layer: int) -> int:
        """Parameters of one global layer (unsharded)."""
        h, f, v = self.hidden_size, self.ffn_hidden_size, self.vocab_size
        kind = self.layer_kind(layer)
        norm = 2 * h if self.norm == "layernorm" else h
        if kind == "embedding":
            pos = self.seq_length * h if self.position_embedding == "learned" else 0
            return v * h + pos
        if kind == "head":
            # With tied embeddings the head still holds a copy of the matrix on its own
            # stage (Megatron keeps a replica and all-reduces its gradient with the first).
            return norm + v * h
        kv = self.kv_heads * self.head_dim
        attn = h * (h + 2 * kv) + (h + 2 * kv) + h * h + h
        n_mat = 3 if self.activation == "swiglu" else 2
        ffn = n_mat * h * f + (f + h if self.activation != "swiglu" else 0)
        return attn + ffn + 2 * norm

    @property
    def total_params(self) -> int:
        return sum(self.layer_params(i) for i in range(self.num_all_layers))

    def param_bytes(self) -> int:
        """Bytes per parameter of the weights used in compute."""
        return compute_bytes(self.precision)
