"""The training worker the agent launches: ``sailor.megatron_patch`` wired to ``sailor.checkpoint``.

Neither package may import the other (import-linter layers), so the glue that turns a
trainer's stage into layer-keyed checkpoint state and back lives here, one layer above both.
``python -m sailor.worker ARGS`` and ``sailor worker ARGS`` run one rank (see
:mod:`sailor.megatron_patch.worker` for the arguments and the agent protocol).
"""

from sailor.worker.ckpt_glue import LayerCheckpointIO, restore_trainer, trainer_params
from sailor.worker.entry import main

__all__ = ["LayerCheckpointIO", "main", "restore_trainer", "trainer_params"]
