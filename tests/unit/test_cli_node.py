"""``sailor node readmit`` and ``sailor checkpoint clear-bad``: what they refuse before
connecting to anything (the requests' trips through etcd to the leader are tested in
tests/integration/test_runtime_failures.py and test_checkpoint_clear_bad.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from sailor.cli.checkpoint_cmd import checkpoint_app, clear_bad
from sailor.cli.errors import CliError
from sailor.cli.node_cmd import node_app, readmit


@pytest.mark.parametrize(("nodes", "everything"), [([], False), (["n1"], True)])
def test_readmit_names_nodes_or_all(tmp_path: Path, nodes: list[str], everything: bool) -> None:
    cfg = tmp_path / "controller.yaml"
    cfg.write_text("checkpoint_dir: /ck\n")
    with pytest.raises(CliError, match=r"name the nodes to readmit, or pass --all \(not both\)"):
        readmit(nodes, config=cfg, everything=everything, wait_s=0.0)
    # through the command line too (exit status 2: bad input)
    args = [*nodes, *(["--all"] if everything else [])]
    res = CliRunner().invoke(node_app, ["readmit", *args, "--config", str(cfg)])
    assert res.exit_code == 2


def test_sailor_has_the_node_command() -> None:
    from sailor.cli.main import app

    res = CliRunner().invoke(app, ["node", "readmit", "--help"])
    assert res.exit_code == 0 and "--all" in res.output


@pytest.mark.parametrize(("steps", "everything"), [([], False), ([14], True)])
def test_clear_bad_names_steps_or_all(tmp_path: Path, steps: list[int], everything: bool) -> None:
    """``sailor checkpoint clear-bad``: what it refuses before connecting to anything (the
    request's trip to a leader: tests/integration/test_checkpoint_clear_bad.py)."""
    cfg = tmp_path / "controller.yaml"
    cfg.write_text("checkpoint_dir: /ck\n")
    with pytest.raises(CliError, match=r"name the steps to clear, or pass --all \(not both\)"):
        clear_bad(steps, config=cfg, everything=everything, wait_s=0.0)
    args = [*map(str, steps), *(["--all"] if everything else [])]
    res = CliRunner().invoke(checkpoint_app, ["clear-bad", *args, "--config", str(cfg)])
    assert res.exit_code == 2


def test_sailor_has_the_checkpoint_command() -> None:
    from sailor.cli.main import app

    res = CliRunner().invoke(app, ["checkpoint", "clear-bad", "--help"])
    assert res.exit_code == 0 and "--all" in res.output
