"""Open a prepared data set: the indexed files, checked against their manifest, and its splits.

A manifest written by ``sailor data prepare`` (``PREFIX.json``) is used when given or when it
sits beside the data set; it must describe these files (document and token counts), or they
are refused. A Megatron data set without a manifest is split by ``validation_fraction``
(the last documents are the validation split) and has no known vocabulary size.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import ValidationError

from sailor.data.indexed import IndexedDataset, IndexedDatasetError, open_indexed, paths_of
from sailor.data.tokens import TokenDataset, document_split
from sailor.schemas.dataset import DatasetManifest

__all__ = [
    "PreparedData",
    "Split",
    "manifest_path",
    "manifest_tokenizer",
    "open_prepared",
    "read_manifest",
]

Split = Literal["train", "validation"]


def read_manifest(path: Path) -> DatasetManifest:
    """A manifest from its file; a bad one is refused naming the file and the field."""
    try:
        return DatasetManifest.model_validate_json(path.read_text())
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in first["loc"]) or "(top level)"
        raise ValueError(f"{path}: {where}: {first['msg']}") from exc


def manifest_tokenizer(path: Path, manifest: DatasetManifest) -> Path:
    """The tokenizer file the manifest at ``path`` names (``tokenizer.path``, relative to its
    directory), refused when it resolves outside that directory: an absolute path, ``..``
    or a symlink out would make a reader open (and compare, hash, report) a file the data
    set does not own."""
    value = manifest.tokenizer.path
    home = path.parent.resolve()
    named = Path(value)
    target = (home / named).resolve()
    if named.is_absolute() or not target.is_relative_to(home):
        raise ValueError(
            f"{path}: tokenizer.path={value!r} resolves outside the data set's directory "
            f"{home} (to {target}); it must name a file beside the manifest"
        )
    return target


@dataclass(frozen=True)
class PreparedData:
    """An opened data set, its manifest (if any) and its document splits."""

    dataset: IndexedDataset
    manifest: DatasetManifest | None
    splits: dict[Split, range]

    @property
    def vocab_size(self) -> int | None:
        """The tokenizer's vocabulary size, when a manifest records it."""
        return self.manifest.tokenizer.vocab_size if self.manifest else None

    def tokens(self, split: Split, seq_length: int, seed: int) -> TokenDataset:
        """Samples of ``split`` (see :class:`TokenDataset`)."""
        docs = self.splits[split]
        if len(docs) == 0:
            raise ValueError(f"{self.dataset.idx_path}: the {split} split has no documents")
        return TokenDataset(self.dataset, seq_length, seed, docs)


def manifest_path(prefix: Path | str, manifest: Path | str | None = None) -> Path:
    """Where a data set's manifest is: ``manifest`` if given, else ``PREFIX.json`` (which
    may not exist: a data set prepared elsewhere has none)."""
    return Path(manifest) if manifest is not None else paths_of(prefix)[0].with_suffix(".json")


def open_prepared(
    prefix: Path | str,
    manifest: Path | str | None = None,
    validation_fraction: float = 0.0,
) -> PreparedData:
    """Open ``prefix`` with its manifest (given, or ``PREFIX.json`` if present)."""
    mpath = manifest_path(prefix, manifest)
    if manifest is None and not mpath.is_file():
        ds = open_indexed(prefix)
        splits = document_split(ds.num_documents, validation_fraction)
        return PreparedData(
            ds, None, {"train": splits["train"], "validation": splits["validation"]}
        )
    if validation_fraction:
        raise ValueError(
            f"validation_fraction={validation_fraction}: the manifest {mpath} gives the splits"
        )
    m = read_manifest(mpath)
    ds = open_indexed(prefix)
    if ds.num_documents != m.num_documents:
        raise IndexedDatasetError(
            ds.idx_path,
            26,
            f"{ds.num_documents} documents, the manifest {mpath} says {m.num_documents}",
        )
    if ds.dtype.name != m.dtype:  # a .bin of another preparation beside this manifest
        raise IndexedDatasetError(
            ds.idx_path, 17, f"token dtype {ds.dtype.name}, the manifest {mpath} says {m.dtype}"
        )
    if ds.num_tokens != m.num_tokens:
        raise IndexedDatasetError(
            ds.bin_path, 0, f"{ds.num_tokens} tokens, the manifest {mpath} says {m.num_tokens}"
        )
    ranges: dict[Split, range] = {k: r.documents for k, r in m.splits.items()}
    ranges.setdefault("validation", range(m.num_documents, m.num_documents))
    return PreparedData(ds, m, ranges)
