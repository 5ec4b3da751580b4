"""Training data on disk: Megatron's indexed dataset, samples from it, and its preparation.

* :mod:`indexed` — ``.bin``/``.idx`` reader (memory-mapped, checked on open) and writer.
* :mod:`permutation` — a seeded permutation evaluated per index (the sample order).
* :mod:`tokens` — :class:`TokenDataset`: sample ``k`` is a pure function of ``(seed, k)``.
* :mod:`prepared` — open a data set with its manifest and splits.
* :mod:`scan` — the largest token id of a data set without a manifest, once per file version.
* :mod:`corpus`, :mod:`tokenizer`, :mod:`prepare` — ``sailor data prepare``.

Must never import torch (the engine adapts numpy arrays in ``megatron_patch.data``) and
never download anything.
"""

from sailor.data.indexed import IndexedDataset, IndexedDatasetError, IndexedDatasetWriter
from sailor.data.prepared import PreparedData, open_prepared, read_manifest
from sailor.data.scan import max_token_id
from sailor.data.tokens import TokenDataset

__all__ = [
    "IndexedDataset",
    "IndexedDatasetError",
    "IndexedDatasetWriter",
    "PreparedData",
    "TokenDataset",
    "max_token_id",
    "open_prepared",
    "read_manifest",
]
