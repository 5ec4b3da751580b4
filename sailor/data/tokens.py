"""Training samples from an indexed dataset: ``seq_length + 1`` tokens, a pure function of
``(seed, position)``.

A split is a contiguous range of documents (``sailor data prepare`` shuffles documents once,
then writes the train split first and the validation split after it). Its token stream is the
concatenation of those documents as stored, end-of-document token included (the prepare step
appends one to every document, as Megatron's ``preprocess_data.py --append-eod`` does), so a
sample may cross a document boundary, as in Megatron's GPT dataset. The stream is cut into
``N = (tokens - 1) // seq_length`` windows; window ``w`` is tokens
``[w * seq_length, w * seq_length + seq_length + 1)`` (consecutive windows share one token,
the last label of one is the first input of the next). Sample ``k`` is window
``permute(k mod N, N, key(seed, epoch))`` with ``epoch = k // N``: every window once per
epoch, in a fresh order each epoch, from any position without state
(:mod:`sailor.data.permutation`).

Because sample ``k`` depends on nothing but ``(seed, k)`` and the files, any layout, after
any reconfiguration, in any process, reads the same tokens at the same data position.

Must never import torch: :class:`TokenDataset` returns numpy arrays; the engine's adapter
(``sailor.megatron_patch.data.IndexedTokens``) turns them into tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from sailor.data.indexed import IndexedDataset
from sailor.data.permutation import mix64, permute

__all__ = ["TokenDataset", "document_split"]


def document_split(num_documents: int, validation_fraction: float) -> dict[str, range]:
    """Train and validation document ranges of a data set without a manifest: the last
    ``ceil(fraction * documents)`` documents are the validation split (at least one when the
    fraction is above 0, and never all of them)."""
    if not 0.0 <= validation_fraction < 1.0:
        raise ValueError(f"validation_fraction={validation_fraction}: must be in [0, 1)")
    n_val = int(np.ceil(validation_fraction * num_documents)) if validation_fraction else 0
    if n_val >= num_documents and num_documents > 0:
        raise ValueError(
            f"validation_fraction={validation_fraction}: leaves no training documents "
            f"of {num_documents}"
        )
    cut = num_documents - n_val
    return {"train": range(0, cut), "validation": range(cut, num_documents)}


@dataclass(frozen=True)
class TokenDataset:
    """Samples of ``seq_length + 1`` tokens from documents ``documents`` of ``data``.

    ``sample(k)`` and ``samples(indices)`` return int64 arrays; ``k`` may exceed
    :attr:`num_windows` (later epochs reshuffle).
    """

    data: IndexedDataset
    seq_length: int
    seed: int = 0
    documents: range | None = None
    _stream: npt.NDArray[np.generic] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.seq_length <= 0:
            raise ValueError(f"seq_length={self.seq_length}: must be > 0")
        docs = self.documents if self.documents is not None else range(self.data.num_documents)
        if docs.step != 1:
            raise ValueError(f"documents={docs}: must be a contiguous range")
        stream = self.data.document_tokens(docs.start, docs.stop)
        object.__setattr__(self, "documents", docs)
        object.__setattr__(self, "_stream", stream)
        if len(stream) < self.seq_length + 1:
            raise ValueError(
                f"{self.data.bin_path}: documents [{docs.start}, {docs.stop}) hold "
                f"{len(stream)} tokens; one sample of seq_length={self.seq_length} needs "
                f"{self.seq_length + 1}"
            )

    @property
    def num_tokens(self) -> int:
        return len(self._stream)

    @property
    def num_windows(self) -> int:
        """Distinct samples per epoch."""
        return (len(self._stream) - 1) // self.seq_length

    def _epoch_key(self, epoch: int) -> int:
        return mix64(mix64(self.seed) ^ (epoch + 1))

    def windows(self, indices: Sequence[int] | range | npt.ArrayLike) -> npt.NDArray[np.int64]:
        """Window (per epoch) read by each sample index."""
        k = np.asarray(indices, dtype=np.int64).reshape(-1)
        if k.size and k.min() < 0:
            raise ValueError(f"sample index {int(k.min())}: must be >= 0")
        n = self.num_windows
        epoch, pos = np.divmod(k, n)
        out = np.empty_like(k)
        for e in np.unique(epoch):
            sel = epoch == e
            out[sel] = permute(pos[sel], n, self._epoch_key(int(e)))
        return out

    def samples(self, indices: Sequence[int] | range | npt.ArrayLike) -> npt.NDArray[np.int64]:
        """Tokens of these samples, shape ``[len(indices), seq_length + 1]``, int64."""
        starts = self.windows(indices) * self.seq_length
        offsets = np.arange(self.seq_length + 1, dtype=np.int64)
        return np.asarray(self._stream[starts[:, None] + offsets[None, :]], dtype=np.int64)

    def sample(self, k: int) -> npt.NDArray[np.int64]:
        """Tokens of sample ``k``, shape ``[seq_length + 1]``."""
        out: npt.NDArray[np.int64] = self.samples([k])[0]
        return out

    def batch(
        self, indices: Sequence[int] | range
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """``(inputs, labels)`` of shape ``[len(indices), seq_length]`` (numpy)."""
        toks = self.samples(indices)
        return np.ascontiguousarray(toks[:, :-1]), np.ascontiguousarray(toks[:, 1:])
