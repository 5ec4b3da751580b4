"""``sailor node readmit``: what it refuses before connecting to anything (the request's
trip through etcd to the leader is tested in tests/integration/test_runtime_failures.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

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
