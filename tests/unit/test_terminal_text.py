"""Text from the cluster is printed inert: control and reordering characters as visible
escapes, rich markup escaped (``sailor.cli.terminal_text``)."""

from __future__ import annotations

import io

import pytest
from rich.console import Console
from rich.table import Table

from sailor.cli.terminal_text import inert, shown


@pytest.mark.parametrize(
    ("raw", "want"),
    [
        ("A100-40", "A100-40"),
        ("tab\tand\nnewline stay", "tab\tand\nnewline stay"),
        ("\x1b[2J", "\\x1b[2J"),
        ("over\rwrite", "over\\x0dwrite"),
        ("bell\x07", "bell\\x07"),
        ("del\x7f c1\x9b", "del\\x7f c1\\x9b"),
        ("abc\u202edef", "abc\\u202edef"),  # right-to-left override
        ("\u2066x\u2069", "\\u2066x\\u2069"),
    ],
    ids=["plain", "tab-newline", "csi", "cr", "bel", "del-c1", "rlo", "isolates"],
)
def test_inert_shows_control_characters(raw: str, want: str) -> None:
    assert inert(raw) == want


def test_shown_text_prints_as_written_in_a_table() -> None:
    hostile = "A100\x1b]52;c;eA==\x1b\\[/][link=https://evil.example]x[/link]"
    out = io.StringIO()
    con = Console(file=out, force_terminal=True, width=300, color_system=None)
    t = Table("gpu", box=None)
    t.add_row(shown(hostile))
    con.print(t)
    assert "\x1b" not in out.getvalue()  # no escape of ours either: colours are off
    assert out.getvalue().split("\n")[1].strip() == inert(hostile)
    assert shown(3) == "3"
