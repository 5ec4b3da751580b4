"""Samples of an indexed dataset: windows, a permutation per epoch, pure in (seed, position)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sailor.data import IndexedDatasetWriter, TokenDataset, open_prepared
from sailor.data.indexed import IndexedDataset
from sailor.data.permutation import permute
from sailor.data.tokens import document_split

SEQ = 8


@pytest.fixture
def dataset(tmp_path: Path) -> IndexedDataset:
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(tmp_path / "ds", np.uint16) as w:
        for _ in range(20):
            n = int(rng.integers(3, 40))
            w.add_document([*rng.integers(1, 500, n).tolist(), 0])  # 0 = EOD
    return IndexedDataset(tmp_path / "ds")


@given(n=st.integers(1, 3000), key=st.integers(0, 2**40))
@settings(max_examples=60, deadline=None)
def test_permute_is_a_bijection(n: int, key: int) -> None:
    img = permute(np.arange(n), n, key)
    assert sorted(img.tolist()) == list(range(n))


def test_permute_pinned_values() -> None:
    """Frozen: changing these reorders every resumed run's data (checkpoints hold positions)."""
    assert permute(np.arange(10), 10, 1).tolist() == [7, 2, 8, 9, 3, 0, 6, 4, 5, 1]
    assert (
        permute([123_456], 1_000_000, 7).tolist()
        == permute(np.arange(1_000_000), 1_000_000, 7)[[123_456]].tolist()
    )


def test_windows_cover_the_stream_once_per_epoch(dataset: IndexedDataset) -> None:
    td = TokenDataset(dataset, SEQ, seed=3)
    n = td.num_windows
    assert n == (dataset.num_tokens - 1) // SEQ
    for epoch in range(2):
        w = td.windows(range(epoch * n, (epoch + 1) * n))
        assert sorted(w.tolist()) == list(range(n))
    assert td.windows(range(n)).tolist() != td.windows(range(n, 2 * n)).tolist()
    stream = dataset.document_tokens(0, dataset.num_documents)
    k = 5
    w = int(td.windows([k])[0])
    assert td.sample(k).tolist() == stream[w * SEQ : w * SEQ + SEQ + 1].tolist()


def test_batch_is_inputs_and_shifted_labels(dataset: IndexedDataset) -> None:
    td = TokenDataset(dataset, SEQ, seed=0)
    x, y = td.batch(range(4, 7))
    toks = td.samples(range(4, 7))
    assert x.shape == (3, SEQ) and y.shape == (3, SEQ) and x.dtype == np.int64
    assert (x == toks[:, :-1]).all() and (y == toks[:, 1:]).all()


def test_samples_do_not_depend_on_order_or_grouping(dataset: IndexedDataset) -> None:
    """Any layout reads any subset of positions in any grouping: same tokens per position."""
    td = TokenDataset(dataset, SEQ, seed=11)
    positions = list(range(0, 3 * td.num_windows + 5))
    whole = td.samples(positions)
    rng = np.random.default_rng(1)
    order = rng.permutation(len(positions))
    shuffled = td.samples([positions[i] for i in order])
    assert (shuffled == whole[order]).all()
    one_by_one = np.stack([td.sample(k) for k in positions[:40]])
    assert (one_by_one == whole[:40]).all()
    fresh = TokenDataset(IndexedDataset(dataset.idx_path), SEQ, seed=11)
    assert (fresh.samples(positions) == whole).all()
    other_seed = TokenDataset(dataset, SEQ, seed=12)
    assert not (other_seed.samples(positions) == whole).all()


_CHILD = """
import hashlib, sys
from sailor.data import IndexedDataset, TokenDataset
td = TokenDataset(IndexedDataset(sys.argv[1]), 8, seed=11, documents=range(2, 17))
print(hashlib.sha256(td.samples(range(0, 500)).tobytes()).hexdigest())
"""


def test_same_samples_in_another_process(dataset: IndexedDataset) -> None:
    td = TokenDataset(dataset, SEQ, seed=11, documents=range(2, 17))
    here = hashlib.sha256(td.samples(range(0, 500)).tobytes()).hexdigest()
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(dataset.idx_path)],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONPATH": str(root), "PYTHONHASHSEED": "123"},
    )
    assert out.stdout.strip() == here


def test_split_documents_stay_apart(dataset: IndexedDataset) -> None:
    splits = document_split(dataset.num_documents, 0.2)
    assert splits == {"train": range(0, 16), "validation": range(16, 20)}
    tr = TokenDataset(dataset, SEQ, documents=splits["train"])
    va = TokenDataset(dataset, SEQ, documents=splits["validation"])
    assert tr.num_tokens + va.num_tokens == dataset.num_tokens
    val_stream = dataset.document_tokens(16, 20).tolist()
    for row in va.samples(range(va.num_windows)).tolist():
        assert any(val_stream[i : i + SEQ + 1] == row for i in range(0, len(val_stream), SEQ))


def test_refusals(dataset: IndexedDataset) -> None:
    with pytest.raises(ValueError, match="one sample of seq_length=100000 needs 100001"):
        TokenDataset(dataset, 100_000)
    with pytest.raises(ValueError, match="must be >= 0"):
        TokenDataset(dataset, SEQ).samples([-1])
    with pytest.raises(ValueError, match="leaves no training documents"):
        document_split(1, 0.5)


def test_open_prepared_checks_the_manifest(tmp_path: Path, dataset: IndexedDataset) -> None:
    pd = open_prepared(dataset.idx_path, validation_fraction=0.1)
    assert pd.manifest is None and pd.splits["validation"] == range(18, 20)
    manifest = {
        "prefix": "ds",
        "dtype": "uint16",
        "tokenizer": {
            "kind": "file",
            "path": "t.json",
            "sha256": "0" * 64,
            "vocab_size": 500,
            "eod_token": "<|endoftext|>",
            "eod_id": 0,
        },
        "num_documents": 20,
        "num_tokens": dataset.num_tokens + 1,  # wrong on purpose
        "shuffle_seed": 0,
        "splits": {
            "train": {"first": 0, "end": 15, "tokens": dataset.document_tokens(0, 15).size},
            "validation": {
                "first": 15,
                "end": 20,
                "tokens": dataset.document_tokens(15, 20).size + 1,
            },
        },
        "source": {"kind": "text", "inputs": ["x.txt"], "bytes": 1},
    }
    (tmp_path / "ds.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=r"ds\.bin: at byte 0: \d+ tokens, the manifest"):
        open_prepared(tmp_path / "ds")
    manifest["num_tokens"] = dataset.num_tokens
    manifest["splits"]["validation"]["tokens"] -= 1  # type: ignore[index]
    (tmp_path / "ds.json").write_text(json.dumps(manifest))
    pd = open_prepared(tmp_path / "ds")
    assert pd.vocab_size == 500 and pd.splits["train"] == range(0, 15)
    assert pd.tokens("validation", SEQ, 0).documents == range(15, 20)
