"""A checkpoint's shard paths stay in its step directory: a manifest is data read back from
storage, and one whose shard path leaves the directory (``../../elsewhere/secret.bin``) is
refused instead of having ``ckpt verify`` or a load read the file it names. The load raises
``CorruptCheckpointError`` (an unreadable checkpoint: the controller falls back to the
previous commit; a pydantic ValidationError was classified as a configuration error and held
the job), marked not debris: ``gc`` and retention judge such a step as they judge a newer
release's: they spare it, delete the rest, and report it.
Before, a manifest rewritten that way (its commit marker's checksum updated) verified "ok"
by reading the file outside the checkpoint root."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from sailor.checkpoint import LocalStorage, TrainingGlobals, load, verify
from sailor.checkpoint.checkpointer import Checkpointer
from sailor.checkpoint.cli import ckpt_app
from sailor.checkpoint.errors import CorruptCheckpointError
from sailor.checkpoint.format import MANIFEST, MARKER, shard_name, step_dir
from sailor.controller.failure_text import UNREADABLE_CHECKPOINT
from sailor.megatron_patch.errors import classify
from sailor.schemas.checkpoint import ShardEntry
from tests.unit.test_checkpoint_blocks import one_layer_plan
from tests.unit.test_checkpoint_local import _state


def _shard(path: str) -> ShardEntry:
    return ShardEntry(path=path, size=0, sha256="")


@pytest.mark.parametrize(
    "name",
    [
        shard_name(0, "fe2b9f7c19b2"),  # what every release's saves are named: 12 hex digits
        shard_name(3, "sid"),
        shard_name(123456, "a"),
        "layer-00007-3f2a9c1e0b7d.bin",
    ],
)
def test_the_writers_names_are_shard_paths(name: str) -> None:
    assert _shard(name).path == name


@pytest.mark.parametrize(
    "path",
    [
        "../../elsewhere/secret.bin",
        "/etc/layer-00001-a.bin",
        "sub/layer-00001-a.bin",
        "layer-00001-a/../../x.bin",
        "layer-00001-a\\..\\x.bin",
        "",
        "manifest.json",
    ],
)
def test_a_shard_path_out_of_its_step_directory_is_refused_by_name(path: str) -> None:
    with pytest.raises(ValidationError, match=r"path=.*not a shard file name of its step"):
        _shard(path)


def _escaped(root: Path, outside: Path) -> None:
    """The review's case: a committed step whose manifest names a shard moved outside the
    root, its commit marker's size and checksum updated to match."""
    ck = Checkpointer(LocalStorage(root), one_layer_plan(), 0, keep=None)
    ck.save(_state(layers=1), TrainingGlobals(1, 1, {}))
    ck.wait()
    ck.close()
    sd = root / step_dir(1)
    m = json.loads((sd / MANIFEST).read_text())
    shard = m["shards"][0]
    shutil.move(str(sd / shard["path"]), str(outside / "secret.bin"))
    shard["path"] = "../../elsewhere/secret.bin"
    raw = json.dumps(m).encode()
    (sd / MANIFEST).write_bytes(raw)
    marker = json.loads((sd / MARKER).read_text())
    marker |= {"manifest_size": len(raw), "manifest_sha256": hashlib.sha256(raw).hexdigest()}
    (sd / MARKER).write_text(json.dumps(marker))


def test_verify_and_load_refuse_a_manifest_naming_a_file_outside_the_root(
    tmp_path: Path,
) -> None:
    root, outside = tmp_path / "ckpts", tmp_path / "elsewhere"
    outside.mkdir()
    _escaped(root, outside)
    storage = LocalStorage(root)
    (problem,) = verify(storage, 1)
    refused = f"{step_dir(1)}/{MANIFEST}: refused, names a shard outside its step directory"
    assert f"{refused}: shards.0.path" in problem
    assert "'../../elsewhere/secret.bin'" in problem
    with pytest.raises(CorruptCheckpointError, match=r"path='../../elsewhere/secret.bin'") as exc:
        load(storage, [0])
    assert not exc.value.debris and exc.value.path.endswith(f"{step_dir(1)}/{MANIFEST}")
    # an unreadable checkpoint (the controller falls back to the previous commit), not a
    # configuration error (which held the job)
    assert classify(exc.value, in_training=False) != "config"
    assert type(exc.value).__name__ in UNREADABLE_CHECKPOINT
    res = CliRunner().invoke(ckpt_app, ["verify", str(root)])
    assert res.exit_code == 1 and "step 1: CORRUPT" in res.output, res.output
    res = CliRunner().invoke(ckpt_app, ["ls", str(root)])
    assert res.exit_code == 0 and "bad: " in res.output, res.output
    # an operator's gc spares it and says why, even with no grace
    res = CliRunner().invoke(ckpt_app, ["gc", str(root), "--grace", "0"])
    assert res.exit_code == 1 and (root / step_dir(1) / MANIFEST).exists()
    assert "delete the step yourself" in res.output and "deleted 0 path(s)" in res.output
    # retention after a new save spares it (a newer release's manifest alike)
    ck = Checkpointer(storage, one_layer_plan(), 0, keep=1)
    ck.save(_state(layers=1), TrainingGlobals(2, 2, {}))
    res2 = ck.wait()
    ck.close()
    assert res2 is not None and "CorruptCheckpointError" in res2.retention_error
    assert (root / step_dir(1) / MANIFEST).exists() and (outside / "secret.bin").exists()


def test_a_newer_releases_manifest_is_still_a_validation_error(tmp_path: Path) -> None:
    """Only a shard-path refusal becomes a CorruptCheckpointError: a field this release
    cannot take is a newer release's manifest, and gc judges nothing of it either."""
    root = tmp_path / "ckpts"
    ck = Checkpointer(LocalStorage(root), one_layer_plan(), 0, keep=None)
    ck.save(_state(layers=1), TrainingGlobals(1, 1, {}))
    ck.wait()
    ck.close()
    sd = root / step_dir(1)
    m = json.loads((sd / MANIFEST).read_text())
    m["shards"][0]["size"] = -1
    raw = json.dumps(m).encode()
    (sd / MANIFEST).write_bytes(raw)
    marker = json.loads((sd / MARKER).read_text())
    marker |= {"manifest_size": len(raw), "manifest_sha256": hashlib.sha256(raw).hexdigest()}
    (sd / MARKER).write_text(json.dumps(marker))
    with pytest.raises(ValidationError, match=r"shards\.0\.size"):
        load(LocalStorage(root), [0])
    (root / step_dir(5)).mkdir()  # an abandoned save: debris
    res = CliRunner().invoke(ckpt_app, ["gc", str(root), "--grace", "0"])
    assert res.exit_code == 1 and (sd / MANIFEST).exists(), res.output
    assert "not a manifest this release reads: shards.0.size" in res.output
    assert f"deleted {step_dir(5)}/" in res.output and not (root / step_dir(5)).exists()


def test_the_controllers_prune_spares_a_step_it_cannot_judge(tmp_path: Path) -> None:
    """A save's ``prune_below`` (the controller's retention) deletes every step below it, but
    not a committed one whose manifest is refused for a shard path: reported in the save's
    ``retention_error``, left for the operator; the other steps below still go."""
    root, outside = tmp_path / "ckpts", tmp_path / "elsewhere"
    outside.mkdir()
    _escaped(root, outside)  # step 1
    storage = LocalStorage(root)
    ck = Checkpointer(storage, one_layer_plan(), 0, keep=None)
    for step in (2, 3):
        ck.save(_state(layers=1), TrainingGlobals(step, step, {}))
        ck.wait()
    ck.save(_state(layers=1), TrainingGlobals(4, 4, {}), prune_below=3)
    res = ck.wait()
    ck.close()
    assert res is not None and "spared 1 step(s) below step 3" in res.retention_error
    assert (
        "delete the step yourself" in res.retention_error and "(deleted 1)" in res.retention_error
    )
    assert (root / step_dir(1) / MANIFEST).exists() and not (root / step_dir(2)).exists()
    assert (root / step_dir(3)).exists() and (root / step_dir(4)).exists()


def test_one_unjudged_step_does_not_stop_keep_retention(tmp_path: Path) -> None:
    """Retention with ``keep`` spares a step it cannot judge, does not count it among the
    newest ``keep``, and deletes the rest. Before, ``scan`` raised on it: nothing was ever
    deleted again (the disk filled)."""
    root, outside = tmp_path / "ckpts", tmp_path / "elsewhere"
    outside.mkdir()
    _escaped(root, outside)  # step 1: refused for a shard path
    ck = Checkpointer(LocalStorage(root), one_layer_plan(), 0, keep=2)
    errs = []
    for step in range(2, 8):
        ck.save(_state(layers=1), TrainingGlobals(step, step, {}))
        res = ck.wait()
        assert res is not None
        errs.append(res.retention_error)
    ck.close()
    left = sorted(p.name for p in root.iterdir())
    assert left == [step_dir(s) for s in (1, 6, 7)], left
    assert "spared 1 step(s) at or below step 7" in errs[-1]
    assert "delete the step yourself" in errs[-1] and "(deleted 1)" in errs[-1]


def test_a_failing_retention_does_not_skip_the_controllers_prune(tmp_path: Path) -> None:
    """``keep`` retention, the controller's prune and the deletion of unrecorded commits each
    run whatever the others meet: before, a retention that raised skipped the prune."""
    root, outside = tmp_path / "ckpts", tmp_path / "elsewhere"
    outside.mkdir()
    _escaped(root, outside)  # step 1
    ck = Checkpointer(LocalStorage(root), one_layer_plan(), 0, keep=5)
    for step in (2, 3):
        ck.save(_state(layers=1), TrainingGlobals(step, step, {}))
        ck.wait()
    ck.save(_state(layers=1), TrainingGlobals(4, 4, {}), prune_below=3)
    res = ck.wait()
    ck.close()
    assert res is not None and "spared 1 step(s) below step 3" in res.retention_error
    assert not (root / step_dir(2)).exists() and (root / step_dir(1) / MANIFEST).exists()
    assert (root / step_dir(3)).exists() and (root / step_dir(4)).exists()


def test_an_operators_gc_deletes_beyond_keep_around_an_unjudged_step(tmp_path: Path) -> None:
    """``sailor ckpt gc --keep`` deletes what it can, then exits 1 naming the spared step."""
    root, outside = tmp_path / "ckpts", tmp_path / "elsewhere"
    outside.mkdir()
    _escaped(root, outside)  # step 1
    ck = Checkpointer(LocalStorage(root), one_layer_plan(), 0, keep=None)
    for step in (2, 3, 4):
        ck.save(_state(layers=1), TrainingGlobals(step, step, {}))
        ck.wait()
    ck.close()
    res = CliRunner().invoke(ckpt_app, ["gc", str(root), "--keep", "1", "--grace", "0"])
    assert res.exit_code == 1, res.output
    assert f"deleted {step_dir(2)}/" in res.output and f"deleted {step_dir(3)}/" in res.output
    assert f"{step_dir(1)}/{MANIFEST}: refused" in res.output
    assert sorted(p.name for p in root.iterdir()) == [step_dir(1), step_dir(4)]
