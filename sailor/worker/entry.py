"""Entry point of the real worker: the training worker with layer-keyed checkpoints."""

from __future__ import annotations

import sys

from sailor.megatron_patch.worker import main as _worker_main
from sailor.worker.ckpt_glue import LayerCheckpointIO

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Run one rank (``sailor.megatron_patch.worker`` arguments) with checkpoint support."""
    return _worker_main(argv, ckpt=LayerCheckpointIO())


if __name__ == "__main__":
    sys.exit(main())
