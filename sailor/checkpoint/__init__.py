"""Layer-keyed checkpoints that any layout can load.

Full (TP-gathered) fp32 master weights and both AdamW moments per parameter, keyed by global
layer index and parameter name, one file per layer, committed atomically with a manifest and a
commit marker; saved asynchronously with the writing spread over all replicas; loaded by a
rank of any new layout (pipeline split, TP degree, replica count, microbatching) by reading
only its own layers. See docs/checkpoint.md.

Must never import the training framework (``sailor.megatron_patch``): it speaks plain data.
"""

from sailor.checkpoint.assignment import (
    RankPlace,
    layers_written_by,
    layout_summary,
    place_of,
    writer_assignment,
    writer_ranks,
)
from sailor.checkpoint.checkpointer import Checkpointer, SaveResult, load_for_rank
from sailor.checkpoint.errors import (
    CheckpointError,
    CorruptCheckpointError,
    NoCheckpointError,
    ReshardError,
    StorageError,
)
from sailor.checkpoint.gc import collect
from sailor.checkpoint.reader import (
    Loaded,
    committed_steps,
    latest_step,
    load,
    read_manifest,
    verify,
)
from sailor.checkpoint.state import ParamState, TrainingGlobals, split_key, tp_slice
from sailor.checkpoint.storage import FsspecStorage, LocalStorage, Storage, open_storage
from sailor.checkpoint.writer import commit, persist_layers, save_full

__all__ = [
    "CheckpointError",
    "Checkpointer",
    "CorruptCheckpointError",
    "FsspecStorage",
    "Loaded",
    "LocalStorage",
    "NoCheckpointError",
    "ParamState",
    "RankPlace",
    "ReshardError",
    "SaveResult",
    "Storage",
    "StorageError",
    "TrainingGlobals",
    "collect",
    "commit",
    "committed_steps",
    "latest_step",
    "layers_written_by",
    "layout_summary",
    "load",
    "load_for_rank",
    "open_storage",
    "persist_layers",
    "place_of",
    "read_manifest",
    "save_full",
    "split_key",
    "tp_slice",
    "verify",
    "writer_assignment",
    "writer_ranks",
]
