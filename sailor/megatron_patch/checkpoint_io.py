"""What the worker needs of a checkpoint implementation.

``sailor.megatron_patch`` may not import ``sailor.checkpoint`` (import-linter): the worker
(:mod:`rank_main`) takes any object with these methods; ``sailor worker`` passes the
layer-keyed one of ``sailor.training_process.ckpt_glue``. :class:`SaveIO` is the part the
iteration boundary (:mod:`boundary`) uses, over any trainer type: the DeepSpeed adapter's run
(``deepspeed_adapter.DeepSpeedRun``) is saved through it too.
"""

from __future__ import annotations

from typing import Protocol, TypeVar

from sailor.megatron_patch.engine import Trainer

__all__ = ["CheckpointIO", "SaveIO"]

_T_contra = TypeVar("_T_contra", contravariant=True)


class SaveIO(Protocol[_T_contra]):
    """What the iteration boundary needs to save a trainer of type ``_T_contra``."""

    def save(
        self,
        trainer: _T_contra,
        root: str,
        keep: int | None = None,
        prune_below: int = -1,
        optional: bool = False,
        drop_steps: tuple[int, ...] | None = None,
    ) -> float:
        """Snapshot now (collective), persist in the background (``CheckpointIO.save``)."""
        ...

    def done(self) -> bool:
        """Whether this rank's part of the save in flight is durable, without blocking."""
        ...

    def wait(self) -> None:
        """Block until this rank's part of the save in flight is durable; raise its error."""
        ...

    def close(self) -> None:
        """Finish the save in flight and release threads."""
        ...

    def abandon(self) -> None:
        """Drop the save in flight without waiting for it (it failed on some rank, agreed,
        and was optional): fenced, so it commits nothing, even on a committer still
        waiting for a part; the next save starts afresh. Does not block."""
        ...


class CheckpointIO(SaveIO[Trainer], Protocol):
    """What the worker needs of a checkpoint implementation (called on every rank)."""

    def position(self, root: str, step: int) -> tuple[int, int]:
        """``(step, consumed_samples)`` of the committed checkpoint ``step`` under ``root``."""
        ...

    def restore(self, trainer: Trainer, root: str, step: int) -> None:
        """Load this rank's layers, sliced for its TP rank, and its AdamW moments."""
        ...

    def restore_layers(self, trainer: Trainer, root: str, step: int, layers: list[int]) -> None:
        """Like ``restore`` for ``layers`` (a subset of this rank's) only: an in-place
        relayout reads what no live rank holds."""
        ...

    def save(
        self,
        trainer: Trainer,
        root: str,
        keep: int | None = None,
        prune_below: int = -1,
        optional: bool = False,
        drop_steps: tuple[int, ...] | None = None,
    ) -> float:
        """Snapshot now (collective), persist in the background; returns the stall seconds.
        A failure on this rank (the snapshot, opening the storage) or on a peer does not
        raise: every rank still runs the save's collectives in the same order, this rank's
        failure is then the save's (``done`` is True, ``wait`` raises it) and a peer's leaves
        nothing in flight; the worker's save poll agrees it.
        ``keep``: committed checkpoints kept under ``root`` (older ones deleted after the
        commit); None: the implementation's default. ``prune_below`` >= 0: after the commit,
        every step below it is deleted (the controller's retention: it names the oldest
        checkpoint it has recorded and still keeps). ``drop_steps`` (the steps of
        saves the controller gave up on; None: no such rule): after the commit, those of
        them at or above ``prune_below`` that were committed when the save began are deleted
        too. ``optional``: the caller drops the
        save if it fails (a periodic one): it is skipped, not taken, while this rank still
        writes an abandoned save (``CheckpointSaves``); a required save goes ahead."""
        ...

    def done(self) -> bool:
        """Whether this rank's part of the save in flight is durable (and committed, on the
        committer), without blocking."""
        ...

    def wait(self) -> None:
        """Block until this rank's part of the save in flight is durable (and committed)."""
        ...

    def close(self) -> None:
        """Finish the save in flight and release threads."""
        ...

    def reset(self) -> None:
        """Forget everything tied to the current world without waiting (it was abandoned:
        a save in flight may wait on dead peers); the next save starts afresh."""
        ...
