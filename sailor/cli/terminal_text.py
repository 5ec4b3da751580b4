"""Text from the cluster made inert before the CLI prints it on an operator's terminal.

What ``sailor status`` and ``sailor audit`` print comes in part from the nodes: an agent
writes its node's record (GPU type, NCCL version) and status (a worker's failure cause, cut
from its stderr), and publishes on event subjects whose last token it chooses (the audit log
keeps the subject of every event, rejected ones too). A compromised or broken node controls
those strings. Printed as they are, an escape sequence reaches the terminal (clear the
screen, rewrite a line with a carriage return, set the clipboard: OSC 52, a disguised
hyperlink: OSC 8), and rich reads ``[...]`` as markup: ``[link=...]`` becomes a hyperlink,
and a stray ``[/]`` ended ``sailor status`` with a ``MarkupError``.

:func:`inert` shows every control character (C0 but tab and newline, DEL, C1) and every
bidirectional-override character as a visible escape (``\\x1b``, ``\\u202e``);
:func:`shown` also escapes rich markup. ``--json`` output needs neither (JSON escapes
control characters). Pure; never prints.
"""

from __future__ import annotations

import re

from rich.markup import escape

__all__ = ["inert", "shown"]

_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
"""Control characters but ``\\t`` and ``\\n``; the Unicode marks and overrides that reorder
what a terminal shows (the "Trojan Source" characters)."""


def _visible(m: re.Match[str]) -> str:
    code = ord(m.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def inert(text: str) -> str:
    """``text`` with each control or reordering character as a visible escape."""
    return _UNSAFE.sub(_visible, text)


def shown(text: object) -> str:
    """``str(text)``, inert and with rich markup escaped: for ``Console.print`` and table
    cells, which read markup."""
    return escape(inert(str(text)))
