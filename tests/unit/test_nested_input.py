"""Input nested past the parsers' depth limit ("[[[...": json and PyYAML raise RecursionError,
not their decode errors) is refused with the file's name, as other unreadable input is.
The daemons' readers of such input (the agent's stdout reader, notice file, take marks, the
leader's failure texts) have tests of their own; these are the files a user hands in."""

from __future__ import annotations

from pathlib import Path

import pytest

from sailor.cli._io import load_raw
from sailor.cli.errors import CliError
from sailor.controller.config import load_mapping
from sailor.importers._read import ImportFormatError, load_json
from sailor.schemas.training import parse_training_config

DEEP = "[" * 5000


@pytest.mark.parametrize("suffix", [".json", ".yaml", ".toml"])
def test_a_controller_config(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"c{suffix}"
    path.write_text(("a = " if suffix == ".toml" else "") + DEEP)
    with pytest.raises(ValueError, match="nested too deep"):
        load_mapping(path)


@pytest.mark.parametrize("source", ["run.json", "run.yaml"])
def test_a_training_config(source: str) -> None:
    with pytest.raises(ValueError, match=rf"{source}: nested too deep"):
        parse_training_config(DEEP, source)


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_a_file_given_to_the_cli(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"plan{suffix}"
    path.write_text(DEEP)
    with pytest.raises(CliError, match=rf"plan{suffix}: nested too deep"):
        load_raw(path)


def test_an_imported_profile(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    path.write_text(DEEP)
    with pytest.raises(ImportFormatError, match="nested too deep"):
        load_json(path)
