"""``sailor demo``: kept as the CLI's mount point; the demo lives in :mod:`sailor.cli.demo`."""

from __future__ import annotations

from sailor.cli.demo import demo

__all__ = ["demo"]
