"""``sailor data prepare``'s core: documents in, indexed dataset + manifest out.

Steps, in order: read the documents (empty ones are skipped; ``max_bytes`` stops reading
after that much text), get a tokenizer (a local ``tokenizer.json``, or a byte-level BPE
trained on these documents), shuffle the documents once with ``seed`` (a Feistel
permutation, :mod:`sailor.data.permutation`) and split them: the first ones are the train
split, the last ``ceil(validation_fraction * documents)`` the validation split. Each
document is tokenized without the tokenizer's own special tokens, preceded by the
beginning-of-sequence id when the tokenizer's template has one (``bos="auto"``: Llama's
``<s>``; GPT-2 and a trained BPE have none) and followed by the end-of-document id
(Megatron's ``preprocess_data.py --append-eod``), and stored as one sequence. Then
``OUT.bin``/``OUT.idx`` (:class:`IndexedDatasetWriter`), a copy of the tokenizer
(``OUT.tokenizer.json``) and the manifest (``OUT.json``,
:class:`~sailor.schemas.dataset.DatasetManifest`).

The manifest is the data set's commit. A preparation over an existing one removes its
manifest just before the new files replace the old ones, and writes the new one last, each
file fsync'd and renamed into place (:mod:`sailor.durable`). An interrupted run
(Ctrl-C, a crash, a full disk) leaves the old data set whole if it stops while
tokenizing, and after that files without a manifest, which ``sailor data info`` and the
trainer open as a Megatron data set of unknown vocabulary; never the old manifest
describing the new files (the same counts with another seed read as valid).

The documents are held in memory (the tokenizer trains on them and the shuffle needs them
all): fine for corpora of a few GB, not for a web crawl (shard it first).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from sailor.data.indexed import IndexedDatasetWriter, dtype_for_vocab, paths_of
from sailor.data.permutation import permute
from sailor.data.tokenizer import (
    DEFAULT_EOD_TOKEN,
    bos_of,
    eod_of,
    file_sha256,
    load_tokenizer,
    tokenizer_file,
    train_byte_bpe,
    vocab_bound,
)
from sailor.durable import remove_durably, write_durably
from sailor.schemas.dataset import CorpusSource, DatasetManifest, DocumentRange, TokenizerInfo

__all__ = [
    "PrepareOptions",
    "check_outputs_spare_inputs",
    "manifest_path",
    "output_paths",
    "prepare",
    "tokenizer_path",
]

_CHUNK_DOCS = 64
"""Documents per ``encode_batch`` call: large enough for the Rust side's threads, small
enough for a progress bar that moves."""

Progress = Callable[[str, int, int], None]
"""``progress(phase, done, total)``; phases "read" (bytes), "train-tokenizer" (0/1),
"tokenize" (bytes)."""


@dataclass(frozen=True)
class PrepareOptions:
    """How to prepare (everything but the documents)."""

    out: Path
    """Output prefix: OUT.bin, OUT.idx, OUT.json, OUT.tokenizer.json."""
    tokenizer: Path | None = None
    """A tokenizers JSON file; None: train a byte-level BPE on the corpus."""
    vocab_size: int = 4096
    """Vocabulary of the trained BPE (ignored with a tokenizer file)."""
    eod_token: str | None = None
    """End-of-document token; None: the first known one the tokenizer has."""
    bos: str = "auto"
    """Token each document starts with: "auto" (the tokenizer template's, if any), "none",
    or a token of the vocabulary."""
    validation_fraction: float = 0.1
    seed: int = 0
    max_bytes: int | None = None
    source_kind: Literal["text", "jsonl", "builtin"] = "text"
    source_inputs: tuple[str, ...] = ()
    source_field: str | None = None
    python_version: str | None = None


def manifest_path(prefix: Path | str) -> Path:
    """Where the manifest of data set ``prefix`` lives: ``PREFIX.json``."""
    idx, _ = paths_of(prefix)
    return idx.with_suffix(".json")


def tokenizer_path(prefix: Path | str) -> Path:
    """Where data set ``prefix`` keeps its tokenizer: ``PREFIX.tokenizer.json``."""
    idx, _ = paths_of(prefix)
    return idx.with_name(idx.stem + ".tokenizer.json")


def output_paths(prefix: Path | str) -> list[Path]:
    """Every file ``prepare`` writes for ``prefix``, its temporary files included."""
    idx, bin_ = paths_of(prefix)
    man = manifest_path(prefix)
    tok = tokenizer_path(prefix)
    return [idx, bin_, man, tok, *(q.with_name(q.name + ".tmp") for q in (idx, bin_, man, tok))]


def check_outputs_spare_inputs(opts: PrepareOptions) -> None:
    """Refuse a prefix whose outputs would overwrite an input (a corpus file, the
    tokenizer): ``--out corpus`` beside ``corpus.json`` would replace the text with the
    manifest. Checked before anything is read or written."""
    inputs: list[tuple[str, Path]] = []
    if opts.source_kind != "builtin":
        inputs += [("input", Path(i)) for i in opts.source_inputs]
    if opts.tokenizer is not None:
        inputs.append(("tokenizer", tokenizer_file(Path(opts.tokenizer))))
    outs = {q.resolve(): q for q in output_paths(opts.out)}
    for what, path in inputs:
        hit = outs.get(path.resolve())
        if hit is not None:
            raise ValueError(
                f"out={str(opts.out)!r} would overwrite the {what} {str(path)!r} (it writes "
                f"{hit.name}); choose another prefix"
            )


def _read(
    documents: Iterable[tuple[str, str]], max_bytes: int | None, progress: Progress | None
) -> tuple[list[str], int]:
    texts: list[str] = []
    total = 0
    for _, text in documents:
        if not text.strip():
            continue
        texts.append(text)
        total += len(text.encode("utf-8"))
        if progress:
            progress("read", total, max_bytes or 0)
        if max_bytes is not None and total >= max_bytes:
            break
    return texts, total


def _split_sizes(n: int, fraction: float) -> tuple[int, int]:
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"validation_fraction={fraction}: must be in [0, 1)")
    n_val = math.ceil(fraction * n) if fraction > 0 else 0
    if n_val >= n:
        raise ValueError(
            f"validation_fraction={fraction} of {n} documents leaves none for training"
        )
    return n - n_val, n_val


def prepare(
    documents: Iterable[tuple[str, str]],
    opts: PrepareOptions,
    progress: Progress | None = None,
) -> DatasetManifest:
    """Tokenize ``documents`` (``(name, text)`` pairs) into an indexed dataset; returns the
    manifest it wrote."""
    check_outputs_spare_inputs(opts)
    texts, total_bytes = _read(documents, opts.max_bytes, progress)
    if not texts:
        raise ValueError(f"no non-empty documents in {list(opts.source_inputs)}")
    n_train, n_val = _split_sizes(len(texts), opts.validation_fraction)

    if opts.tokenizer is not None:
        tok = load_tokenizer(opts.tokenizer)
        kind: Literal["file", "trained-bpe"] = "file"
    else:
        if progress:
            progress("train-tokenizer", 0, 1)
        tok = train_byte_bpe(texts, opts.vocab_size, opts.eod_token or DEFAULT_EOD_TOKEN)
        kind = "trained-bpe"
        if progress:
            progress("train-tokenizer", 1, 1)
    eod_token, eod_id = eod_of(tok, opts.eod_token)
    bos = bos_of(tok, opts.bos)
    head = [bos[1]] if bos else []
    vocab = vocab_bound(tok)  # the largest id + 1, not the count: ids may have gaps
    dtype = dtype_for_vocab(vocab)

    order = permute(np.arange(len(texts)), len(texts), opts.seed) if len(texts) > 1 else [0]
    tokens_per_doc: list[int] = []
    done_bytes = 0
    out = manifest_path(opts.out)
    with IndexedDatasetWriter(opts.out, dtype) as writer:
        for lo in range(0, len(texts), _CHUNK_DOCS):
            chunk = [texts[int(i)] for i in order[lo : lo + _CHUNK_DOCS]]
            for enc in tok.encode_batch(chunk, add_special_tokens=False):
                ids = np.asarray([*head, *enc.ids, eod_id], dtype=np.int64)
                writer.add_document(ids)
                tokens_per_doc.append(len(ids))
            done_bytes += sum(len(t.encode("utf-8")) for t in chunk)
            if progress:
                progress("tokenize", done_bytes, total_bytes)
        # the writer's close replaces the old files: the old data set is uncommitted first
        remove_durably(out)

    idx_path, _ = paths_of(opts.out)
    tok_path = tokenizer_path(opts.out)
    write_durably(tok_path, tok.to_str(pretty=True).encode())
    n_tokens = sum(tokens_per_doc)
    train_tokens = sum(tokens_per_doc[:n_train])
    manifest = DatasetManifest(
        prefix=idx_path.stem,
        dtype="uint16" if dtype == np.uint16 else "int32",
        tokenizer=TokenizerInfo(
            kind=kind,
            path=tok_path.name,
            sha256=file_sha256(tok_path),
            vocab_size=vocab,
            eod_token=eod_token,
            eod_id=eod_id,
            bos_token=bos[0] if bos else None,
            bos_id=bos[1] if bos else None,
        ),
        num_documents=len(texts),
        num_tokens=n_tokens,
        shuffle_seed=opts.seed,
        splits={
            "train": DocumentRange(first=0, end=n_train, tokens=train_tokens),
            "validation": DocumentRange(
                first=n_train, end=n_train + n_val, tokens=n_tokens - train_tokens
            ),
        },
        source=CorpusSource(
            kind=opts.source_kind,
            inputs=opts.source_inputs,
            field=opts.source_field,
            python_version=opts.python_version,
            max_bytes=opts.max_bytes,
            bytes=total_bytes,
        ),
    )
    write_durably(out, (manifest.model_dump_json(indent=2) + "\n").encode())
    return manifest
