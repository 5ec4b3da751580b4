"""The per-family structure of a decoder that ``ModelSpec`` does not describe.

``ModelSpec`` (``sailor.schemas``) holds what the planner and simulator price: sizes, norm
kind, activation family, position kind, tying. Real model families differ in details that
change the arithmetic but not the cost model: biases, the tanh GELU of GPT-2, the parallel
residual and partial rotary of GPT-NeoX, the rotary base of Llama, OPT's position offset
of 2, post-norm blocks and the ``project_in``/``project_out`` pair around a narrower word
embedding. :class:`Architecture` names them, so ``GPTStage`` can build those families
exactly while its parameter names stay the layer-keyed ones the checkpoint and gradient
sync rely on. The default is the engine's own decoder (what ``GPTStage`` built before).

Where the values come from for a Hugging Face model: ``megatron_patch.hf.config``.
This module is pure data: no torch, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Architecture"]


@dataclass(frozen=True)
class Architecture:
    """Structural details of a decoder family (defaults: the engine's own GPT/Llama)."""

    family: str = "sailor"
    """Where the structure comes from: ``sailor`` (own) or a ``transformers`` model type."""
    norm_eps: float = 1e-5
    attn_bias: bool = True
    """Biases on q, k, v and the attention output projection."""
    mlp_bias: bool | None = None
    """Biases on the MLP matrices; None: yes unless SwiGLU (the engine's own rule)."""
    gelu_tanh: bool = False
    """GELU with the tanh approximation (GPT-2's ``gelu_new``) instead of the exact one."""
    pre_norm: bool = True
    """Norm before attention and MLP (False: OPT-350m's post-norm blocks)."""
    final_norm: bool = True
    """A norm before the LM head (absent in post-norm OPT)."""
    parallel_residual: bool = False
    """``x + attn(ln1(x)) + mlp(ln2(x))`` (GPT-NeoX) instead of two sequential residuals."""
    rope_theta: float = 10000.0
    rotary_dim: int | None = None
    """Leading dims of each head that rotate (GPT-NeoX's partial rotary); None: the whole head."""
    max_positions: int | None = None
    """Rows of the learned position table; None: the training sequence length."""
    position_offset: int = 0
    """Learned positions start at this row (OPT: 2)."""
    padding_idx: int | None = None
    """Token whose embedding row gets no gradient from the lookup (``nn.Embedding``'s
    ``padding_idx``: OPT and Llama set it to the pad token)."""
    embed_dim: int | None = None
    """Width of the word embedding when narrower than the hidden size (OPT ``project_in``
    after the embedding, ``project_out`` before the head); None: the hidden size."""

    def __post_init__(self) -> None:
        if self.norm_eps <= 0:
            raise ValueError(f"Architecture.norm_eps={self.norm_eps} must be > 0")
        if self.rotary_dim is not None and (self.rotary_dim <= 0 or self.rotary_dim % 2):
            raise ValueError(f"Architecture.rotary_dim={self.rotary_dim} must be even and > 0")
        if self.position_offset < 0:
            raise ValueError(f"Architecture.position_offset={self.position_offset} must be >= 0")
        if self.embed_dim is not None and self.embed_dim <= 0:
            raise ValueError(f"Architecture.embed_dim={self.embed_dim} must be > 0")
