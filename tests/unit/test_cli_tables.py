"""Tables at 80 columns, piped: every name a user must type and every header appears whole."""

from __future__ import annotations

import io
import re

from rich.console import Console
from rich.table import Table
from typer.testing import CliRunner

from sailor import catalog
from sailor.cli.main import app
from sailor.cli.tables import print_table


def _whole(word: str, text: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(word)}(?![\w-])", text) is not None


def test_catalog_names_are_whole_at_80_columns_piped() -> None:
    runner = CliRunner()
    env = {"COLUMNS": "80", "TERM": "dumb"}
    for sub, names in (
        ("models", list(catalog.models())),
        ("gpus", list(catalog.gpus())),
        ("prices", list(catalog.gpus())),
    ):
        res = runner.invoke(app, ["catalog", sub], env=env)
        assert res.exit_code == 0, res.output
        assert "…" not in res.output, res.output
        for name in names:
            if sub != "prices" or any(g == name for g, *_ in catalog.prices().gpus):
                assert _whole(name, res.output), (name, res.output)


def _render(table: Table, width: int = 80) -> str:
    con = Console(file=io.StringIO(), width=width, force_terminal=False)
    print_table(con, table)
    out = con.file.getvalue()  # type: ignore[attr-defined]
    assert isinstance(out, str)
    return out


def test_wide_table_keeps_every_header_and_name_whole() -> None:
    """The demo's reconfiguration table ("recovery s", "preemption notice") and a table whose
    words alone are wider than 80 columns: nothing is cut, nothing ends in "…"."""
    headers = ("change", "node", "resumed", "generation", "from step", "recovery s")
    headers += ("no-step s", "redone steps")
    t = Table(*headers, title="reconfigurations")
    t.add_row("preemption notice", "n3", "yes", "3", "120", "4.25", "3.1", "2")
    out = _render(t)
    assert "…" not in out
    for word in " ".join((*headers, "preemption notice n3")).split():
        assert _whole(word, out), (word, out)
    assert max(len(line) for line in out.splitlines()) <= 80  # fits: wrapped between words

    names = [f"GPT-Neo-2.7-replica-{i:02d}" for i in range(6)]
    wide = Table(*names)
    wide.add_row(*names)
    out = _render(wide)
    assert "…" not in out
    for name in names:
        assert out.count(name) == 2, out  # header and cell, each whole on one line
