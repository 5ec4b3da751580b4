"""``sailor demo``: the one-machine cluster demo (and the planning showcase)."""

from sailor.cli.demo.command import demo

__all__ = ["demo"]
