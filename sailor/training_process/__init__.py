"""The training process the agent launches: ``sailor.megatron_patch`` with layer-keyed checkpoints.

``sailor.megatron_patch`` keeps checkpoints behind its ``CheckpointIO`` interface and never
imports ``sailor.checkpoint``, which never imports the engine (import-linter contracts), so the
glue that turns a trainer's stage into layer-keyed checkpoint state and back lives here, one
layer above both.
``python -m sailor.training_process ARGS`` and ``sailor worker ARGS`` run one rank (see
:mod:`sailor.megatron_patch.rank_main` for the arguments and the agent protocol). The agent's
configs call this process its *worker* (``worker_argv``); ``python -m sailor.worker`` is kept as
an alias of it for configs written before the rename.
"""

from sailor.training_process.ckpt_glue import LayerCheckpointIO, restore_trainer, trainer_params
from sailor.training_process.entry import main

__all__ = ["LayerCheckpointIO", "main", "restore_trainer", "trainer_params"]
