"""The control file the agent writes and every rank reads at each boundary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sailor.megatron_patch.control import ControlRequest, read_control


def test_a_save_request_carries_its_prune_point(tmp_path: Path) -> None:
    f = tmp_path / "control.json"
    f.write_text(json.dumps({"save_step": 12, "save_dir": "/ck", "prune_below": 9}))
    assert read_control(f) == ControlRequest(save_step=12, save_dir="/ck", prune_below=9)


@pytest.mark.parametrize("bad", [-3, "9", True, None, [9]])
def test_a_missing_or_malformed_prune_point_prunes_nothing(tmp_path: Path, bad: object) -> None:
    f = tmp_path / "control.json"
    f.write_text(json.dumps({"save_step": 12, "save_dir": "/ck", "prune_below": bad}))
    assert read_control(f).prune_below == -1
    f.write_text(json.dumps({"save_step": 12, "save_dir": "/ck"}))  # an older agent's file
    assert read_control(f).prune_below == -1
