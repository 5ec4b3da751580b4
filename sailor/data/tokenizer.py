"""Tokenizers for ``sailor data prepare``: a ``tokenizers`` JSON file, or a byte-level BPE
trained on the corpus itself.

A Hugging Face ``tokenizer.json`` (what ``tokenizers`` and ``transformers`` save) is loaded
from a local file; nothing is downloaded. Without one, :func:`train_byte_bpe` trains a small
byte-level BPE (GPT-2's scheme: bytes mapped to printable characters, so every text
round-trips and no token is unknown) with one special token, the end-of-document marker, as
id 0. Training is deterministic for a given corpus and vocabulary size (a single-threaded
merge loop in ``tokenizers``).

Must never download: only local files are read.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = [
    "DEFAULT_EOD_TOKEN",
    "EOD_CANDIDATES",
    "MAX_TRAINED_VOCAB",
    "MIN_TRAINED_VOCAB",
    "bos_of",
    "check_trained_vocab",
    "eod_of",
    "file_sha256",
    "load_tokenizer",
    "tokenizer_file",
    "train_byte_bpe",
    "vocab_bound",
    "vocabulary_difference",
]

DEFAULT_EOD_TOKEN = "<|endoftext|>"
EOD_CANDIDATES = (DEFAULT_EOD_TOKEN, "</s>", "<eos>", "<|end_of_text|>", "[SEP]")
"""Looked for, in order, when no ``--eod-token`` is given (GPT-2/NeoX, OPT/Llama-2,
Gemma-style, Llama-3, BERT-style)."""


def tokenizer_file(path: Path) -> Path:
    """The ``tokenizer.json`` that ``path`` names: itself, or the one in a directory (what
    ``transformers``' ``save_pretrained`` writes for a fast tokenizer)."""
    return path / "tokenizer.json" if path.is_dir() else path


def load_tokenizer(path: Path) -> Tokenizer:
    """A tokenizer from a local ``tokenizer.json``, or a directory holding one
    (:func:`tokenizer_file`), with the file's own truncation and padding turned off: a
    ``tokenizer.json`` saved by ``transformers`` after a call with ``truncation=True`` or
    ``padding=...`` keeps those settings, which ``transformers`` (and Megatron through it)
    applies only when asked; here they would cut every document to that length and pad it
    with pad ids, silently."""
    from tokenizers import Tokenizer

    if path.is_dir() and not tokenizer_file(path).is_file():
        raise FileNotFoundError(
            f"{path}: no tokenizer.json in this directory (only fast tokenizers are read)"
        )
    path = tokenizer_file(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no tokenizer file")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception on a malformed file
        raise ValueError(f"{path}: not a tokenizers JSON file: {exc}") from exc
    tok.no_truncation()
    tok.no_padding()
    return tok


MIN_TRAINED_VOCAB = 257 + 1
"""A byte-level BPE's 256 bytes, the EOD token, and one merge."""
MAX_TRAINED_VOCAB = 1 << 24
"""The largest BPE ``train_byte_bpe`` trains. Ids are int32 in the ``.bin`` (2^31 at most),
but the trainer (tokenizers 0.22) reserves ~66 B per id before it reads a text: 2^30 ids
asked for 70.9 GB and the process aborted in Rust (no Python error), 2^31 and above always
abort. 2^24 reserves ~1.1 GB; the largest vocabularies in use are ~256k ids (Gemma)."""


def check_trained_vocab(vocab_size: int, name: str = "vocab_size") -> None:
    """Refuse a BPE size :func:`train_byte_bpe` cannot train, naming ``name`` and the value."""
    if not MIN_TRAINED_VOCAB <= vocab_size <= MAX_TRAINED_VOCAB:
        raise ValueError(
            f"{name}={vocab_size}: a byte-level BPE is trained with {MIN_TRAINED_VOCAB} to "
            f"{MAX_TRAINED_VOCAB} ids (2^24: the trainer reserves ~66 B per id up front; the "
            "largest vocabularies in use are ~256k)"
        )


def train_byte_bpe(
    texts: Iterable[str], vocab_size: int, eod_token: str = DEFAULT_EOD_TOKEN
) -> Tokenizer:
    """A byte-level BPE of ``vocab_size`` ids trained on ``texts``; ``eod_token`` is id 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    check_trained_vocab(vocab_size)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[eod_token],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def vocab_bound(tok: Tokenizer) -> int:
    """One above the largest id ``tok`` may produce, added tokens included: the bound every
    token id of the data set is below (the model's vocabulary must cover it, the token dtype
    must hold it). Not the vocabulary's size: a tokenizer file may leave ids unused (ids
    0, 1, 2 and 300: a size of 4, ids up to 300), and a bound of 4 failed every batch that
    held id 300 as out of the vocabulary."""
    ids = tok.get_vocab(with_added_tokens=True).values()
    if not ids:
        raise ValueError("the tokenizer has an empty vocabulary")
    return max(ids) + 1


def eod_of(tok: Tokenizer, requested: str | None) -> tuple[str, int]:
    """``(token, id)`` of the end-of-document token: ``requested``, or the first of
    :data:`EOD_CANDIDATES` the vocabulary has."""
    names = [requested] if requested else list(EOD_CANDIDATES)
    for name in names:
        tid = tok.token_to_id(name)
        if tid is not None:
            return name, int(tid)
    raise ValueError(
        f"eod_token={requested!r}: not in the tokenizer's vocabulary"
        if requested
        else f"the tokenizer has none of {list(EOD_CANDIDATES)}; name one with --eod-token"
    )


def bos_of(tok: Tokenizer, requested: str) -> tuple[str, int] | None:
    """``(token, id)`` of the token each document starts with, or None.

    ``requested``: ``"auto"``, the one id the tokenizer's own template (its post-processor:
    Llama's ``<s>``, Llama-3's ``<|begin_of_text|>``, Gemma's ``<bos>``) puts before a text,
    none if it puts none (GPT-2, a trained BPE); ``"none"``; or a token of the vocabulary.
    """
    if requested == "none":
        return None
    if requested != "auto":
        tid = tok.token_to_id(requested)
        if tid is None:
            raise ValueError(f"bos_token={requested!r}: not in the tokenizer's vocabulary")
        return requested, int(tid)
    probe = "a"
    plain = tok.encode(probe, add_special_tokens=False).ids
    full = tok.encode(probe, add_special_tokens=True).ids
    k = next(
        (i for i in range(len(full) - len(plain) + 1) if full[i : i + len(plain)] == plain), None
    )
    if not plain or k is None or k == 0:
        return None
    if k > 1:
        raise ValueError(
            f"bos_token='auto': the tokenizer's template puts {k} ids {full[:k]} before a "
            "text; name the one to start documents with (--bos TOKEN) or --bos none"
        )
    tid = int(full[0])
    return str(tok.id_to_token(tid)), tid


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def vocabulary_difference(a: Path, b: Path) -> str | None:
    """None if the tokenizers of ``a`` and ``b`` (files or directories, as
    :func:`load_tokenizer` reads them) give every token text the same id, special tokens
    included; else the first difference, in words. Files with the same bytes are the same
    without being loaded."""
    if file_sha256(tokenizer_file(a)) == file_sha256(tokenizer_file(b)):
        return None
    va = load_tokenizer(a).get_vocab(with_added_tokens=True)
    vb = load_tokenizer(b).get_vocab(with_added_tokens=True)
    if len(va) != len(vb):
        return f"{len(va)} token ids against {len(vb)}"
    for text, i in sorted(va.items(), key=lambda kv: kv[1]):
        j = vb.get(text)
        if j != i:
            other = "absent" if j is None else f"id {j}"
            return f"token {text!r} is id {i} in the first, {other} in the second"
    return None
