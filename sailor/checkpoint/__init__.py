"""Layer-keyed checkpoints that any layout can load.

Full (TP-gathered) fp32 master weights and both AdamW moments per parameter, keyed by global
layer index and parameter name, one file per layer, committed atomically with a manifest and a
commit marker; saved asynchronously with the writing spread over all replicas; loaded by a
rank of any new layout (pipeline split, TP degree, replica count, microbatching) by reading
only its own layers. See docs/checkpoint.md.

Must never import the training framework (``sailor.megatron_patch``): it speaks plain data.
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sailor.checkpoint.assignment import (
        RankPlace,
        layers_written_by,
        layout_summary,
        place_of,
        writer_assignment,
        writer_ranks,
    )
    from sailor.checkpoint.checkpointer import (
        Checkpointer,
        SaveResult,
        agree_save_start,
        load_for_rank,
    )
    from sailor.checkpoint.errors import (
        CheckpointError,
        CorruptCheckpointError,
        NoCheckpointError,
        NonFiniteCheckpointError,
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

_LAZY: dict[str, str] = {
    "CheckpointError": "sailor.checkpoint.errors",
    "Checkpointer": "sailor.checkpoint.checkpointer",
    "CorruptCheckpointError": "sailor.checkpoint.errors",
    "FsspecStorage": "sailor.checkpoint.storage",
    "Loaded": "sailor.checkpoint.reader",
    "LocalStorage": "sailor.checkpoint.storage",
    "NoCheckpointError": "sailor.checkpoint.errors",
    "NonFiniteCheckpointError": "sailor.checkpoint.errors",
    "ParamState": "sailor.checkpoint.state",
    "RankPlace": "sailor.checkpoint.assignment",
    "ReshardError": "sailor.checkpoint.errors",
    "SaveResult": "sailor.checkpoint.checkpointer",
    "Storage": "sailor.checkpoint.storage",
    "StorageError": "sailor.checkpoint.errors",
    "TrainingGlobals": "sailor.checkpoint.state",
    "agree_save_start": "sailor.checkpoint.checkpointer",
    "collect": "sailor.checkpoint.gc",
    "commit": "sailor.checkpoint.writer",
    "committed_steps": "sailor.checkpoint.reader",
    "latest_step": "sailor.checkpoint.reader",
    "layers_written_by": "sailor.checkpoint.assignment",
    "layout_summary": "sailor.checkpoint.assignment",
    "load": "sailor.checkpoint.reader",
    "load_for_rank": "sailor.checkpoint.checkpointer",
    "open_storage": "sailor.checkpoint.storage",
    "persist_layers": "sailor.checkpoint.writer",
    "place_of": "sailor.checkpoint.assignment",
    "read_manifest": "sailor.checkpoint.reader",
    "save_full": "sailor.checkpoint.writer",
    "split_key": "sailor.checkpoint.state",
    "tp_slice": "sailor.checkpoint.state",
    "verify": "sailor.checkpoint.reader",
    "writer_assignment": "sailor.checkpoint.assignment",
    "writer_ranks": "sailor.checkpoint.assignment",
}
"""Public name -> module. Imported on first use, so that ``sailor ckpt`` and every other
command that only lists or checks files do not pay for importing torch."""


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'sailor.checkpoint' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "CheckpointError",
    "Checkpointer",
    "CorruptCheckpointError",
    "FsspecStorage",
    "Loaded",
    "LocalStorage",
    "NoCheckpointError",
    "NonFiniteCheckpointError",
    "ParamState",
    "RankPlace",
    "ReshardError",
    "SaveResult",
    "Storage",
    "StorageError",
    "TrainingGlobals",
    "agree_save_start",
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
