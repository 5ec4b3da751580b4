"""Hugging Face ``transformers`` models in the engine: config mapping, weight conversion,
local checkpoint import and export (kept at the edge: the engine never imports this).

- :mod:`.config`: a ``transformers`` config -> ``(ModelSpec, Architecture)``;
- :mod:`.convert`: HF names and layouts <-> layer-keyed full tensors (pure);
- :mod:`.checkpoint`: read a local model directory into a stage of any layout; export.
"""

from sailor.megatron_patch.hf.config import FAMILIES, UnsupportedConfigError, from_hf_config

__all__ = ["FAMILIES", "UnsupportedConfigError", "from_hf_config"]
