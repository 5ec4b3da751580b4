"""Printing the CLI's tables so that no name or header is ever cut.

rich shrinks a table that is wider than the terminal (80 columns when piped) and cuts the words
that no longer fit with "…": a GPU or model name the user must type ("GPT-Neo…"), a header
("recove… s"). :func:`print_table` sets the columns' widths itself: every column at least as wide
as its longest word (header and cells), so a narrow column wraps between words, never inside
one; the room left goes to the columns whose text is longer. A table whose words alone are wider
than the terminal first loses its vertical rules and, if still too wide, is printed at the width
it needs (the terminal wraps its lines) rather than cut.
"""

from __future__ import annotations

from rich import box
from rich.cells import cell_len
from rich.console import Console, RenderableType
from rich.table import Table
from rich.text import Text

__all__ = ["column_widths", "print_table"]


def _plain(console: Console, cell: RenderableType) -> str:
    if isinstance(cell, Text):
        return cell.plain
    if isinstance(cell, str):
        return console.render_str(cell).plain
    return ""  # another renderable: rich measures it


def _overhead(table: Table) -> int:
    """Columns of rules and padding around the cells."""
    n = len(table.columns)
    left, right = table.padding[3], table.padding[1]
    rules = 0 if table.box is None else (n + 1 if table.show_edge else n - 1)
    return rules + n * (left + right)


def column_widths(console: Console, table: Table, width: int) -> list[int]:
    """Cell widths for ``table`` in ``width`` columns: each at least its longest word."""
    low, high = [], []
    for col in table.columns:
        texts = [_plain(console, col.header), *(_plain(console, c) for c in col.cells)]
        words = max((cell_len(w) for t in texts for w in t.split()), default=1)
        lines = max((cell_len(line) for t in texts for line in t.splitlines()), default=1)
        low.append(max(words, col.min_width or 0, 1))
        high.append(max(lines, low[-1]))
    room = width - _overhead(table) - sum(low)
    want = [h - lo for lo, h in zip(low, high, strict=True)]
    if room <= 0 or not sum(want):
        return low
    if room >= sum(want):
        return high
    # share the room in proportion to what each column still wants; hand out the remainder
    extra = [room * w // sum(want) for w in want]
    for i in sorted(range(len(want)), key=lambda i: want[i] - extra[i], reverse=True):
        if sum(extra) >= room:
            break
        if extra[i] < want[i]:
            extra[i] += 1
    return [lo + e for lo, e in zip(low, extra, strict=True)]


def print_table(console: Console, table: Table) -> None:
    """Print ``table`` with every name and header whole (see the module docstring)."""
    width = console.width
    widths = column_widths(console, table, width)
    if sum(widths) + _overhead(table) > width:
        table.box = box.SIMPLE_HEAD  # no vertical rules: a column less per rule
        table.show_edge = False
        widths = column_widths(console, table, width)
    for col, w in zip(table.columns, widths, strict=True):
        col.width = w
        col.overflow = "fold"  # a cell's word longer than its column: folded, never "…"
    need = sum(widths) + _overhead(table)
    if need <= width:
        console.print(table)
        return
    console.width = need  # rich never prints wider than its console: widen it for this table
    try:
        console.print(table, crop=False)
    finally:
        console.width = width
