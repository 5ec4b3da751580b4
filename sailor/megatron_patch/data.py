"""Deterministic data: a seeded synthetic token data set and which samples go where.

The data position is one global counter, ``consumed_samples``: iteration ``k`` of a run that
started at position ``c0`` reads samples ``c0 + k*B .. c0 + (k+1)*B - 1`` (``B`` the global
batch). Inside a global batch, sample ``i`` belongs to exactly one pipeline (the plan's
pipelines take consecutive ranges, in plan order; see ``roles.pipeline_sample_offsets``)
and within it to microbatch ``(i - offset) // microbatch_size``. Because sample ``n`` of the
data set is a pure function of ``(seed, n)``, any layout, after any re-layout, reads the same
tokens for the same position, and the single-process reference reads them too.

Each sample is ``seq_length + 1`` tokens: inputs are the first ``seq_length``, labels the last.
The tokens follow one seeded rule for the whole data set (an affine recurrence mod vocab from
a random start per sample) with 10% noise tokens, so that the loss actually falls within a
few iterations, which makes the tests meaningful.

Real data: :class:`IndexedTokens` serves samples of a Megatron indexed dataset
(:class:`sailor.data.TokenDataset`, also a pure function of ``(seed, n)``) through the same
``batch(indices) -> (inputs, labels)``; :func:`build_dataset` picks one of the two from a
training config's ``data`` section. Both satisfy :class:`TokenSource`, what the engine reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

import numpy as np
import numpy.typing as npt
import torch

from sailor.data import TokenDataset, max_token_id, open_prepared
from sailor.data.identity import indexed_identity
from sailor.data.prepared import manifest_path
from sailor.megatron_patch.roles import RankRole
from sailor.megatron_patch.vocab_parallel import LabelOutOfRangeError
from sailor.schemas.data_identity import DataIdentity
from sailor.schemas.model import ModelSpec
from sailor.schemas.training import DataConfig, IndexedData

__all__ = [
    "VALIDATION_SEED_OFFSET",
    "IndexedTokens",
    "SyntheticTokens",
    "TokenSource",
    "build_dataset",
    "check_tokenizer",
    "identity_of",
    "microbatch_indices",
    "vocab_bound",
]


VALIDATION_SEED_OFFSET = 1_000_003
"""The synthetic data's validation split: the same rule under seed ``seed + offset``
(other samples than training's, from the same distribution)."""


class TokenSource(Protocol):
    """What the engine reads: sample ``n`` is a pure function of ``(seed, n)``."""

    def batch(self, indices: range | list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, labels)``, int64, shape ``[len(indices), seq_length]``."""
        ...


def identity_of(data: TokenSource) -> DataIdentity | None:
    """What a checkpoint records of ``data`` (``schemas.data_identity``): the synthetic
    generator's parameters, an indexed data set's counts, manifest and sampled content;
    None for another source (a test's), which is then not compared on resume."""
    if isinstance(data, SyntheticTokens | IndexedTokens):
        return data.identity
    return None


def vocab_bound(data: TokenSource) -> int:
    """The vocabulary ``data``'s ids come from, when it says (an indexed data set's
    manifest); else no bound beyond the model's."""
    return data.vocab_size if isinstance(data, IndexedTokens) else 2**63 - 1


@dataclass(frozen=True)
class SyntheticTokens:
    """Sample ``n`` is a pure function of ``(seed, n)``.

    The recurrence ``cur <- (cur * mult + add) mod vocab`` is evaluated for all positions at
    once: position ``i`` of a sample starting at ``c`` holds ``(A[i] * c + B[i]) mod vocab``
    with ``A[i] = mult^i`` and ``B[i] = add * (mult^(i-1) + ... + 1)`` mod vocab, which depend
    only on the seed and are computed once. Same tokens as stepping the recurrence one
    position at a time (``tests/integration/test_megatron_patch_training.py`` checks it against
    that loop); a per-position Python loop cost ~0.1 ms per sample on a 2-core CPU, as much as a
    layer of the tiny test models.
    """

    vocab_size: int
    seq_length: int
    seed: int = 0
    _affine: tuple[torch.Tensor, torch.Tensor] = field(
        init=False, repr=False, compare=False, hash=False
    )

    def __post_init__(self) -> None:
        v = self.vocab_size
        rule = torch.Generator().manual_seed(self.seed)
        mult = int(torch.randint(1, v, (1,), generator=rule))
        add = int(torch.randint(0, v, (1,), generator=rule))
        a, b = [1], [0]
        for _ in range(self.seq_length):
            a.append(a[-1] * mult % v)
            b.append((b[-1] * mult + add) % v)
        # a, b < vocab, so a * cur + b < vocab**2 + vocab: no int64 overflow below ~3e9 tokens
        affine = (torch.tensor(a, dtype=torch.long), torch.tensor(b, dtype=torch.long))
        object.__setattr__(self, "_affine", affine)

    @property
    def identity(self) -> DataIdentity:
        """The generator's parameters: all that decides its samples."""
        return DataIdentity(
            kind="synthetic", seq_length=self.seq_length, seed=self.seed, vocab_size=self.vocab_size
        )

    def sample(self, n: int) -> torch.Tensor:
        """Token ids of sample ``n``, shape ``[seq_length + 1]``, int64."""
        if n < 0:
            raise ValueError(f"sample index n={n} must be >= 0")
        v = self.vocab_size
        g = torch.Generator().manual_seed((self.seed * 6_364_136_223 + n + 1) % (2**63))
        cur = int(torch.randint(0, v, (1,), generator=g))
        noise = torch.rand(self.seq_length + 1, generator=g) < 0.1
        rand_tok = torch.randint(0, v, (self.seq_length + 1,), generator=g)
        a, b = self._affine
        return torch.where(noise, rand_tok, (a * cur + b) % v)

    def batch(self, indices: range | list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, labels)`` of shape ``[len(indices), seq_length]`` for these samples."""
        toks = torch.stack([self.sample(n) for n in indices])
        return toks[:, :-1].contiguous(), toks[:, 1:].contiguous()


@dataclass(frozen=True)
class IndexedTokens:
    """Samples of an indexed dataset split as torch tensors (CPU, int64), every id checked
    against the data's vocabulary.

    ``build_dataset`` checks the vocabulary the data claims (its manifest's) against the
    model's, not the ids in the file: an id the manifest's tokenizer cannot produce (a
    ``.bin`` written with another tokenizer, or damaged) passed, and the embedding raised an
    IndexError on it (on a GPU a device assert, again at every relaunch). So every batch is
    checked, one min and one max over its tokens (microseconds beside a step), and an id
    outside ``[0, vocab_size)`` is named with its file and sample
    (:meth:`checked_batch`)."""

    tokens: TokenDataset
    vocab_size: int = 2**63 - 1
    """Ids are below this: the manifest's vocabulary (else the largest id in the file + 1)."""
    vocab_source: str = "the data's vocabulary"
    """Where ``vocab_size`` comes from, for the error (e.g. the manifest's path)."""
    identity: DataIdentity | None = None
    """What a checkpoint records of it (``sailor.data.identity``; the training split's,
    set by :func:`build_dataset`); None: not computed (then not compared on resume)."""

    def sample(self, n: int) -> torch.Tensor:
        """Token ids of sample ``n``, shape ``[seq_length + 1]``."""
        x, y = self.batch([n])
        return torch.cat([x[0], y[0, -1:]])

    def checked_batch(self, indices: range | list[int]) -> tuple[torch.Tensor, torch.Tensor, str]:
        """``(inputs, labels, problem)``: ``problem`` names the first id outside the
        vocabulary (its file, sample, position and value), '' when every id is in it. The
        engine masks and agrees such ids across its ranks (``bad_labels``); :meth:`batch`
        raises."""
        toks = self.tokens.samples(indices)
        problem = ""
        if toks.size and (int(toks.min()) < 0 or int(toks.max()) >= self.vocab_size):
            problem = self._first_bad(toks, list(indices))
        x, y = np.ascontiguousarray(toks[:, :-1]), np.ascontiguousarray(toks[:, 1:])
        return torch.from_numpy(x), torch.from_numpy(y), problem

    def batch(self, indices: range | list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, labels)``; LabelOutOfRangeError naming the first id outside the
        vocabulary, if any."""
        x, y, problem = self.checked_batch(indices)
        if problem:
            raise LabelOutOfRangeError(problem)
        return x, y

    def _first_bad(self, toks: npt.NDArray[np.int64], indices: list[int]) -> str:
        bad = (toks < 0) | (toks >= self.vocab_size)
        row, col = (int(v[0]) for v in np.nonzero(bad))
        return (
            f"{self.tokens.data.bin_path}: sample {indices[row]} holds token id "
            f"{int(toks[row, col])} at position {col} of its {toks.shape[1]} tokens "
            f"({int(bad.sum())} such id(s) in the batch), outside the vocabulary [0, "
            f"{self.vocab_size}) of {self.vocab_source}: the .bin was written with another "
            "tokenizer or is damaged; prepare it again (sailor data prepare) and check it "
            "with sailor data info"
        )


def _resolve(path: str, base: Path | None) -> Path:
    p = Path(path)
    return p if p.is_absolute() or base is None else base / p


def build_dataset(
    data: DataConfig,
    spec: ModelSpec,
    seed: int,
    split: Literal["train", "validation"] = "train",
    base_dir: Path | None = None,
) -> SyntheticTokens | IndexedTokens:
    """The data set of a training config's ``data`` section, at the model's sequence length.

    Relative paths are taken from ``base_dir`` (the config file's directory). An indexed
    data set whose token ids the model's vocabulary cannot embed is refused: by the
    manifest's vocabulary size, or, without a manifest, by the largest id in the file (one
    pass over it per version of the file: ``sailor.data.scan``). Its batches check their ids
    against that vocabulary (:class:`IndexedTokens`).
    """
    if not isinstance(data, IndexedData):
        offset = VALIDATION_SEED_OFFSET if split == "validation" else 0
        return SyntheticTokens(spec.vocab_size, spec.seq_length, seed + offset)
    manifest = _resolve(data.manifest, base_dir) if data.manifest is not None else None
    prepared = open_prepared(_resolve(data.prefix, base_dir), manifest, data.validation_fraction)
    tokens = prepared.tokens(split, spec.seq_length, seed)
    identity = None
    if split == "train":  # what the sample counter indexes, recorded in every checkpoint
        identity = indexed_identity(prepared, prepared.splits["train"], spec.seq_length, seed)
    vocab = prepared.vocab_size
    source = f"the manifest {manifest_path(_resolve(data.prefix, base_dir), manifest)}"
    if vocab is None:  # the whole file's largest id, scanned once per version of it
        vocab = max_token_id(prepared.dataset) + 1
        source = "the largest id in the file"
    if vocab > spec.vocab_size:
        raise ValueError(
            f"data.prefix={data.prefix!r}: token ids need a vocabulary of {vocab}, the model "
            f"{spec.name!r} has vocab_size={spec.vocab_size}"
        )
    return IndexedTokens(tokens, vocab, source, identity)


def check_tokenizer(data: DataConfig, model_dir: Path, base_dir: Path | None = None) -> None:
    """Refuse an indexed data set whose manifest's tokenizer is not the one of the model
    whose weights are loaded (``model_dir``'s ``tokenizer.json``): its ids would mean other
    tokens to the model. Without a manifest or without a ``tokenizer.json`` in the model's
    directory there is nothing to compare."""
    if not isinstance(data, IndexedData):
        return
    from sailor.data import read_manifest
    from sailor.data.prepared import manifest_path, manifest_tokenizer
    from sailor.data.tokenizer import tokenizer_file, vocabulary_difference

    given = _resolve(data.manifest, base_dir) if data.manifest is not None else None
    mpath = manifest_path(_resolve(data.prefix, base_dir), given)
    theirs = tokenizer_file(model_dir)
    if not mpath.is_file() or not theirs.is_file():
        return
    ours = manifest_tokenizer(mpath, read_manifest(mpath))
    diff = vocabulary_difference(ours, theirs)
    if diff is not None:
        raise ValueError(
            f"data.prefix={data.prefix!r}: prepared with the tokenizer {ours}, not the "
            f"model's {theirs} ({diff}); prepare it with --tokenizer {model_dir}"
        )


def microbatch_indices(role: RankRole, consumed_samples: int, microbatch: int) -> range:
    """Data-set indices of microbatch ``microbatch`` of this rank's pipeline.

    ``consumed_samples`` is the global data position at the start of the iteration.
    """
    if not 0 <= microbatch < role.num_microbatches:
        raise ValueError(f"microbatch={microbatch}: outside 0..{role.num_microbatches - 1}")
    first = consumed_samples + role.sample_offset + microbatch * role.microbatch_size
    return range(first, first + role.microbatch_size)
