"""The identity of the training data a run's sample counter indexes, as a checkpoint records it.

A checkpoint's data position is one counter, ``consumed_samples``: sample ``n`` is a pure
function of the data and ``(seed, n)`` (``sailor.data.tokens``, ``megatron_patch.data``).
Resumed over other data (another corpus, sequence length, tokenizer, split or seed), the
counter goes on over other samples, and nothing else shows it: the loss curve looks fine.
So every checkpoint records a :class:`DataIdentity`, and a run resuming from one compares
its own before any shard is read (``sailor.checkpoint.data_fit``).

Cheap and stable: counts, the manifest's tokenizer digest and seeds, and a digest of sampled
blocks of the files (``sailor.data.identity``), never a path: a corpus moved or copied is the
same data. Pure data: no I/O.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from sailor.schemas._base import Frozen, field_error

__all__ = ["DataIdentity", "data_differences", "describe_differences"]


class DataIdentity(Frozen):
    """What decides the tokens of sample ``n`` of the training split, path excluded.

    Synthetic data is its generator's parameters (``kind``, ``vocab_size``, ``seq_length``,
    ``seed``); an indexed data set adds what its files and manifest hold. A field the data
    does not have (a data set without a manifest has no tokenizer) is None.
    """

    kind: Literal["synthetic", "indexed"] = Field(description="The data's kind.")
    seq_length: int = Field(gt=0, description="Tokens per sample's input (the model's).")
    seed: int = Field(ge=0, description="Seed of the sample order (the training config's).")
    vocab_size: int | None = Field(
        default=None,
        gt=0,
        description="Synthetic: the generator's vocabulary (the model's). Indexed: the "
        "manifest's tokenizer vocabulary; None without a manifest.",
    )
    tokenizer_sha256: str | None = Field(
        default=None,
        min_length=64,
        max_length=64,
        description="SHA-256 of the manifest's tokenizer file; None without a manifest.",
    )
    shuffle_seed: int | None = Field(
        default=None,
        ge=0,
        description="Seed the documents were shuffled with by `sailor data prepare`; None "
        "without a manifest.",
    )
    documents: int | None = Field(
        default=None, ge=0, description="Documents in the indexed data set; None: synthetic."
    )
    tokens: int | None = Field(
        default=None, ge=0, description="Tokens in the indexed data set; None: synthetic."
    )
    train_documents: tuple[int, int] | None = Field(
        default=None,
        description="Documents [first, end) of the training split; None: synthetic.",
    )
    content_sha256: str | None = Field(
        default=None,
        min_length=64,
        max_length=64,
        description="SHA-256 over the sizes of the .idx and .bin and sampled blocks of each "
        "(sailor.data.identity.content_digest); None: synthetic.",
    )

    @model_validator(mode="after")
    def _range(self) -> DataIdentity:
        r = self.train_documents
        if r is not None and not 0 <= r[0] <= r[1]:
            raise field_error("train_documents", r, "must be [first, end) with 0 <= first <= end")
        return self


def data_differences(saved: DataIdentity, current: DataIdentity) -> list[tuple[str, str, str]]:
    """``(field, saved value, current value)`` of every field that differs, in field order;
    empty when ``current`` is ``saved``'s data (pure)."""
    out: list[tuple[str, str, str]] = []
    for name in DataIdentity.model_fields:
        a, b = getattr(saved, name), getattr(current, name)
        if a != b:
            out.append((name, _shown(a), _shown(b)))
    return out


def describe_differences(changes: list[tuple[str, str, str]]) -> str:
    """``data.F: trained with F=X, this run has F=Y; ...`` (:func:`data_differences`'
    result) for an error message and the log."""
    return "; ".join(f"data.{f}: trained with {f}={a}, this run has {f}={b}" for f, a, b in changes)


def _shown(value: object) -> str:
    if isinstance(value, str) and len(value) == 64:
        return value[:12] + "..."  # a digest: enough to tell two apart in a message
    if isinstance(value, tuple):
        return f"[{value[0]}, {value[1]})"
    return repr(value)
