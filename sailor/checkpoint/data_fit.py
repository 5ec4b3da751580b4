"""Whether a committed checkpoint was trained on the data of the run about to resume from it.

A checkpoint's data position is one counter, ``consumed_samples``. Resumed over another
corpus, sequence length, tokenizer, split or seed, it goes on over other samples, and the
loss curve does not show it. Every checkpoint records its data's identity
(``CheckpointManifest.data``, ``schemas.data_identity``); the run compares its own with it
before any shard is read, and refuses a difference by name (:class:`DataMismatchError`, a
configuration error: the job is held, no node blamed) unless the operator accepts it (the
training config's ``allow_data_change``), when the differences are returned to be logged.

A checkpoint written before identities were recorded has none: accepted, with one warning
per process. A run whose data says nothing (a trainer that records no identity) is not
compared.

Pure but for that warning: a manifest and the run's identity in, an error or the accepted
differences out. Must never read storage.
"""

from __future__ import annotations

import sys

from sailor.checkpoint.errors import DataMismatchError
from sailor.schemas.checkpoint import CheckpointManifest
from sailor.schemas.data_identity import DataIdentity, data_differences, describe_differences

__all__ = ["check_data_fit"]

_warned_unrecorded = False
"""Whether this process warned of a checkpoint without a data identity (once is enough: a
run loads one checkpoint per generation, an in-place one several)."""


def check_data_fit(
    manifest: CheckpointManifest,
    current: DataIdentity | None,
    *,
    allow_change: bool,
    where: str,
) -> list[tuple[str, str, str]]:
    """Raise :class:`DataMismatchError` if the checkpoint of ``manifest`` (``where``: its
    root and step) was trained on other data than ``current`` (this run's), unless
    ``allow_change``; return the differences accepted (``(field, checkpoint's value, this
    run's value)``), empty when the data is the same or either side does not say."""
    global _warned_unrecorded
    saved = manifest.data
    if current is None:
        return []
    if saved is None:
        if not _warned_unrecorded:
            _warned_unrecorded = True
            print(
                f"checkpoint {where}: no data identity recorded (saved before Sailor "
                "recorded one): resumed without checking that this run's data is the one "
                "it was trained on",
                file=sys.stderr,
                flush=True,
            )
        return []
    changes = data_differences(saved, current)
    if changes and not allow_change:
        raise DataMismatchError(
            f"checkpoint {where} (model {manifest.model!r}) was trained on other data than "
            f"this run's: {describe_differences(changes)}. Its consumed_samples="
            f"{manifest.consumed_samples} would index other samples. Resume with the data it "
            "was trained on, start a new run in another checkpoint directory, or set "
            "allow_data_change: true in the training config to continue on this data"
        )
    return changes
