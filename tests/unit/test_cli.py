"""The CLI around schemas, catalog and importers."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from sailor.cli.main import app
from sailor.cli.schema_cmd import SCHEMAS

runner = CliRunner()


def test_schema_prints_json_schema_for_every_name() -> None:
    for name in SCHEMAS:
        res = runner.invoke(app, ["schema", name])
        assert res.exit_code == 0, res.output
        assert isinstance(json.loads(res.output), dict)
    res = runner.invoke(app, ["schema", "nope"])
    assert res.exit_code == 2 and "name='nope'" in res.output


def test_import_plan_and_profiles(reference: Path, tmp_path: Path) -> None:
    plan_file = next((reference / "validation").rglob("plan_config_N2_D1.json"))
    out = tmp_path / "plan.json"
    res = runner.invoke(
        app, ["import", "sailor-plan", str(plan_file), "--model", "OPT-350", "-o", str(out)]
    )
    assert res.exit_code == 0, res.output
    assert json.loads(out.read_text())["global_batch_size"] == 32
    res = runner.invoke(
        app,
        [
            "import",
            "sailor-profiles",
            str(reference / "profiles"),
            "--model",
            "OPT-350",
            "-o",
            str(tmp_path / "prof"),
        ],
    )
    assert res.exit_code == 0, res.output
    assert (tmp_path / "prof" / "OPT-350.json").exists()


def test_catalog_commands() -> None:
    for sub in ("gpus", "models", "prices"):
        res = runner.invoke(app, ["catalog", sub])
        assert res.exit_code == 0, res.output
