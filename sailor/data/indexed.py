"""Megatron-LM's indexed dataset (``MMIDIDX``): the on-disk token format, read and written.

A data set is two files with a common prefix. ``PREFIX.bin`` holds the token ids of every
sequence back to back, in one integer dtype, nothing else. ``PREFIX.idx`` describes them
(little-endian, the layout of ``megatron/core/datasets/indexed_dataset.py``'s
``_IndexWriter``/``_IndexReader``)::

    offset  size        field
    0       9           magic b"MMIDIDX\\x00\\x00"
    9       8  (u64)    version, 1
    17      1  (u8)     dtype code of the .bin (see ``DTYPE_CODES``)
    18      8  (u64)    S, the number of sequences
    26      8  (u64)    D, the number of document indices (documents + 1)
    34      4*S (i32)   sequence lengths, in tokens
    34+4S   8*S (i64)   sequence pointers, byte offsets into the .bin
    34+12S  8*D (i64)   document indices: document d is sequences [doc[d], doc[d+1])
    [34+12S+8D  S (i8)  sequence modes, only in Megatron's multimodal data sets; ignored]

So a file Megatron's ``preprocess_data.py`` wrote is read here, and one written here is read
by Megatron. On open, the reader checks everything it will later trust (sizes, pointers,
document boundaries, the .bin's length) and refuses a bad or truncated file with
:class:`IndexedDatasetError`, naming the file and the byte offset where it goes wrong; after
that, reads are plain slices of a memory map.

Must never import torch: the engine converts the numpy arrays it reads.
"""

from __future__ import annotations

import os
import struct
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType

import numpy as np
import numpy.typing as npt

from sailor.durable import fsync_dir

__all__ = [
    "DTYPE_CODES",
    "HEADER_SIZE",
    "INDEX_MAGIC",
    "IndexedDataset",
    "IndexedDatasetError",
    "IndexedDatasetWriter",
    "dtype_for_vocab",
    "open_indexed",
    "paths_of",
]

INDEX_MAGIC = b"MMIDIDX\x00\x00"
_VERSION = 1
HEADER_SIZE = len(INDEX_MAGIC) + 8 + 1 + 8 + 8
"""Bytes before the sequence lengths (magic, version, dtype code, two counts)."""

DTYPE_CODES: dict[int, np.dtype[np.generic]] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
"""Megatron's ``DType`` enum: code in the .idx header -> dtype of the .bin."""

_INT_CODES = {code: dt for code, dt in DTYPE_CODES.items() if dt.kind in "iu"}
"""The codes a token ``.bin`` may have: the float ones are refused by reader and writer."""
_INT_CODE_OF = {dt: code for code, dt in _INT_CODES.items()}


class IndexedDatasetError(ValueError):
    """A data set file that cannot be trusted: which file, at which byte, and why.

    Permanent: the file has to be rewritten (``sailor data prepare``); retrying won't help.
    """

    def __init__(self, path: Path | str, offset: int, why: str) -> None:
        self.path = str(path)
        self.offset = offset
        self.why = why
        super().__init__(f"{self.path}: at byte {offset}: {why}")


def paths_of(prefix: Path | str) -> tuple[Path, Path]:
    """``(PREFIX.idx, PREFIX.bin)``; a prefix given with either suffix is accepted."""
    p = str(prefix)
    for suffix in (".idx", ".bin"):
        if p.endswith(suffix):
            p = p[: -len(suffix)]
    return Path(p + ".idx"), Path(p + ".bin")


def dtype_for_vocab(vocab_size: int) -> np.dtype[np.generic]:
    """The token dtype Megatron picks: uint16 below 65500 ids, else int32."""
    if vocab_size <= 0:
        raise ValueError(f"vocab_size={vocab_size}: must be > 0")
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


def _first_bad(mask: npt.NDArray[np.bool_]) -> int:
    return int(np.argmax(mask))


CHECK_CHUNK = 1 << 22
"""Index entries checked at a time when a data set is opened (~100 MB of temporaries)."""


class IndexedDataset:
    """Read-only, memory-mapped view of ``PREFIX.bin``/``PREFIX.idx``, checked on open.

    ``ds[i]`` is sequence ``i`` (a numpy view of the .bin, not a copy). Documents are ranges
    of sequences; :meth:`document_sequences` gives them. ``tokens(first, end)`` is the token
    stream of sequences ``[first, end)``, which the writer stores contiguously.
    """

    def __init__(self, prefix: Path | str) -> None:
        self.idx_path, self.bin_path = paths_of(prefix)
        idx = self.idx_path
        for p in (self.idx_path, self.bin_path):
            if not p.is_file():
                raise FileNotFoundError(f"{p}: no such file (data set prefix {prefix!s})")
        size = idx.stat().st_size
        with idx.open("rb") as f:
            head = f.read(HEADER_SIZE)
        if len(head) < len(INDEX_MAGIC) and INDEX_MAGIC.startswith(head):
            raise IndexedDatasetError(
                idx, size, f"truncated header: {size} bytes, the header needs {HEADER_SIZE}"
            )
        if head[: len(INDEX_MAGIC)] != INDEX_MAGIC:
            raise IndexedDatasetError(
                idx, 0, f"magic {head[:9]!r} is not {INDEX_MAGIC!r} (not an MMIDIDX index)"
            )
        if len(head) < HEADER_SIZE:
            raise IndexedDatasetError(
                idx, size, f"truncated header: {size} bytes, the header needs {HEADER_SIZE}"
            )
        (version,) = struct.unpack_from("<Q", head, 9)
        if version != _VERSION:
            raise IndexedDatasetError(idx, 9, f"version {version} is not {_VERSION}")
        code = head[17]
        if code not in DTYPE_CODES:
            raise IndexedDatasetError(
                idx, 17, f"dtype code {code} is not one of {sorted(DTYPE_CODES)}"
            )
        self.dtype = DTYPE_CODES[code]
        if self.dtype.kind not in "iu":
            # Megatron's enum has float codes, but token ids are integers: read as floats,
            # int32 ids are denormals that cast to 0 (every sample all zeros, in vocabulary)
            raise IndexedDatasetError(
                idx,
                17,
                f"dtype code {code} is {self.dtype}, not an integer dtype: token ids are "
                f"integers (one of codes {sorted(_INT_CODES)}; Megatron writes uint16 or int32)",
            )
        n_seq, n_doc = struct.unpack_from("<QQ", head, 18)
        off_ptr = HEADER_SIZE + 4 * n_seq
        off_doc = off_ptr + 8 * n_seq
        end = off_doc + 8 * n_doc
        for name, start, stop in (
            ("sequence lengths", HEADER_SIZE, off_ptr),
            ("sequence pointers", off_ptr, off_doc),
            ("document indices", off_doc, end),
        ):
            if stop > size:
                raise IndexedDatasetError(
                    idx,
                    min(start, size),
                    f"truncated: the {name} need bytes [{start}, {stop}) "
                    f"(S={n_seq} sequences, D={n_doc} document indices), the file has {size}",
                )
        if size not in (end, end + n_seq):  # + S: Megatron's multimodal sequence modes
            raise IndexedDatasetError(
                idx, end, f"{size - end} trailing bytes after the document indices"
            )
        whole = np.memmap(idx, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)
        self.sequence_lengths: npt.NDArray[np.int32] = whole[HEADER_SIZE:off_ptr].view(np.int32)
        self.sequence_pointers: npt.NDArray[np.int64] = whole[off_ptr:off_doc].view(np.int64)
        self.document_indices: npt.NDArray[np.int64] = whole[off_doc:end].view(np.int64)
        self._check_index(n_seq, off_ptr, off_doc)
        self._open_bin()

    def _check_index(self, n_seq: int, off_ptr: int, off_doc: int) -> None:
        """Lengths, pointers and document indices, in chunks of :data:`CHECK_CHUNK` entries:
        the temporaries stay ~24 B x the chunk, not x the sequence count (a corpus split into
        a billion sequences would need ~22 GiB on every rank otherwise)."""
        idx, lengths, ptrs, docs = (
            self.idx_path,
            self.sequence_lengths,
            self.sequence_pointers,
            self.document_indices,
        )
        item = self.dtype.itemsize
        at = 0  # the .bin byte the next sequence must start at
        for first in range(0, n_seq, CHECK_CHUNK):
            ln = lengths[first : first + CHECK_CHUNK]
            if (ln < 0).any():
                i = first + _first_bad(ln < 0)
                raise IndexedDatasetError(
                    idx, HEADER_SIZE + 4 * i, f"sequence {i} has negative length {lengths[i]}"
                )
            sizes = ln.astype(np.int64) * item
            expected = np.empty(len(ln), np.int64)
            expected[0] = at
            np.cumsum(sizes[:-1], out=expected[1:])
            expected[1:] += at
            bad = ptrs[first : first + CHECK_CHUNK] != expected
            if bad.any():
                j = _first_bad(bad)
                i = first + j
                raise IndexedDatasetError(
                    idx,
                    off_ptr + 8 * i,
                    f"sequence {i} points to .bin byte {ptrs[i]}, but the sizes before it put "
                    f"it at {expected[j]} (sizes and pointers disagree)",
                )
            at = int(expected[-1]) + int(sizes[-1])
        if len(docs) == 0 or docs[0] != 0:
            got = "nothing" if len(docs) == 0 else str(docs[0])
            raise IndexedDatasetError(idx, off_doc, f"document indices start at {got}, not 0")
        if docs[-1] != n_seq:
            raise IndexedDatasetError(
                idx,
                off_doc + 8 * (len(docs) - 1),
                f"document indices end at {docs[-1]}, not at the sequence count {n_seq}",
            )
        for first in range(0, len(docs) - 1, CHECK_CHUNK):
            back = np.diff(docs[first : first + CHECK_CHUNK + 1]) < 0
            if back.any():
                i = first + _first_bad(back) + 1
                raise IndexedDatasetError(
                    idx, off_doc + 8 * i, f"document index {i} = {docs[i]} goes backwards"
                )

    def _open_bin(self) -> None:
        n_seq = len(self.sequence_lengths)
        item = self.dtype.itemsize
        need = (
            int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * item if n_seq else 0
        )
        have = self.bin_path.stat().st_size
        if have < need:
            last = int(np.searchsorted(self.sequence_pointers, have, side="right")) - 1
            raise IndexedDatasetError(
                self.bin_path,
                have,
                f"truncated: the index needs {need} bytes (sequence {max(last, 0)} of {n_seq} "
                f"runs past the end), the file has {have}",
            )
        if have > need:
            raise IndexedDatasetError(
                self.bin_path, need, f"{have - need} trailing bytes the index does not describe"
            )
        self._bin: npt.NDArray[np.generic] = (
            np.memmap(self.bin_path, dtype=self.dtype, mode="r")
            if need
            else np.zeros(0, self.dtype)
        )

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def num_tokens(self) -> int:
        return len(self._bin)

    def _start(self, seq: int) -> int:
        if seq == len(self):
            return len(self._bin)
        return int(self.sequence_pointers[seq]) // self.dtype.itemsize

    def __getitem__(self, i: int) -> npt.NDArray[np.generic]:
        if not -len(self) <= i < len(self):
            raise IndexError(f"sequence {i} outside 0..{len(self) - 1}")
        i %= len(self)
        start = self._start(i)
        return self._bin[start : start + int(self.sequence_lengths[i])]

    def document_sequences(self, doc: int) -> range:
        """Sequence indices of document ``doc``."""
        if not 0 <= doc < self.num_documents:
            raise IndexError(f"document {doc} outside 0..{self.num_documents - 1}")
        return range(int(self.document_indices[doc]), int(self.document_indices[doc + 1]))

    def tokens(self, first_seq: int, end_seq: int) -> npt.NDArray[np.generic]:
        """The token stream of sequences ``[first_seq, end_seq)`` (a view, no copy)."""
        if not 0 <= first_seq <= end_seq <= len(self):
            raise IndexError(f"sequences [{first_seq}, {end_seq}) outside 0..{len(self)}")
        return self._bin[self._start(first_seq) : self._start(end_seq)]

    def document_tokens(self, first_doc: int, end_doc: int) -> npt.NDArray[np.generic]:
        """The token stream of documents ``[first_doc, end_doc)`` (a view, no copy)."""
        if not 0 <= first_doc <= end_doc <= self.num_documents:
            raise IndexError(f"documents [{first_doc}, {end_doc}) outside 0..{self.num_documents}")
        docs = self.document_indices
        return self.tokens(int(docs[first_doc]), int(docs[end_doc]))


class IndexedDatasetWriter:
    """Writes ``PREFIX.bin``/``PREFIX.idx``; both appear only once :meth:`close` succeeds.

    ``add_document(tokens)`` stores one document as one sequence (what ``sailor data
    prepare`` and Megatron's ``preprocess_data.py`` without sentence splitting write);
    ``add_sequence`` + ``end_document`` store a document of several sequences. Files are
    written under temporary names and renamed, the .idx last, so a crash never leaves a pair
    that looks complete.
    """

    def __init__(self, prefix: Path | str, dtype: npt.DTypeLike) -> None:
        self.dtype = np.dtype(dtype)
        if self.dtype not in _INT_CODE_OF:
            raise ValueError(
                f"dtype={self.dtype}: not one of {sorted(map(str, _INT_CODE_OF))} "
                "(token ids are integers)"
            )
        self.idx_path, self.bin_path = paths_of(prefix)
        self.idx_path.parent.mkdir(parents=True, exist_ok=True)
        self._tmp_bin = self.bin_path.with_name(self.bin_path.name + ".tmp")
        self._bin = self._tmp_bin.open("wb")
        self._lengths: list[int] = []
        self._docs: list[int] = [0]
        self._closed = False
        self._info = np.iinfo(self.dtype)

    def add_sequence(self, tokens: npt.ArrayLike) -> None:
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise ValueError(f"sequence {len(self._lengths)}: shape {arr.shape} is not 1-D")
        if arr.size and arr.dtype.kind not in "iu":
            raise ValueError(
                f"sequence {len(self._lengths)}: token ids of dtype {arr.dtype}, not integers"
            )
        if arr.size:
            lo, hi = int(arr.min()), int(arr.max())
            if lo < self._info.min or hi > self._info.max:
                raise ValueError(
                    f"sequence {len(self._lengths)}: token ids {lo}..{hi} do not fit "
                    f"{self.dtype} ({self._info.min}..{self._info.max})"
                )
        if arr.size > np.iinfo(np.int32).max:
            raise ValueError(f"sequence {len(self._lengths)}: {arr.size} tokens > int32 max")
        self._bin.write(np.ascontiguousarray(arr, dtype=self.dtype).tobytes(order="C"))
        self._lengths.append(int(arr.size))

    def end_document(self) -> None:
        self._docs.append(len(self._lengths))

    def add_document(self, tokens: npt.ArrayLike) -> None:
        self.add_sequence(tokens)
        self.end_document()

    def add_documents(self, docs: Iterable[npt.ArrayLike]) -> None:
        for d in docs:
            self.add_document(d)

    @property
    def num_documents(self) -> int:
        return len(self._docs) - 1

    def close(self) -> None:
        """Write the index and move both files into place.

        Both files are fsync'd before they are renamed and the directory after, so a
        power loss never leaves a renamed .bin whose blocks were not written (zeros that
        read as token 0). A data set already under these names has its .idx removed before
        the new .bin takes its name: a crash between the two renames leaves a .bin without
        an .idx (refused as missing), never the new .bin under the old .idx (same length,
        other documents: read as valid)."""
        if self._closed:
            return
        self._closed = True
        tmp_idx = self.idx_path.with_name(self.idx_path.name + ".tmp")
        try:
            self._bin.flush()
            os.fsync(self._bin.fileno())
            self._bin.close()
            self._write_index(tmp_idx)
            self.idx_path.unlink(missing_ok=True)
            self._tmp_bin.replace(self.bin_path)
            tmp_idx.replace(self.idx_path)
        except BaseException:
            self._bin.close()
            self._tmp_bin.unlink(missing_ok=True)
            tmp_idx.unlink(missing_ok=True)
            raise
        fsync_dir(self.idx_path.parent)

    def _write_index(self, path: Path) -> None:
        if self._docs[-1] != len(self._lengths):
            self._docs.append(len(self._lengths))  # sequences after the last end_document
        lengths = np.asarray(self._lengths, dtype=np.int32)
        pointers = np.zeros(len(lengths), np.int64)
        if len(lengths):
            np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        with path.open("wb") as f:
            f.write(INDEX_MAGIC)
            f.write(struct.pack("<Q", _VERSION))
            f.write(struct.pack("<B", _INT_CODE_OF[self.dtype]))
            f.write(struct.pack("<Q", len(lengths)))
            f.write(struct.pack("<Q", len(self._docs)))
            f.write(lengths.tobytes(order="C"))
            f.write(pointers.tobytes(order="C"))
            f.write(np.asarray(self._docs, dtype=np.int64).tobytes(order="C"))
            f.flush()
            os.fsync(f.fileno())

    def abort(self) -> None:
        """Drop what was written (nothing appears under the final names)."""
        if self._closed:
            return
        self._closed = True
        self._bin.close()
        self._tmp_bin.unlink(missing_ok=True)

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


_OPENED: OrderedDict[tuple[str, int, int, int, int], IndexedDataset] = OrderedDict()
_OPENED_MAX = 8


def open_indexed(prefix: Path | str) -> IndexedDataset:
    """``IndexedDataset(prefix)``, opened and checked once per version of its files in this
    process: a rank opens its data set for training and for validation, and an in-place
    worker again at every generation, and each open read the whole index (12 B per
    sequence) to check it. The version is both files' size and modification time; a data
    set is read-only, so the object is shared."""
    idx, bin_ = paths_of(prefix)
    try:
        si, sb = idx.stat(), bin_.stat()
    except OSError:
        return IndexedDataset(prefix)  # its own error, naming the missing file
    key = (str(idx.resolve()), si.st_size, si.st_mtime_ns, sb.st_size, sb.st_mtime_ns)
    hit = _OPENED.get(key)
    if hit is not None:
        _OPENED.move_to_end(key)
        return hit
    ds = IndexedDataset(prefix)
    _OPENED[key] = ds
    while len(_OPENED) > _OPENED_MAX:
        _OPENED.popitem(last=False)
    return ds
