"""What the demo trains: a GPT-2 (``transformers.GPT2Config``) on the Python documentation.

- **Model**: GPT-2's architecture as ``transformers`` defines it (tanh GELU, learned
  positions, tied embeddings, its LayerNorm epsilon), resolved once here through
  ``megatron_patch.hf`` into the model file every worker reads, so the ranks never import
  ``transformers``. Its blocks have the sizes of the catalog's ``tiny-gpt`` (4 blocks,
  hidden 32, 4 heads, FFN 64, sequence 16); its vocabulary is the corpus tokenizer's
  (:data:`VOCAB`). The controller plans and prices this model (its ``ModelSpec`` file).
- **Data**: the reference prose the Python installation ships (``python-docs``, about
  0.5 MB: the standard library's module docstrings), tokenized by ``sailor data prepare``'s
  code with a byte-level BPE of :data:`VOCAB` tokens trained on it, into a Megatron indexed
  dataset with a validation split. Available offline on every machine; samples are a pure
  function of (seed, position), so every layout after every change reads the same tokens.
- **Training config**: one ``TrainingConfig`` file naming both, which every rank validates.

:func:`prepare_demo` writes all three into the run directory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

__all__ = [
    "CORPUS",
    "VOCAB",
    "DemoTraining",
    "demo_config",
    "demo_model",
    "prepare_demo",
]

CORPUS = "python-docs"
"""The built-in corpus the demo trains on (``sailor.data.corpus``)."""

VOCAB = 512
"""The trained BPE's vocabulary, and the model's."""

SEQ = 16
"""Training sequence length (tiny-gpt's)."""


@dataclass(frozen=True)
class DemoTraining:
    """The files of the demo's training: the resolved model, the data set, the config."""

    model_file: Path
    spec_file: Path
    """The model's ``ModelSpec`` alone: what the controller plans and prices."""
    data_prefix: Path
    training_file: Path
    prepare_command: str
    """The ``sailor data prepare`` command that makes the same data set."""


def demo_config() -> Any:
    """The demo model's ``transformers`` config (no download: built here)."""
    import transformers

    return transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ,
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

    # the demo runs on CPU kinds: fp32, as the plan would resolve it anyway
    return from_hf_config(demo_config(), SEQ, global_batch_size, name="gpt2-tiny", precision="fp32")


def training_config(model_file: str, data_prefix: str) -> dict[str, Any]:
    """The demo's ``TrainingConfig`` (as data; validated by every rank).

    AdamW at lr 1e-3, stable over long runs: two single-process runs differing only in
    microbatch size stay 2e-4 apart in any weight after 336 steps. At 3e-3 the loss falls
    faster at first (last-ten mean 5.30 against 5.46 after 60 steps) but ends higher (5.12
    against 5.02 after 336), and rounding grows ~2x every 20 steps past step 100 to 9e-2 apart
    after 336: the run is at the edge of stability, where no exactness check can see through
    the noise (the chaos suite's trace replay trains 336 steps)."""
    return {
        "model": {"kind": "spec", "path": model_file},
        "data": {"kind": "indexed", "prefix": data_prefix},
        "seed": 0,
        "optimizer": {"lr": 1e-3},
    }


def prepare_demo(root: Path, global_batch_size: int) -> DemoTraining:
    """Resolve the model, prepare the corpus and write the training config under ``root``."""
    from sailor.data import corpus
    from sailor.data.prepare import PrepareOptions, prepare
    from sailor.megatron_patch.hf.checkpoint import model_file

    model = root / "model.json"
    spec, arch = demo_model(global_batch_size)
    model.write_text(model_file(spec, arch))
    (root / "spec.json").write_text(spec.model_dump_json(indent=2))  # what the controller plans
    prefix = root / "data" / "pydocs"
    prefix.parent.mkdir(parents=True, exist_ok=True)
    opts = PrepareOptions(
        out=prefix,
        vocab_size=VOCAB,
        source_kind="builtin",
        source_inputs=(CORPUS,),
        python_version=corpus.python_version(),
    )
    manifest = prepare(corpus.builtin_corpus(CORPUS), opts)
    if manifest.tokenizer.vocab_size > VOCAB:
        raise ValueError(f"tokenizer vocab_size={manifest.tokenizer.vocab_size} > {VOCAB}")
    training = root / "training.yaml"
    training.write_text(yaml.safe_dump(training_config("model.json", "data/pydocs")))
    return DemoTraining(
        model_file=model,
        spec_file=root / "spec.json",
        data_prefix=prefix,
        training_file=training,
        prepare_command=(
            f"sailor data prepare --builtin-corpus {CORPUS} --vocab-size {VOCAB} --out {prefix}"
        ),
    )
