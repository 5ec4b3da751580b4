"""The largest token id of a data set without a manifest: scanned once per version of the
``.bin`` and kept beside it (sailor.data.scan)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from sailor.data import IndexedDataset, IndexedDatasetWriter, max_token_id
from sailor.data.scan import scan_path


def _write(prefix: Path, docs: list[list[int]]) -> IndexedDataset:
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for d in docs:
            w.add_document(d)
    return IndexedDataset(prefix)


def test_scanned_once_then_read_back_while_the_file_is_the_same(tmp_path: Path) -> None:
    ds = _write(tmp_path / "ds", [[1, 7, 3], [40, 2], [5]])
    assert max_token_id(ds) == 40
    rec = json.loads(scan_path(ds).read_text())
    assert rec["max_token"] == 40 and rec["bin_bytes"] == ds.bin_path.stat().st_size
    # the record is what a later start reads: change it (the file untouched) and it is used
    scan_path(ds).write_text(json.dumps({**rec, "max_token": 41}))
    assert max_token_id(IndexedDataset(tmp_path / "ds")) == 41


def test_a_new_version_of_the_file_is_scanned_again(tmp_path: Path) -> None:
    ds = _write(tmp_path / "ds", [[1, 7, 3], [40, 2]])
    assert max_token_id(ds) == 40
    ds = _write(tmp_path / "ds", [[1, 7, 3], [900, 2]])  # same size, new contents
    st = ds.bin_path.stat()
    os.utime(ds.bin_path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert max_token_id(ds) == 900
    assert json.loads(scan_path(ds).read_text())["max_token"] == 900


@pytest.mark.parametrize("bad", ["{not json", '{"max_token": -1}', "[]", '{"max_token": true}'])
def test_an_unreadable_record_is_scanned_over(tmp_path: Path, bad: str) -> None:
    ds = _write(tmp_path / "ds", [[3, 12]])
    scan_path(ds).write_text(bad)
    assert max_token_id(ds) == 12
    assert json.loads(scan_path(ds).read_text())["max_token"] == 12


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_read_only_directory_scans_every_time(tmp_path: Path) -> None:
    ds = _write(tmp_path / "ds", [[3, 12]])
    tmp_path.chmod(0o555)
    try:
        assert max_token_id(ds) == 12
        assert not scan_path(ds).exists()
    finally:
        tmp_path.chmod(0o755)


def test_a_record_that_cannot_be_written_leaves_nothing_behind(tmp_path: Path) -> None:
    """A directory in the record's place (as root, a read-only mount cannot be simulated
    here): the id is scanned and returned, and no temporary file is left."""
    ds = _write(tmp_path / "ds", [[3, 12]])
    scan_path(ds).mkdir()
    assert max_token_id(ds) == 12
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ds.bin",
        "ds.idx",
        "ds.scan.json",
        "ds.scan.lock",
    ]


def test_the_engine_refuses_ids_its_model_cannot_embed_and_keeps_the_scan(
    tmp_path: Path,
) -> None:
    from sailor import catalog
    from sailor.megatron_patch.data import build_dataset
    from sailor.schemas.training import IndexedData

    spec = catalog.model("tiny-gpt")
    seq = spec.seq_length
    ok = [list(range(1, seq + 2)) * 2]
    _write(tmp_path / "ok", ok)
    data = IndexedData(prefix=str(tmp_path / "ok"))
    build_dataset(data, spec, seed=0)
    assert json.loads((tmp_path / "ok.scan.json").read_text())["max_token"] == seq + 1
    _write(tmp_path / "big", [[*ok[0], spec.vocab_size]])
    with pytest.raises(ValueError, match=f"vocabulary of {spec.vocab_size + 1}"):
        build_dataset(IndexedData(prefix=str(tmp_path / "big")), spec, seed=0)


def test_the_record_is_readable_by_other_users(tmp_path: Path) -> None:
    ds = _write(tmp_path / "ds", [[3, 12]])
    max_token_id(ds)
    assert scan_path(ds).stat().st_mode & 0o044 == 0o044


def _rank(prefix: str, marks: str) -> None:
    """One rank of a first start: its scan is slow and leaves a mark."""
    import time

    from sailor.data import scan

    real = scan._scan

    def slow(ds: IndexedDataset) -> int:
        with Path(marks).open("a") as f:
            f.write("scan\n")
        time.sleep(0.3)
        return real(ds)

    scan._scan = slow  # type: ignore[assignment]
    if max_token_id(IndexedDataset(prefix)) != 40:
        raise SystemExit(3)


def test_the_ranks_of_a_first_start_scan_once(tmp_path: Path) -> None:
    """Four ranks open the same data set at once: one scans (under the lock beside it), the
    others wait and read its record. Before, every rank read the whole file."""
    import multiprocessing

    _write(tmp_path / "ds", [[1, 7, 3], [40, 2], [5]])
    marks = tmp_path / "marks"
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_rank, args=(str(tmp_path / "ds"), str(marks))) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    assert [p.exitcode for p in procs] == [0] * 4
    assert marks.read_text().count("scan") == 1
