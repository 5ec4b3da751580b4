"""The collectives and point-to-point calls the engine, checkpoint and profiler make.

Every call goes to the process's current :class:`Backend`: plain ``torch.distributed`` by
default (one indirection, no copy, no check; every wait polled so that a worker can
abandon a failed world: :mod:`sailor.comm.abort`), or one a test installs with
:func:`use_backend` (``sailor.comm.strict`` records and checks every call against NCCL's
rules). Code that communicates calls these functions and never ``torch.distributed``
directly, so that what a test checks is the code that runs on GPUs.

What the API leaves out on purpose: tags (NCCL ignores them, so nothing may depend on them)
and lone blocking ``send``/``recv`` (a lone send larger than NCCL's buffer waits for its
receive; every exchange is a :func:`batch_isend_irecv` the caller waits on).

This module must never decide anything about a plan: it only forwards calls.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist

from sailor.comm import abort, objects

__all__ = [
    "Backend",
    "P2POp",
    "ReduceOp",
    "TorchBackend",
    "Work",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_object_list",
    "current_backend",
    "gather",
    "install_backend",
    "use_backend",
    "wait_all",
]

ReduceOp = Literal["sum", "max"]
"""The reductions the project uses (NCCL and gloo support both for every dtype we send)."""


@dataclass(frozen=True)
class P2POp:
    """One send or receive of a :func:`batch_isend_irecv` (``peer`` is a global rank)."""

    kind: Literal["send", "recv"]
    tensor: torch.Tensor
    peer: int


class Work(Protocol):
    """A handle of an asynchronous operation."""

    def wait(self) -> Any: ...


class Backend(Protocol):
    """What a communication backend implements (``group=None``: the whole world)."""

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp, group: Any) -> None: ...

    def all_gather(self, outs: list[torch.Tensor], tensor: torch.Tensor, group: Any) -> None: ...

    def all_gather_into_tensor(
        self, out: torch.Tensor, tensor: torch.Tensor, group: Any
    ) -> None: ...

    def gather(
        self, tensor: torch.Tensor, outs: list[torch.Tensor] | None, dst: int, group: Any
    ) -> None: ...

    def broadcast(self, tensor: torch.Tensor, src: int, group: Any) -> None: ...

    def barrier(self, group: Any) -> None: ...

    def batch_isend_irecv(self, ops: Sequence[P2POp]) -> list[Work]: ...

    def all_gather_object(self, outs: list[Any], obj: Any, group: Any) -> None: ...

    def broadcast_object_list(self, objs: list[Any], src: int, group: Any) -> None: ...


_REDUCE = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


def _wait(work: Any) -> Any:
    """Wait abortably (:mod:`sailor.comm.abort`): gloo works on the helper thread (its p2p
    works cannot be polled, and a waited event wakes at once where a polling sleep
    oversleeps on a loaded host); other backends' (NCCL) ``wait`` is stream-ordered and
    returns at once (:func:`abort.wait`: the host blocks only in ``abort.host_sync``)."""
    if not abort.polling():
        return work.wait() if work is not None else None
    gloo = dist.get_backend() == "gloo"
    return abort.wait_threaded(work) if gloo else abort.wait(work)


class _PolledWork:
    """A handle whose ``wait`` is abortable (:func:`_wait`)."""

    def __init__(self, work: Any) -> None:
        self.work = work

    def wait(self) -> Any:
        return _wait(self.work)


class TorchBackend:
    """``torch.distributed`` as it is (the default), with abortable waits.

    Every tensor operation is posted asynchronously and waited on through
    :func:`_wait`, so a rank blocked on a failed peer leaves when the worker abandons the
    world (``SIGUSR1``; on NCCL where the host waits for the device: ``abort.host_sync``).
    The object collectives (rare: control agreement, handshakes, a save's id) are made of
    the tensor ones (:mod:`sailor.comm.objects`), so they are abortable too, and carry plain
    data (:mod:`sailor.comm.codec`), never a pickle: torch's own object collectives unpickle
    a peer's bytes, which would let a hostile node run code on every rank. Without
    ``abort.set_polling(True)`` every wait is the plain blocking ``Work.wait``.
    """

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp, group: Any) -> None:
        _wait(dist.all_reduce(tensor, op=_REDUCE[op], group=group, async_op=True))

    def all_gather(self, outs: list[torch.Tensor], tensor: torch.Tensor, group: Any) -> None:
        _wait(dist.all_gather(outs, tensor, group=group, async_op=True))

    def all_gather_into_tensor(self, out: torch.Tensor, tensor: torch.Tensor, group: Any) -> None:
        _wait(dist.all_gather_into_tensor(out, tensor, group=group, async_op=True))

    def gather(
        self, tensor: torch.Tensor, outs: list[torch.Tensor] | None, dst: int, group: Any
    ) -> None:
        _wait(dist.gather(tensor, outs, dst=dst, group=group, async_op=True))

    def broadcast(self, tensor: torch.Tensor, src: int, group: Any) -> None:
        _wait(dist.broadcast(tensor, src=src, group=group, async_op=True))

    def barrier(self, group: Any) -> None:
        _wait(dist.barrier(group=group, async_op=True))

    def batch_isend_irecv(self, ops: Sequence[P2POp]) -> list[Work]:
        if not ops:
            return []
        p2p = [
            dist.P2POp(dist.isend if o.kind == "send" else dist.irecv, o.tensor, o.peer)
            for o in ops
        ]
        works = list(dist.batch_isend_irecv(p2p))
        return [_PolledWork(w) for w in works]

    def all_gather_object(self, outs: list[Any], obj: Any, group: Any) -> None:
        _check_abort()
        objects.all_gather_objects(self, outs, obj, group)

    def broadcast_object_list(self, objs: list[Any], src: int, group: Any) -> None:
        _check_abort()
        objects.broadcast_objects(self, objs, src, group)


def _check_abort() -> None:
    if abort.abort_requested():
        raise abort.CommAbortedError("communication aborted: world abandoned (SIGUSR1)")


_current: Backend = TorchBackend()


def current_backend() -> Backend:
    """The backend calls go to in this process."""
    return _current


def install_backend(backend: Backend) -> Backend:
    """Make ``backend`` the process's backend; returns the one it replaces."""
    global _current
    previous, _current = _current, backend
    return previous


@contextmanager
def use_backend(backend: Backend) -> Iterator[Backend]:
    """Route every call to ``backend`` inside the block (restored on exit)."""
    previous = install_backend(backend)
    try:
        yield backend
    finally:
        install_backend(previous)


def all_reduce(tensor: torch.Tensor, op: ReduceOp = "sum", group: Any = None) -> None:
    """In-place all-reduce of ``tensor`` over ``group``."""
    _current.all_reduce(tensor, op, group)


def all_gather(outs: list[torch.Tensor], tensor: torch.Tensor, group: Any = None) -> None:
    """``outs[i]`` = rank ``i``'s ``tensor`` (group order)."""
    _current.all_gather(outs, tensor, group)


def all_gather_into_tensor(out: torch.Tensor, tensor: torch.Tensor, group: Any = None) -> None:
    """The members' ``tensor`` concatenated along dim 0 into ``out``."""
    _current.all_gather_into_tensor(out, tensor, group)


def gather(
    tensor: torch.Tensor, outs: list[torch.Tensor] | None, dst: int, group: Any = None
) -> None:
    """Every member's ``tensor`` into ``outs`` on global rank ``dst`` (None elsewhere)."""
    _current.gather(tensor, outs, dst, group)


def broadcast(tensor: torch.Tensor, src: int, group: Any = None) -> None:
    """Global rank ``src``'s ``tensor`` into every member's ``tensor``."""
    _current.broadcast(tensor, src, group)


def barrier(group: Any = None) -> None:
    """Wait until every member reached the barrier."""
    _current.barrier(group)


def batch_isend_irecv(ops: Sequence[P2POp]) -> list[Work]:
    """Post ``ops`` together (one NCCL group); wait on the handles before reusing buffers."""
    return _current.batch_isend_irecv(ops)


def wait_all(works: Sequence[Work]) -> None:
    """Wait on every handle of a :func:`batch_isend_irecv`; if one fails, the others are
    kept alive (they may be blocked on a dead peer: see :mod:`sailor.comm.abort`)."""
    try:
        for w in works:
            w.wait()
    except BaseException:
        for w in works:
            abort.keep_alive(w)
        raise


def all_gather_object(outs: list[Any], obj: Any, group: Any = None) -> None:
    """``outs[i]`` = rank ``i``'s ``obj`` (plain data: :mod:`sailor.comm.codec`; a peer's
    bytes that do not decode raise ``PeerObjectError`` naming that rank)."""
    _current.all_gather_object(outs, obj, group)


def broadcast_object_list(objs: list[Any], src: int, group: Any = None) -> None:
    """Global rank ``src``'s ``objs`` into every member's list."""
    _current.broadcast_object_list(objs, src, group)
