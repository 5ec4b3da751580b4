"""A worker's failure report: the first cause, written once, where the agent can read it.

A worker that fails writes one JSON object to its error file and exits non-zero; it never
waits for peers (they may be dead). The record says whether the failure is this rank's own
(``origin="local"``: an exception in its code, injected or real) or a consequence of another
rank's failure (``origin="peer"``: a collective or p2p operation failed because a peer
closed its connections or stopped answering within the timeout). The agent reports the
local causes; peer records only confirm that the rank stopped. Both are ``retry=True``
from the runtime's point of view: restart from the last committed checkpoint, maybe on
another layout; a bad configuration (``ValueError`` before training) is ``retry=False``.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "FailureRecord",
    "InjectedFailureError",
    "classify",
    "failure_record",
    "write_error_file",
]

FailureRecord = dict[str, Any]
Origin = Literal["local", "peer", "config"]

# Fragments of the messages torch.distributed (gloo, NCCL) raises when a peer is gone or
# silent; matched case-insensitively on the exception text and its type name.
_PEER_MARKERS = (
    "connection closed by peer",
    "connection reset",
    "broken pipe",
    "timed out",
    "timeout",
    "distbackenderror",
    "nccl",
    "gloo",
    "socket",
    "connection refused",
)


class InjectedFailureError(RuntimeError):
    """Raised on purpose (``--fail-at-step``) to test failure handling."""


def classify(exc: BaseException, in_training: bool) -> Origin:
    """Whether ``exc`` is this rank's own failure, a peer's, or a configuration error."""
    if isinstance(exc, InjectedFailureError):
        return "local"
    if not in_training and isinstance(exc, ValueError):
        return "config"
    text = f"{type(exc).__name__} {exc}".lower()
    if any(m in text for m in _PEER_MARKERS):
        return "peer"
    return "local"


def failure_record(exc: BaseException, rank: int, step: int, in_training: bool) -> FailureRecord:
    """The JSON-able record of the first failure of a rank."""
    origin = classify(exc, in_training)
    return {
        "rank": rank,
        "step": step,
        "origin": origin,
        "retry": origin != "config",
        "error_type": type(exc).__name__,
        "message": str(exc)[:4000],
        "traceback": "".join(traceback.format_exception(exc))[-8000:],
        "pid": os.getpid(),
        "time": time.time(),
    }


def write_error_file(path: str | Path | None, record: FailureRecord) -> None:
    """Write ``record`` atomically to ``path`` unless a first cause is already there."""
    if path is None:
        return
    p = Path(path)
    if p.exists():
        return
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(p.suffix + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(record) + "\n")
    tmp.replace(p)
