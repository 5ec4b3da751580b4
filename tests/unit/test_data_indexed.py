"""Megatron indexed dataset: round trip, the on-disk layout, refusal of bad files with offsets."""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sailor.data.indexed import (
    HEADER_SIZE,
    INDEX_MAGIC,
    IndexedDataset,
    IndexedDatasetError,
    IndexedDatasetWriter,
    dtype_for_vocab,
)

DOCS = [[5, 6, 7, 0], [1, 0], [9, 9, 9, 9, 9, 0], [3, 0]]


def _write(prefix: Path, docs: list[list[int]] = DOCS, dtype: type = np.uint16) -> None:
    with IndexedDatasetWriter(prefix, dtype) as w:
        for d in docs:
            w.add_document(d)


def test_round_trip(tmp_path: Path) -> None:
    _write(tmp_path / "ds")
    ds = IndexedDataset(tmp_path / "ds")
    assert len(ds) == 4 and ds.num_documents == 4 and ds.num_tokens == 14
    assert ds.dtype == np.uint16
    for i, d in enumerate(DOCS):
        assert ds[i].tolist() == d
        assert ds.document_sequences(i) == range(i, i + 1)
    assert ds.document_tokens(1, 3).tolist() == DOCS[1] + DOCS[2]
    assert ds[-1].tolist() == DOCS[-1]


def test_layout_is_megatrons(tmp_path: Path) -> None:
    """Bytes as megatron/core/datasets/indexed_dataset.py's _IndexWriter writes them."""
    _write(tmp_path / "ds", dtype=np.int32)
    raw = (tmp_path / "ds.idx").read_bytes()
    assert raw[:9] == INDEX_MAGIC
    assert struct.unpack_from("<Q", raw, 9) == (1,)
    assert raw[17] == 4  # int32
    assert struct.unpack_from("<QQ", raw, 18) == (4, 5)
    lengths = np.frombuffer(raw, np.int32, 4, HEADER_SIZE)
    pointers = np.frombuffer(raw, np.int64, 4, HEADER_SIZE + 16)
    docs = np.frombuffer(raw, np.int64, 5, HEADER_SIZE + 48)
    assert lengths.tolist() == [4, 2, 6, 2]
    assert pointers.tolist() == [0, 16, 24, 48]
    assert docs.tolist() == [0, 1, 2, 3, 4]
    assert len(raw) == HEADER_SIZE + 4 * 4 + 8 * 4 + 8 * 5
    flat = np.asarray([t for d in DOCS for t in d], np.int32)
    assert (tmp_path / "ds.bin").read_bytes() == flat.tobytes()


def test_multi_sequence_documents(tmp_path: Path) -> None:
    with IndexedDatasetWriter(tmp_path / "ds", np.uint16) as w:
        w.add_sequence([1, 2])
        w.add_sequence([3])
        w.end_document()
        w.add_document([4, 5])
    ds = IndexedDataset(tmp_path / "ds")
    assert ds.num_documents == 2 and len(ds) == 3
    assert ds.document_sequences(0) == range(0, 2)
    assert ds.document_tokens(0, 1).tolist() == [1, 2, 3]


def test_writer_refuses_ids_beyond_dtype_and_leaves_nothing(tmp_path: Path) -> None:
    w = IndexedDatasetWriter(tmp_path / "ds", np.uint16)
    with pytest.raises(ValueError, match=r"sequence 1: token ids 0\.\.70000 do not fit uint16"), w:
        w.add_document([1])
        w.add_document([70000, 0])
    assert list(tmp_path.iterdir()) == []


def _events(monkeypatch: pytest.MonkeyPatch, fail_onto: str = "") -> list[tuple[str, str]]:
    """Record every ``os.fsync`` (the path its fd is open on) and ``os.replace`` (its
    destination), each passed through to the real call; a replace onto a name ending in
    ``fail_onto`` raises instead (the process dies between the two renames)."""
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", str(Path(f"/proc/self/fd/{fd}").readlink())))
        real_fsync(fd)

    def replace(src: Any, dst: Any, *a: Any, **kw: Any) -> None:
        if fail_onto and os.fspath(dst).endswith(fail_onto):
            raise OSError(5, "injected: the writer died here")
        events.append(("replace", os.fspath(dst)))
        real_replace(src, dst, *a, **kw)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return events


def test_the_writer_makes_each_file_durable_before_its_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, the .bin was renamed without an fsync and the directory never fsync'd: after
    a power loss the .idx (fsync'd) could describe a renamed .bin whose blocks were never
    written, zeros that read as token 0."""
    events = _events(monkeypatch)
    _write(tmp_path / "ds")
    b, i = str(tmp_path / "ds.bin"), str(tmp_path / "ds.idx")
    at = {e: n for n, e in enumerate(events)}
    assert ("fsync", b + ".tmp") in at, events
    assert at[("fsync", b + ".tmp")] < at[("replace", b)], events
    assert at[("fsync", i + ".tmp")] < at[("replace", i)], events
    assert events[-1] == ("fsync", str(tmp_path)), events  # the renames, durable


def test_a_writer_dying_between_the_renames_leaves_no_pair_that_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Replacing a data set of as many tokens (the same corpus, other documents): the new
    .bin was renamed over the old one, then the .idx rename failed. Before, the old .idx and
    the new .bin opened as a valid pair (same length, the old document boundaries over the
    new tokens: the splits cut at the wrong documents)."""
    old = [[5, 6, 7, 0], [1, 0], [9, 9, 0]]
    _write(tmp_path / "ds", old)
    _events(monkeypatch, fail_onto="ds.idx")
    with pytest.raises(OSError, match="injected"):
        _write(tmp_path / "ds", [[2, 0], [3, 3, 3, 3, 3, 3, 0]])
    monkeypatch.undo()
    with pytest.raises(FileNotFoundError, match=r"ds\.idx: no such file"):
        IndexedDataset(tmp_path / "ds")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds.bin"]  # no .tmp left behind


def test_dtype_for_vocab() -> None:
    assert dtype_for_vocab(50257) == np.uint16
    assert dtype_for_vocab(128256) == np.int32


def _refused(prefix: Path, file: str, offset: int, why: str) -> None:
    with pytest.raises(IndexedDatasetError) as err:
        IndexedDataset(prefix)
    e = err.value
    assert e.path.endswith(file), e
    assert e.offset == offset, e
    assert why in str(e), e
    assert f"at byte {offset}" in str(e)


def test_truncated_bin_is_refused_with_offset(tmp_path: Path) -> None:
    _write(tmp_path / "ds")
    b = tmp_path / "ds.bin"
    b.write_bytes(b.read_bytes()[:-3])  # 28 bytes -> 25
    _refused(tmp_path / "ds", "ds.bin", 25, "truncated: the index needs 28 bytes (sequence 3")


def test_trailing_bytes_in_bin_are_refused(tmp_path: Path) -> None:
    _write(tmp_path / "ds")
    b = tmp_path / "ds.bin"
    b.write_bytes(b.read_bytes() + b"\x00\x00")
    _refused(tmp_path / "ds", "ds.bin", 28, "2 trailing bytes")


def test_wrong_magic_is_refused(tmp_path: Path) -> None:
    _write(tmp_path / "ds")
    i = tmp_path / "ds.idx"
    i.write_bytes(b"TNTIDX\x00\x00" + i.read_bytes()[8:])  # fairseq's old "cached" index
    _refused(tmp_path / "ds", "ds.idx", 0, "not an MMIDIDX index")


def test_bad_version_and_dtype_code_are_refused(tmp_path: Path) -> None:
    _write(tmp_path / "ds")
    i = tmp_path / "ds.idx"
    raw = bytearray(i.read_bytes())
    raw[9] = 2
    i.write_bytes(bytes(raw))
    _refused(tmp_path / "ds", "ds.idx", 9, "version 2")
    raw[9], raw[17] = 1, 42
    i.write_bytes(bytes(raw))
    _refused(tmp_path / "ds", "ds.idx", 17, "dtype code 42")


@pytest.mark.parametrize("code", [6, 7], ids=["float64", "float32"])
def test_a_float_dtype_code_is_refused_not_read_as_token_ids(tmp_path: Path, code: int) -> None:
    """Megatron's enum has float codes; a token .bin never holds floats. Before, an .idx
    claiming float32 over int32 ids (same width, so every size check passed) was opened, and
    each id read as a denormal float cast to token 0: every sample all zeros, in vocabulary,
    trained on silently."""
    _write(tmp_path / "ds", dtype=np.int64 if code == 6 else np.int32)
    i = tmp_path / "ds.idx"
    raw = bytearray(i.read_bytes())
    raw[17] = code
    i.write_bytes(bytes(raw))
    _refused(tmp_path / "ds", "ds.idx", 17, f"dtype code {code} is float")


def test_the_writer_refuses_float_dtypes_and_float_ids(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"dtype=float32: not one of .*token ids are integers"):
        IndexedDatasetWriter(tmp_path / "f", np.float32)
    w = IndexedDatasetWriter(tmp_path / "ds", np.int32)
    with (
        pytest.raises(ValueError, match=r"sequence 1: token ids of dtype float64, not integers"),
        w,
    ):
        w.add_document([1, 2])
        w.add_document(np.array([3.7, 4.0]))  # would have been stored as 3, 4
    assert list(tmp_path.iterdir()) == []


def test_truncated_index_is_refused_with_offset(tmp_path: Path) -> None:
    _write(tmp_path / "ds")
    i = tmp_path / "ds.idx"
    raw = i.read_bytes()
    i.write_bytes(raw[:20])
    _refused(tmp_path / "ds", "ds.idx", 20, "truncated header")
    i.write_bytes(raw[:4])
    _refused(tmp_path / "ds", "ds.idx", 4, "truncated header")
    i.write_bytes(b"")
    _refused(tmp_path / "ds", "ds.idx", 0, "truncated header")
    i.write_bytes(raw[: HEADER_SIZE + 16 + 5])  # inside the pointers
    _refused(tmp_path / "ds", "ds.idx", HEADER_SIZE + 16, "the sequence pointers need bytes")
    i.write_bytes(raw[:-8])  # last document index missing
    _refused(tmp_path / "ds", "ds.idx", HEADER_SIZE + 48, "the document indices need bytes")


def test_inconsistent_sizes_are_refused(tmp_path: Path) -> None:
    _write(tmp_path / "ds")
    i = tmp_path / "ds.idx"
    raw = bytearray(i.read_bytes())
    good = bytes(raw)
    struct.pack_into("<i", raw, HEADER_SIZE + 4, 3)  # sequence 1 claims 3 tokens, not 2
    i.write_bytes(bytes(raw))
    # sequence 2 starts at byte 12, but 4 + 3 uint16 tokens before it put it at 14
    _refused(tmp_path / "ds", "ds.idx", HEADER_SIZE + 16 + 16, "sizes and pointers disagree")
    raw = bytearray(good)
    struct.pack_into("<i", raw, HEADER_SIZE, -1)
    i.write_bytes(bytes(raw))
    _refused(tmp_path / "ds", "ds.idx", HEADER_SIZE, "negative length")
    raw = bytearray(good)
    struct.pack_into("<q", raw, HEADER_SIZE + 48 + 8 * 4, 3)  # documents end before S
    i.write_bytes(bytes(raw))
    _refused(tmp_path / "ds", "ds.idx", HEADER_SIZE + 48 + 32, "not at the sequence count 4")
    raw = bytearray(good)
    struct.pack_into("<q", raw, HEADER_SIZE + 48 + 8 * 2, 0)  # goes backwards
    i.write_bytes(bytes(raw))
    _refused(tmp_path / "ds", "ds.idx", HEADER_SIZE + 48 + 16, "goes backwards")


def test_missing_file_names_it(tmp_path: Path) -> None:
    _write(tmp_path / "ds")
    (tmp_path / "ds.bin").unlink()
    with pytest.raises(FileNotFoundError, match=r"ds\.bin: no such file"):
        IndexedDataset(tmp_path / "ds")


def test_empty_dataset(tmp_path: Path) -> None:
    with IndexedDatasetWriter(tmp_path / "ds", np.uint16):
        pass
    ds = IndexedDataset(tmp_path / "ds.idx")
    assert len(ds) == 0 and ds.num_documents == 0 and ds.num_tokens == 0


def test_megatron_reads_ours_and_we_read_megatrons(tmp_path: Path) -> None:
    """Cross-check with Megatron-core's own reader and builder, when it is importable."""
    mc = pytest.importorskip(
        "megatron.core.datasets.indexed_dataset",
        reason="megatron-core is not installed (optional); the byte layout test above pins "
        "the format",
    )
    import torch

    _write(tmp_path / "ours")
    theirs = mc.IndexedDataset(str(tmp_path / "ours"))
    assert len(theirs) == len(DOCS)
    assert [theirs[i].tolist() for i in range(len(DOCS))] == DOCS
    assert theirs.document_indices.tolist() == [0, 1, 2, 3, 4]

    builder = mc.IndexedDatasetBuilder(str(tmp_path / "m.bin"), dtype=np.int32)
    for d in DOCS:
        builder.add_item(torch.tensor(d))
        builder.end_document()
    builder.finalize(str(tmp_path / "m.idx"))
    ours = IndexedDataset(tmp_path / "m")
    assert ours.dtype == np.int32 and ours.num_documents == len(DOCS)
    assert [ours[i].tolist() for i in range(len(ours))] == DOCS


@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_the_index_check_in_chunks_finds_the_same_faults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int
) -> None:
    """The check walks the index a chunk at a time (bounded memory on any corpus): every
    fault is found, at the same offset, whichever chunk it falls in or straddles."""
    from sailor.data import indexed

    monkeypatch.setattr(indexed, "CHECK_CHUNK", chunk)
    test_round_trip(tmp_path)
    test_inconsistent_sizes_are_refused(tmp_path)


def test_opening_a_large_index_holds_a_chunk_of_temporaries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two million one-token sequences: the check's numpy temporaries stay near a chunk's
    (~24 B per entry checked at a time), not ~24 B per sequence (48 MB here)."""
    import tracemalloc

    from sailor.data import indexed

    n = 2_000_000
    prefix = tmp_path / "big"
    lengths = np.ones(n, np.int32)
    pointers = np.arange(n, dtype=np.int64) * 2
    docs = np.arange(n + 1, dtype=np.int64)
    head = INDEX_MAGIC + struct.pack("<Q", 1) + bytes([8]) + struct.pack("<QQ", n, n + 1)
    (tmp_path / "big.idx").write_bytes(
        head + lengths.tobytes() + pointers.tobytes() + docs.tobytes()
    )
    (tmp_path / "big.bin").write_bytes(np.zeros(n, np.uint16).tobytes())
    monkeypatch.setattr(indexed, "CHECK_CHUNK", 1 << 16)
    tracemalloc.start()
    try:
        ds = IndexedDataset(prefix)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(ds) == n and ds.num_documents == n
    assert peak < 8 << 20, peak


def test_a_data_set_is_opened_once_per_version_of_its_files(tmp_path: Path) -> None:
    """Training and validation, and every in-place generation, open the same files: the
    index is read and checked once per version of them in a process; a new version (its
    files rewritten) is opened again."""
    import os

    from sailor.data.indexed import open_indexed

    _write(tmp_path / "ds")
    a = open_indexed(tmp_path / "ds")
    assert open_indexed(str(tmp_path / "ds")) is a
    _write(tmp_path / "ds", [[1, 2, 0]])
    st = (tmp_path / "ds.idx").stat()
    os.utime(tmp_path / "ds.idx", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    b = open_indexed(tmp_path / "ds")
    assert b is not a and len(b) == 1
    with pytest.raises(FileNotFoundError, match="no such file"):
        open_indexed(tmp_path / "missing")
