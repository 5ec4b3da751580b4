"""The identity of an indexed data set's training split: what a checkpoint records of its data.

``DataIdentity`` (``sailor.schemas.data_identity``) must be cheap to compute at every start
(a run that reconfigures restarts often, on terabytes of tokens) and must not depend on where
the files are (a corpus moved or copied is the same data). So it holds the counts the index
gives, what the manifest says (tokenizer digest and vocabulary, document shuffle seed), the
training split's documents, the sequence length and sample seed, and
:func:`content_digest`: SHA-256 over each file's size and :data:`SAMPLED_BLOCKS` blocks of
:data:`BLOCK_BYTES` read at evenly spaced offsets (the whole file when it is smaller): at
most 2 × 1 MiB read. It changes with any change of a file's size and with any change inside
a sampled block; an edit that keeps both files' sizes and misses every sampled block (one
document's tokens rewritten in place, of the same length) is not seen. Another corpus, another
tokenizer's ids, another shuffle or split all move every block.

Must never import torch; reads the two files, never writes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

from sailor.data.prepared import PreparedData
from sailor.schemas.data_identity import DataIdentity

__all__ = ["BLOCK_BYTES", "SAMPLED_BLOCKS", "content_digest", "indexed_identity"]

BLOCK_BYTES = 4096
"""Bytes per sampled block: one page, one read on any file system."""

SAMPLED_BLOCKS = 256
"""Blocks sampled per file: 1 MiB read per file, whatever its size (a few ms locally; on a
shared file system a few hundred small reads, once per start)."""


def _file_digest(update: Callable[[bytes], object], path: Path) -> None:
    size = path.stat().st_size
    update(size.to_bytes(8, "little"))
    with path.open("rb") as f:
        if size <= BLOCK_BYTES * SAMPLED_BLOCKS:
            update(f.read())
            return
        last = size - BLOCK_BYTES
        for i in range(SAMPLED_BLOCKS):  # the first and the last block included
            f.seek(last * i // (SAMPLED_BLOCKS - 1))
            update(f.read(BLOCK_BYTES))


def content_digest(idx_path: Path, bin_path: Path) -> str:
    """SHA-256 (hex) over the sizes and sampled blocks of an index and its token file."""
    h = hashlib.sha256(b"sailor-data-identity-v1")
    for p in (idx_path, bin_path):
        _file_digest(h.update, p)
    return h.hexdigest()


def indexed_identity(
    prepared: PreparedData, documents: range, seq_length: int, seed: int
) -> DataIdentity:
    """The identity of samples of ``seq_length`` drawn with ``seed`` from ``documents`` (the
    training split) of ``prepared``."""
    ds, m = prepared.dataset, prepared.manifest
    return DataIdentity(
        kind="indexed",
        seq_length=seq_length,
        seed=seed,
        vocab_size=m.tokenizer.vocab_size if m else None,
        tokenizer_sha256=m.tokenizer.sha256 if m else None,
        shuffle_seed=m.shuffle_seed if m else None,
        documents=ds.num_documents,
        tokens=ds.num_tokens,
        train_documents=(documents.start, documents.stop),
        content_sha256=content_digest(ds.idx_path, ds.bin_path),
    )
