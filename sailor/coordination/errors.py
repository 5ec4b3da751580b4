"""Errors of the coordination layer, each carrying its recovery policy.

Third-party errors (nats-py, aetcd, grpc) are converted here, at the adapter, with
``raise ... from exc``: callers above this layer never see a client library's exception type.
A ``TemporaryError`` says after how long a retry makes sense; a ``PermanentError`` says that
retrying cannot help (a fenced write, a malformed message).
"""

from __future__ import annotations

__all__ = [
    "ChangedError",
    "CoordinationError",
    "DaemonFailedError",
    "EventTooLargeError",
    "FencedError",
    "PermanentError",
    "ReplicasExceedClusterError",
    "StreamConflictError",
    "StreamNotPlacedError",
    "StreamStorageError",
    "TemporaryError",
    "UnavailableError",
]


class CoordinationError(Exception):
    """Base class. ``retry_after`` is None when retrying cannot help."""

    retry_after: float | None = None

    def __init__(self, message: str, **fields: object) -> None:
        super().__init__(message)
        self.fields = fields

    def __str__(self) -> str:
        base = super().__str__()
        if not self.fields:
            return base
        extra = ", ".join(f"{k}={v!r}" for k, v in sorted(self.fields.items()))
        return f"{base} ({extra})"


class TemporaryError(CoordinationError):
    """Retry after ``retry_after`` seconds (server restarting, timeout, no quorum)."""

    def __init__(self, message: str, retry_after: float = 0.2, **fields: object) -> None:
        super().__init__(message, **fields)
        self.retry_after = retry_after


class UnavailableError(TemporaryError):
    """The server could not be reached in time."""


class StreamNotPlacedError(UnavailableError):
    """JetStream cannot place a stream's replicas now: fewer of the cluster's servers are up
    (or joined) than the replicas asked for. Servers coming back end it: retry. (A cluster
    configured smaller than the replicas answers the same; a client cannot tell the two
    apart, so it is retried too and reported overdue.)"""


class PermanentError(CoordinationError):
    """Do not retry: the request itself is wrong or no longer allowed."""

    retry_after = None


class ReplicasExceedClusterError(PermanentError):
    """A stream asks for more than one replica of a NATS server in no cluster: a
    configuration error, which no retry ends."""


class StreamConflictError(PermanentError):
    """The job's event stream cannot be made: a stream of its name carries another job's
    subjects, or another stream carries its subjects. Left unchanged: an operator decides."""


class StreamStorageError(PermanentError):
    """The job's event stream cannot be made: the NATS server cannot reserve its
    ``max_bytes`` out of JetStream's ``max_file_store``. An operator raises the one or
    lowers the other (or deletes finished jobs' streams); no retry of the same request ends
    it."""


class EventTooLargeError(PermanentError):
    """An event above the stream's largest message: refused before it is sent, since the
    server would refuse every retry of it."""


class FencedError(PermanentError):
    """A guarded write was refused: the writer's epoch is no longer the leader's."""


class ChangedError(PermanentError):
    """A guarded write that also compared other keys' revisions was refused because one of
    them changed or went (an operator withdrew the request it answered): the writer still
    leads; the same write, retried, is refused again."""


class DaemonFailedError(PermanentError):
    """A daemon stops because it cannot go on safely (a long-lived task kept crashing, its
    state is unreadable): the process exits non-zero and its supervisor (systemd) restarts it.
    """
