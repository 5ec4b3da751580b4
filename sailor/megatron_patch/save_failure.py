"""A save that failed on some rank, raised by every rank (after ``control.agree_save``).

Before, only the ranks whose save failed raised (a writer that refused a step holding an inf
or NaN, and the committer that read its refusal); every other rank went on into its next
collective and waited there (NCCL: until the process group's timeout or the controller's
abort). And the committer's echo of a writer's refusal was recorded as its own failure
(``origin=local``), so its node was charged for a NaN computed on another node.

Now every rank learns that some save failed in the same collective poll, and all gather
what failed (one object all-gather, on this rare path only). Then, by the first failure in
rank order:

- one whose class says ``job_wide`` (``sailor.checkpoint.NonFiniteCheckpointError``: the
  weights are bad wherever they run): every rank raises it, with the same text (a rank that
  has its own re-raises that; the others build it from the gathered class and text), once
  every rank's save is over (the committer has deleted the refused save's files). The
  controller holds it against the job (``failure_text.AGREED_ERRORS``), never a node;
- any other (a node's storage failing, a snapshot's host or device memory): the ranks that
  failed raise their own (charged to their node); the others raise ``PeerFailedError``
  (``origin=peer``: not charged) naming the failed ranks and their hosts.

A save that failed in its snapshot, before its persist (``Checkpointer.save``), reaches here
the same way: that rank's save is done and its ``wait`` raises the error.

An optional save (the controller's periodic checkpoint: ``ControlRequest.save_optional``) is
no reason to end the job: :func:`report_save_failure` returns what failed, the same text on
every rank, for the boundary to report, and training goes on. A job-wide failure among the
ranks' still raises as above: a refusal of non-finite weights says the weights every rank
trains on are bad, so training on would only be refused again at the next save, and the
job is relaunched from its last good commit (the controller holds it against the job).

A ``job_wide`` error class takes its message as its only positional argument. This module
must not import ``sailor.checkpoint`` (layers): it reads the class attribute by name. A
rank sends the class's name (``module:qualname``), never the class (the object collectives
carry plain data: ``sailor.comm.codec``); the others take it from a module this process has
already loaded (nothing is imported on a peer's word) and accept only an exception class
that says ``job_wide``: any other name, or a summary of another shape, raises
``PeerObjectError`` naming the sending rank (its fault: ``origin=peer`` here).
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Callable
from typing import Any

from sailor.comm.codec import PeerObjectError
from sailor.megatron_patch.errors import PeerFailedError
from sailor.megatron_patch.step_agreement import world_objects

__all__ = ["raise_save_failure", "report_save_failure"]


def _job_wide(exc: BaseException | None) -> bool:
    return exc is not None and _job_wide_class_attr(type(exc))


def _job_wide_class_attr(cls: type) -> bool:
    return bool(getattr(cls, "job_wide", False))


def _summary(exc: Exception | None) -> tuple[str | None, str, str] | None:
    """What a rank tells the others of its failure: its class's name (``module:qualname``)
    only when it is job-wide, else None, its text and its host."""
    if exc is None:
        return None
    t = type(exc)
    cls = f"{t.__module__}:{t.__qualname__}" if _job_wide(exc) else None
    return (cls, f"{t.__name__}: {exc}", socket.gethostname())


def _job_wide_class(name: str, rank: int) -> type[Exception]:
    """The job-wide exception class ``name`` (``module:qualname``) that rank ``rank`` sent,
    looked up in the modules already loaded here through their namespaces only (no import,
    no module ``__getattr__``)."""
    module, _, qualname = name.partition(":")
    found: Any = sys.modules.get(module)
    for part in qualname.split(".") if found is not None else ():
        found = vars(found).get(part) if hasattr(found, "__dict__") else None
    if isinstance(found, type) and issubclass(found, Exception) and _job_wide_class_attr(found):
        return found
    raise PeerObjectError(
        f"rank {rank} named error class {name[:200]!r} for its failed save: not a job-wide "
        "error class of this worker",
        rank=rank,
    )


def _received(g: Any, rank: int) -> tuple[type[Exception] | None, str, str] | None:
    """Rank ``rank``'s summary with its class resolved; ``PeerObjectError`` if it is not one."""
    if g is None:
        return None
    if not (
        isinstance(g, tuple)
        and len(g) == 3
        and (g[0] is None or isinstance(g[0], str))
        and isinstance(g[1], str)
        and isinstance(g[2], str)
    ):
        raise PeerObjectError(
            f"rank {rank} sent {str(g)[:200]} as its failed save's summary "
            "(class name or None, text, host expected)",
            rank=rank,
        )
    return (None if g[0] is None else _job_wide_class(g[0], rank), g[1], g[2])


def raise_save_failure(local: Exception | None, settle: Callable[[], None]) -> None:
    """Raise on this rank what the failed save means here (module docstring). Every rank
    calls it at the same point once a failure was agreed; ``settle`` (collective) runs
    first when the failure is job-wide."""
    _raise(local, _failed(local), settle)


def report_save_failure(local: Exception | None, settle: Callable[[], None]) -> str:
    """What failed in an optional save, the same text on every rank (module docstring);
    raises as :func:`raise_save_failure` if some rank's failure is job-wide. Every rank
    calls it at the same point once a failure was agreed."""
    failed = _failed(local)
    job_wide = [f for f in failed if f[1][0] is not None]
    if job_wide:
        _raise(local, job_wide, settle)
    return _describe(failed)


def _failed(local: Exception | None) -> list[tuple[int, tuple[Any, str, str]]]:
    """Every rank's failure as ``(rank, summary)`` (collective), in rank order; never empty."""
    got = [_received(g, r) for r, g in enumerate(world_objects(_summary(local)))]
    failed = [(r, g) for r, g in enumerate(got) if g is not None]
    if not failed:  # cannot happen after an agreed failure; never go on silently
        raise PeerFailedError("a checkpoint save failed on some rank (agreed), none said why")
    return failed


def _describe(failed: list[tuple[int, tuple[Any, str, str]]]) -> str:
    ranks = ", ".join(f"{r} ({g[2]})" for r, g in failed)
    return f"the checkpoint save failed on rank(s) {ranks}; rank {failed[0][0]}: {failed[0][1][1]}"


def _raise(
    local: Exception | None,
    failed: list[tuple[int, tuple[Any, str, str]]],
    settle: Callable[[], None],
) -> None:
    first_rank, (cls, text, _host) = failed[0]
    if cls is not None:
        settle()
        message = text.split(": ", 1)[1] if ": " in text else text
        if local is not None and type(local) is cls and str(local) == message:
            raise local
        raise cls(message) from local
    if local is not None:
        raise local
    ranks = ", ".join(f"{r} ({g[2]})" for r, g in failed)
    raise PeerFailedError(
        f"the checkpoint save failed on rank(s) {ranks}, not here; rank {first_rank}: {text}"
    )
