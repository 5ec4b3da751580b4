"""The data identity a checkpoint records, and the comparison a resume makes with it.

``check_data_fit`` refuses a checkpoint whose recorded data differs from the run's, naming
each field with both values (``DataMismatchError``: a configuration error, as a model
mismatch), accepts it under ``allow_data_change`` returning what changed, and accepts a
checkpoint from before identities were recorded with one warning per process.
``content_digest`` holds no path and moves with the files' bytes. The manifest's ``data``
came with wire version 9: a release-8 reader drops it and refuses it at its own version.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError, create_model

from sailor.checkpoint import data_fit, open_storage, read_manifest
from sailor.checkpoint.data_fit import check_data_fit
from sailor.checkpoint.errors import CorruptCheckpointError, DataMismatchError, ModelMismatchError
from sailor.data.identity import BLOCK_BYTES, SAMPLED_BLOCKS, content_digest
from sailor.megatron_patch.data import SyntheticTokens, identity_of
from sailor.megatron_patch.engine import TrainConfig, Trainer
from sailor.megatron_patch.errors import classify
from sailor.megatron_patch.groups import build_process_groups
from sailor.megatron_patch.model import tiny_model
from sailor.megatron_patch.roles import role_of
from sailor.schemas import _base
from sailor.schemas._base import SCHEMA_VERSION
from sailor.schemas.checkpoint import CheckpointManifest
from sailor.schemas.data_identity import DataIdentity, data_differences
from sailor.training_process.ckpt_glue import LayerCheckpointIO, restore_trainer
from tests.integration.test_in_place_worker import GBS, ONE

DIGEST_A, DIGEST_B = "a" * 64, "b" * 64
INDEXED = DataIdentity(
    kind="indexed",
    seq_length=16,
    seed=1,
    vocab_size=320,
    tokenizer_sha256="c" * 64,
    shuffle_seed=0,
    documents=90,
    tokens=9000,
    train_documents=(0, 81),
    content_sha256=DIGEST_A,
)


def _manifest(data: DataIdentity | None) -> CheckpointManifest:
    return CheckpointManifest(
        step=2,
        consumed_samples=8,
        model="tiny-text",
        num_layers=4,
        shards=(),
        created=1.0,
        data=data,
    )


CHANGES = [
    ({"seq_length": 32}, "data.seq_length: trained with seq_length=16, this run has seq_length=32"),
    ({"seed": 7}, "data.seed: trained with seed=1, this run has seed=7"),
    (
        {"vocab_size": 512},
        "data.vocab_size: trained with vocab_size=320, this run has vocab_size=512",
    ),
    ({"train_documents": (0, 72)}, "data.train_documents: trained with train_documents=[0, 81)"),
    (
        {"content_sha256": DIGEST_B},
        "trained with content_sha256=aaaaaaaaaaaa..., this run has content_sha256=bbbbbbbbbbbb...",
    ),
    (
        {"shuffle_seed": None},
        "data.shuffle_seed: trained with shuffle_seed=0, this run has shuffle_seed=None",
    ),
]


@pytest.mark.parametrize(("update", "named"), CHANGES, ids=[next(iter(u)) for u, _ in CHANGES])
def test_other_data_is_refused_by_field_with_both_values(
    update: dict[str, object], named: str
) -> None:
    run = INDEXED.model_copy(update=update)
    with pytest.raises(DataMismatchError, match=re.escape(named)) as info:
        check_data_fit(_manifest(INDEXED), run, allow_change=False, where="/ck step 2")
    msg = str(info.value)
    assert "checkpoint /ck step 2 (model 'tiny-text')" in msg and "consumed_samples=8" in msg
    assert "allow_data_change: true" in msg
    # the model mismatch's route: a configuration error, the job held, no step marked bad
    assert isinstance(info.value, ModelMismatchError) and isinstance(info.value, ValueError)
    assert classify(info.value, in_training=False) == "config"
    assert not isinstance(info.value, CorruptCheckpointError) and not info.value.retryable


def test_every_difference_is_named_at_once_and_the_override_returns_them() -> None:
    run = INDEXED.model_copy(update={"seq_length": 32, "content_sha256": DIGEST_B})
    with pytest.raises(DataMismatchError, match=r"seq_length=16.*content_sha256=a"):
        check_data_fit(_manifest(INDEXED), run, allow_change=False, where="w")
    got = check_data_fit(_manifest(INDEXED), run, allow_change=True, where="w")
    assert got == [
        ("seq_length", "16", "32"),
        ("content_sha256", "aaaaaaaaaaaa...", "bbbbbbbbbbbb..."),
    ]
    assert check_data_fit(_manifest(INDEXED), INDEXED, allow_change=False, where="w") == []


def test_synthetic_data_is_its_generators_parameters() -> None:
    a = identity_of(SyntheticTokens(vocab_size=128, seq_length=16, seed=0))
    assert a == DataIdentity(kind="synthetic", seq_length=16, seed=0, vocab_size=128)
    b = identity_of(SyntheticTokens(vocab_size=256, seq_length=16, seed=0))
    assert a is not None and b is not None
    assert data_differences(a, b) == [("vocab_size", "128", "256")]
    assert [f for f, _, _ in data_differences(a, INDEXED)][:3] == ["kind", "seed", "vocab_size"]


def test_a_checkpoint_without_an_identity_resumes_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(data_fit, "_warned_unrecorded", False)
    old = _manifest(None)
    assert check_data_fit(old, INDEXED, allow_change=False, where="/ck step 2") == []
    assert check_data_fit(old, INDEXED, allow_change=False, where="/ck step 2") == []
    err = capsys.readouterr().err
    assert err.count("no data identity recorded") == 1 and "/ck step 2" in err
    # a run whose data says nothing (a test's token source) is not compared
    assert check_data_fit(_manifest(INDEXED), None, allow_change=False, where="w") == []


def test_the_content_digest_holds_no_path_and_moves_with_the_bytes(tmp_path: Path) -> None:
    big = BLOCK_BYTES * SAMPLED_BLOCKS * 3  # sampled, not read whole
    idx, bin_ = tmp_path / "d.idx", tmp_path / "d.bin"
    idx.write_bytes(bytes(range(256)) * 4)
    bin_.write_bytes(bytes(i % 251 for i in range(big)))
    first = content_digest(idx, bin_)
    (tmp_path / "copy").mkdir()
    for p in (idx, bin_):
        shutil.copy(p, tmp_path / "copy" / p.name)
    assert content_digest(tmp_path / "copy" / "d.idx", tmp_path / "copy" / "d.bin") == first
    raw = bytearray(bin_.read_bytes())
    raw[0] ^= 1  # the first block is always sampled
    bin_.write_bytes(bytes(raw))
    assert content_digest(idx, bin_) != first
    raw[0] ^= 1
    bin_.write_bytes(bytes(raw) + b"\0\0")  # another size
    assert content_digest(idx, bin_) != first
    idx.write_bytes(bytes(range(256)) * 3 + bytes(range(1, 256)) + b"\0")  # the index too
    bin_.write_bytes(bytes(raw))
    assert content_digest(idx, bin_) != first


def test_the_manifests_data_is_wire_version_9(monkeypatch: pytest.MonkeyPatch) -> None:
    assert SCHEMA_VERSION >= 9
    m = _manifest(INDEXED)
    raw = m.model_dump_json()
    assert CheckpointManifest.model_validate_json(raw) == m
    older = json.loads(raw)
    del older["data"]
    assert CheckpointManifest.model_validate(older | {"schema_version": 8}).data is None
    kept = {
        name: (f.annotation, f)
        for name, f in CheckpointManifest.model_fields.items()
        if name not in ("data", "schema_version")
    }
    previous = create_model("CheckpointManifest", __base__=_base.WireMessage, **kept)  # type: ignore[call-overload]
    monkeypatch.setattr(_base, "SCHEMA_VERSION", 8)
    old = previous.model_validate_json(raw)
    assert "data" not in type(old).model_fields and old.step == 2  # type: ignore[attr-defined]
    with pytest.raises(ValidationError, match="data"):
        previous.model_validate_json(json.dumps(json.loads(raw) | {"schema_version": 8}))
    monkeypatch.undo()
    with pytest.raises(ValidationError, match=r"train_documents=\(5, 2\)"):
        DataIdentity.model_validate(INDEXED.model_dump() | {"train_documents": (5, 2)})


def _engine_trainer(seed: int, data_seed: int | None = None, allow: bool = False) -> Trainer:
    spec = tiny_model("tiny-gpt", GBS)
    role = role_of(ONE, 0)
    groups = build_process_groups(ONE, role, spec.tie_embeddings, 30.0)
    data = (
        None if data_seed is None else SyntheticTokens(spec.vocab_size, spec.seq_length, data_seed)
    )
    cfg = TrainConfig(seed=seed, allow_data_change=allow)
    return Trainer(ONE, spec, role, groups, cfg, torch.device("cpu"), data=data)


def test_the_engines_restore_refuses_other_data_before_reading_a_shard(
    gloo_world: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The engine's save records its data (here synthetic, seed 0); a restore whose data is
    drawn with seed 5 is refused with every shard truncated: nothing was read (a read would
    have raised CorruptCheckpointError), the live parameters untouched. The override
    restores it (shards whole again) and rank 0 says what changed."""
    root = str(tmp_path / "ckpt")
    io = LayerCheckpointIO()
    tr = _engine_trainer(0)
    list(tr.run(1))
    io.save(tr, root)
    io.close()
    m = read_manifest(open_storage(root), 1)
    assert m.data == DataIdentity(kind="synthetic", seq_length=16, seed=0, vocab_size=64)
    shards = sorted((tmp_path / "ckpt" / "step-000000001").glob("layer-*.bin"))
    whole = {p: p.read_bytes() for p in shards}
    for p in shards:
        p.write_bytes(b"")
    other = _engine_trainer(0, data_seed=5)
    before = {k: p.detach().clone() for k, p in other.stage.keyed_parameters()}
    with pytest.raises(
        DataMismatchError, match=r"data\.seed: trained with seed=0, this run has seed=5"
    ):
        restore_trainer(other, root, 1)
    assert all(torch.equal(before[k], p) for k, p in other.stage.keyed_parameters())
    for p, raw in whole.items():
        p.write_bytes(raw)
    allowed = _engine_trainer(0, data_seed=5, allow=True)
    restore_trainer(allowed, root, 1)
    assert all(
        torch.equal(a, b)
        for (_, a), (_, b) in zip(
            tr.stage.keyed_parameters(), allowed.stage.keyed_parameters(), strict=True
        )
    )
    said = capsys.readouterr().err
    assert "resumed on other data than it was trained on (allow_data_change)" in said
    assert "data.seed: trained with seed=0, this run has seed=5" in said
