"""The manifest ``sailor data prepare`` writes beside an indexed dataset (``PREFIX.json``).

It records what a reader cannot see in the ``.bin``/``.idx`` pair: which tokenizer made the
ids (and its vocabulary size, which the model's must cover), the end-of-document id, which
documents are the train and the validation split, and where the text came from. Paths in it
are relative to the manifest's directory, so a prepared data set can be moved as a folder.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from sailor.schemas._base import Frozen, WireMessage, field_error

__all__ = ["CorpusSource", "DatasetManifest", "DocumentRange", "TokenizerInfo"]


class DocumentRange(Frozen):
    """Documents ``[first, end)`` of the data set and their token count."""

    first: int = Field(ge=0, description="First document of the range.")
    end: int = Field(ge=0, description="One past the last document of the range.")
    tokens: int = Field(ge=0, description="Tokens of these documents, EOD tokens included.")

    @model_validator(mode="after")
    def _order(self) -> DocumentRange:
        if self.end < self.first:
            raise field_error("end", self.end, f"is before first={self.first}")
        return self

    @property
    def documents(self) -> range:
        return range(self.first, self.end)


class TokenizerInfo(Frozen):
    """The tokenizer that produced the token ids."""

    kind: Literal["file", "trained-bpe"] = Field(
        description="'file': a tokenizers JSON given to prepare; 'trained-bpe': a byte-level "
        "BPE trained by prepare on the corpus itself."
    )
    path: str = Field(description="tokenizer.json, relative to the manifest's directory.")
    sha256: str = Field(min_length=64, max_length=64, description="SHA-256 of that file.")
    vocab_size: int = Field(
        gt=0,
        description="One above the largest token id (special tokens included): the vocabulary's "
        "size when its ids have no gaps.",
    )
    eod_token: str = Field(min_length=1, description="End-of-document token text.")
    eod_id: int = Field(ge=0, description="End-of-document token id, appended to each document.")
    bos_token: str | None = Field(
        default=None, description="Token each document starts with; None: none."
    )
    bos_id: int | None = Field(
        default=None, ge=0, description="Its id, put before each document; None: none."
    )

    @model_validator(mode="after")
    def _eod(self) -> TokenizerInfo:
        if self.eod_id >= self.vocab_size:
            raise field_error("eod_id", self.eod_id, f"not below vocab_size={self.vocab_size}")
        if (self.bos_token is None) != (self.bos_id is None):
            raise field_error("bos_id", self.bos_id, "given with bos_token, or neither")
        if self.bos_id is not None and self.bos_id >= self.vocab_size:
            raise field_error("bos_id", self.bos_id, f"not below vocab_size={self.vocab_size}")
        return self


class CorpusSource(Frozen):
    """Where the text came from."""

    kind: Literal["text", "jsonl", "builtin"] = Field(
        description="Text files (one document each), JSON lines (one document per line), or "
        "a corpus the Python installation ships (``--builtin-corpus``)."
    )
    inputs: tuple[str, ...] = Field(description="Input files, or the built-in corpus name.")
    field: str | None = Field(default=None, description="JSONL field holding the text.")
    python_version: str | None = Field(
        default=None,
        description="Python version whose files a built-in corpus was read from (its text "
        "differs between versions).",
    )
    max_bytes: int | None = Field(default=None, description="Text cut off after this many bytes.")
    bytes: int = Field(ge=0, description="UTF-8 bytes of text read.")


class DatasetManifest(WireMessage):
    """An indexed dataset as ``sailor data prepare`` wrote it."""

    prefix: str = Field(
        min_length=1, description="Data set prefix (PREFIX.bin/.idx), relative to the manifest."
    )
    dtype: Literal["uint16", "int32"] = Field(description="Token dtype of the .bin.")
    tokenizer: TokenizerInfo = Field(description="Tokenizer of the ids.")
    num_documents: int = Field(ge=0, description="Documents (each one sequence).")
    num_tokens: int = Field(ge=0, description="Tokens in the .bin, EOD tokens included.")
    shuffle_seed: int = Field(
        ge=0, description="Seed of the document order (documents are shuffled before the split)."
    )
    splits: dict[Literal["train", "validation"], DocumentRange] = Field(
        description="Document ranges of the splits; train first, validation after it."
    )
    source: CorpusSource = Field(description="Where the text came from.")

    @model_validator(mode="after")
    def _splits(self) -> DatasetManifest:
        if "train" not in self.splits:
            raise field_error("splits", sorted(self.splits), "has no 'train' split")
        covered = sorted((r.first, r.end) for r in self.splits.values())
        at = 0
        for first, end in covered:
            if first != at:
                raise field_error(
                    "splits", covered, f"do not tile documents 0..{self.num_documents}"
                )
            at = end
        if at != self.num_documents:
            raise field_error("splits", covered, f"do not tile documents 0..{self.num_documents}")
        if sum(r.tokens for r in self.splits.values()) != self.num_tokens:
            raise field_error(
                "splits",
                {k: v.tokens for k, v in self.splits.items()},
                f"token counts do not add up to num_tokens={self.num_tokens}",
            )
        return self
