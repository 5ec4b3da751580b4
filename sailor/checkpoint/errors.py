"""Checkpoint errors, each carrying its recovery policy.

``retryable`` tells the runtime whether trying again (after ``delay_s``) can help: a storage
hiccup can; a corrupt shard or a missing layer cannot, and the runtime should fall back to an
older committed checkpoint instead.
"""

from __future__ import annotations

from typing import ClassVar

__all__ = [
    "AbandonedWriteError",
    "CheckpointError",
    "CorruptCheckpointError",
    "DataMismatchError",
    "ModelMismatchError",
    "NoCheckpointError",
    "NonFiniteCheckpointError",
    "ReshardError",
    "SaveCancelledError",
    "SaveSkippedError",
    "StorageError",
]


class CheckpointError(Exception):
    """Base class: a message, whether to retry, and after how long."""

    job_wide: ClassVar[bool] = False
    """The same on whichever node it runs (the saved weights, not a node's storage): a
    worker that meets it on one rank makes every rank raise it alike (``megatron_patch
    .boundary``), and the controller holds it against the job (``AGREED_ERRORS``)."""

    def __init__(self, message: str, *, retryable: bool = False, delay_s: float = 0.0) -> None:
        super().__init__(message)
        self.retryable = retryable
        self.delay_s = delay_s


class StorageError(CheckpointError):
    """The backend failed to read or write; usually worth a retry."""


class NoCheckpointError(CheckpointError):
    """No committed checkpoint (or not the requested step) exists."""


class CorruptCheckpointError(CheckpointError):
    """A file is missing, truncated or fails its checksum, or a manifest names a shard outside
    its step directory. ``path`` names the file.

    ``debris``: whether retention and ``sailor ckpt gc`` may take the step for an unfinished
    save and delete it. False for a manifest refused for a shard path (``ShardEntry.path``):
    written by hand, tampered with, or by a release that names its shards otherwise, it is
    no save of this release's that crashed; the controller falls back to the previous commit
    as for any unreadable checkpoint, and the step is left for an operator to inspect."""

    def __init__(self, message: str, *, path: str, debris: bool = True) -> None:
        super().__init__(message, retryable=False)
        self.path = path
        self.debris = debris


class NonFiniteCheckpointError(CheckpointError):
    """A tensor to be saved holds an inf or NaN: the step is not committed (the committed
    ones are kept). Not retryable: the same weights fail again; resume from an earlier
    checkpoint. ``key`` names the tensor (``layer.param.kind``; '' where the committer
    raises a writer's refusal: its message names it)."""

    job_wide: ClassVar[bool] = True

    def __init__(self, message: str, *, key: str = "") -> None:
        super().__init__(message, retryable=False)
        self.key = key


class SaveCancelledError(CheckpointError):
    """A save whose world was abandoned was fenced before its commit
    (``Checkpointer.cancel``): nothing of it is committed, and nobody waits for it."""


class SaveSkippedError(CheckpointError):
    """A save refused before it began because this rank's write of an abandoned save still
    runs (``training_process.ckpt_glue.CheckpointSaves``): its host copies are not back,
    and a new snapshot would hold a second snapshot's worth of host memory. Retryable: the
    next save goes ahead once that write has ended."""

    def __init__(self, message: str) -> None:
        super().__init__(message, retryable=True)


class ReshardError(CheckpointError):
    """The checkpoint cannot be sliced for the requested layout (e.g. TP does not divide)."""


class ModelMismatchError(CheckpointError, ValueError):
    """A committed checkpoint whose tensors are not the model's being loaded (another
    number of layers, a parameter only one side has, another full shape): the checkpoint
    is readable, the configuration does not fit it. Not retryable, on any node or with an
    older checkpoint of the same run; a ``ValueError``, so a worker reports it before
    training as a configuration error (``megatron_patch.errors.classify``) and the job is
    held with this message. Never a ``CorruptCheckpointError``: the step is not marked
    bad."""

    def __init__(self, message: str) -> None:
        super().__init__(message, retryable=False)


class DataMismatchError(ModelMismatchError):
    """A committed checkpoint trained on other data than the run resuming from it (its
    recorded ``DataIdentity`` differs: another corpus, sequence length, tokenizer, split or
    seed), without the training config's ``allow_data_change``. Its sample counter would go
    on over other samples, silently. The same route as :class:`ModelMismatchError`: a
    configuration error (``ValueError``), the job held with this message, no node blamed,
    no step marked bad."""


class AbandonedWriteError(CheckpointError):
    """A required save refused because this rank's write of an abandoned save under the
    same checkpoint root still runs (``training_process.ckpt_glue.CheckpointSaves``): that
    write has not ended in the save's interval and more (a hung or failing mount), so the
    root's storage is not known good, and a new write there would most likely hang the same
    way, with a second snapshot's worth of host memory held. Not retryable on this node:
    the job goes back to its last commit, and the node's mount needs a look."""

    def __init__(self, message: str) -> None:
        super().__init__(message, retryable=False)
