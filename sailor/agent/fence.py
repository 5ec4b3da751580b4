"""The agent's epoch fence, kept on disk so that it outlives the agent process.

An agent refuses a command whose epoch is lower than the highest it has accepted: a deposed
controller (a lower epoch) must change nothing. Held only in memory, the fence was lost with
the process, and a restarted agent obeyed a deposed controller again. So the fence is a small
file in the agent's run directory, raised (:func:`sailor.durable.write_durably`: written to a
temporary file, fsynced, renamed, directory fsynced; a run directory it makes, fsynced in its
parent) *before* the command that raised it is applied and acked; on start it is
read back, and the agent also raises it to the epoch of the desired state in etcd (the newest
leader that wrote it), which covers a lost or new run directory.

The fence is only raised to an epoch a leader can hold: a command whose epoch is beyond
etcd's current revision (epochs are the leader key's create revisions) is refused before it
touches the fence (``AgentCommands._unissued``), and a fence found beyond etcd's revision at
start is lowered to the desired state's epoch (``lower_to``): raised to such an epoch, the
agent refused every real leader's command for good.

An unreadable fence file is not guessed at: ``FenceUnreadableError`` (the agent exits, an
operator looks). Must never import the controller.
"""

from __future__ import annotations

import json
from pathlib import Path

from sailor.durable import write_durably
from sailor.schemas.json_text import load_json

__all__ = ["EpochFence", "FenceUnreadableError"]


class FenceUnreadableError(RuntimeError):
    """The fence file exists but does not hold an epoch."""


class EpochFence:
    """The highest epoch accepted, persisted at ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.epoch = self._load()

    def _load(self) -> int:
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return 0
        try:
            epoch = load_json(raw, str(self.path))["epoch"]
            if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
                raise ValueError(f"epoch {epoch!r}")
        except (ValueError, KeyError, TypeError) as exc:
            raise FenceUnreadableError(f"{self.path}: {exc!r}"[:300]) from exc
        return epoch

    def raise_to(self, epoch: int) -> bool:
        """Raise the fence to ``epoch`` (durably, before returning); False if not higher."""
        # a plain int: ``True`` (a desired state's ``"epoch": true``, which the controller
        # reads as 1) was written as ``true``, and the next start refused the fence file
        epoch = int(epoch)
        if epoch <= self.epoch:
            return False
        self._write(epoch)
        return True

    def lower_to(self, epoch: int, revision: int) -> bool:
        """Lower the fence to ``epoch`` (durably) when it stands beyond etcd's current
        ``revision``: no leader was ever elected there (epochs are create revisions), so it
        was raised by a command no leader sent (before epochs were checked against etcd)
        or etcd was restored from an older snapshot; kept, it would refuse every real
        leader. False (unchanged) when the fence is within ``revision``."""
        epoch = int(epoch)
        if self.epoch <= revision or epoch >= self.epoch:
            return False
        self._write(epoch)
        return True

    def _write(self, epoch: int) -> None:
        write_durably(self.path, json.dumps({"epoch": epoch}).encode(), make_dirs=True)
        self.epoch = epoch
