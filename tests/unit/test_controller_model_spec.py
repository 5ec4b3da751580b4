"""``load_model_spec``: a catalog name, a bare ModelSpec file, or the workers' model file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sailor import catalog
from sailor.controller.planning import load_model_spec


def test_catalog_name_and_batch_size() -> None:
    spec = load_model_spec("tiny-gpt", 8)
    assert spec.name == catalog.model("tiny-gpt").name and spec.global_batch_size == 8


def test_bare_spec_file(tmp_path: Path) -> None:
    spec = catalog.model("tiny-gpt")
    f = tmp_path / "spec.json"
    f.write_text(spec.model_dump_json())
    assert load_model_spec(str(f)) == spec


def test_worker_model_file_with_architecture(tmp_path: Path) -> None:
    """The demo's model.json ({spec, architecture}) plans as its spec."""
    spec = catalog.model("tiny-gpt")
    f = tmp_path / "model.json"
    f.write_text(json.dumps({"spec": spec.model_dump(mode="json"), "architecture": {"x": 1}}))
    assert load_model_spec(str(f), 4) == spec.model_copy(update={"global_batch_size": 4})


def test_other_mapping_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "bad.json"
    f.write_text(json.dumps({"spec": {}, "architecture": {}, "extra": 1}))
    with pytest.raises(ValueError):
        load_model_spec(str(f))
