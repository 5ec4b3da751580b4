"""What the demo trains: a GPT-2 (``transformers.GPT2Config``) at ``tiny-gpt``'s sizes.

The architecture is GPT-2's as ``transformers`` defines it (tanh GELU, learned positions,
tied embeddings, its LayerNorm epsilon), resolved once here through
``megatron_patch.hf`` into the model file every worker reads (``--model``), so the ranks
never import ``transformers``. The sizes are those of the catalog's ``tiny-gpt`` (4 blocks,
hidden 32, 4 heads, FFN 64, vocabulary 64, sequence 16): the controller plans and prices
``tiny-gpt``, whose layers are the same shapes, and the demo keeps its runtime.

**Data switch** (:data:`DEMO_DATA`): the workers' ``--data``. Today ``synthetic`` (seeded
tokens, a pure function of the position, so a resumed layout reads the same samples). A
real corpus prepared by ``sailor data prepare`` (Megatron indexed dataset, another branch)
plugs in here and in ``megatron_patch.worker.data_sources``, nowhere else.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["DEMO_DATA", "demo_config", "demo_model", "write_model_file"]

DEMO_DATA = "synthetic"
"""The one switch of the demo's training data (see the module docstring)."""


def demo_config() -> Any:
    """The demo model's ``transformers`` config (no download: built here)."""
    import transformers

    return transformers.GPT2Config(
        vocab_size=64,
        n_positions=16,
        n_embd=32,
        n_layer=4,
        n_head=4,
        n_inner=64,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )


def demo_model(global_batch_size: int) -> tuple[Any, Any]:
    """``(ModelSpec, Architecture)`` of the demo model."""
    from sailor.megatron_patch.hf.config import from_hf_config

    return from_hf_config(demo_config(), 16, global_batch_size, name="gpt2-tiny")


def write_model_file(path: Path, global_batch_size: int) -> Path:
    """Write the model file the workers' ``--model`` reads; returns ``path``."""
    from sailor.megatron_patch.hf.checkpoint import model_file

    path.write_text(model_file(*demo_model(global_batch_size)))
    return path
