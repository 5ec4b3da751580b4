"""Entry point of the training process the agent launches: one rank with layer-keyed checkpoints."""

from __future__ import annotations

import sys

from sailor.megatron_patch.rank_main import main as _worker_main
from sailor.training_process.ckpt_glue import LayerCheckpointIO

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Run one rank (``sailor.megatron_patch.rank_main`` arguments) with checkpoint support."""
    return _worker_main(argv, ckpt=LayerCheckpointIO())


if __name__ == "__main__":
    sys.exit(main())
