"""Abandoning a world: abortable waits, and leaving process groups whose peers failed.

In-place reconfiguration keeps a worker process alive across a failure of its
world: a rank whose peer died must leave every wait promptly, drop the old groups without
hanging, and join a new world. What torch 2.13 gloo does, measured with three processes on
this machine (benchmarks/comm_abort.py reproduces it):

- an all-reduce or an ``irecv`` with a peer killed by ``SIGKILL`` raises "Connection closed
  by peer" within ~30 ms (the ``irecv`` only inside ``wait()``); a rank blocked on a *live*
  peer that itself failed waits until that peer's socket closes or the timeout;
- ``Work.wait(timeout)`` cannot be used to poll: on its timeout gloo closes the pair
  ("Application timeout caused pair closure"), breaking the world at the first poll;
- ``ProcessGroup.abort()`` neither wakes waits on other ranks nor closes sockets;
  ``distributed_c10d._abort_process_group()`` then ``init_process_group`` at a new port
  works (7-35 ms), and the new world's groups work;
- gloo's point-to-point works (``isend``/``irecv``) never report ``is_completed()`` before
  ``wait()`` was called (the wait does the work, and sees a dead peer): they cannot be
  polled. Their ``wait`` runs
  on a helper thread (:func:`wait_threaded`) while the caller waits on an event in short slices;
  after an abort a new helper thread serves the new world (the old one stays blocked);
- dropping the last reference to a ``Work`` (or its group) whose operation is still blocked
  hangs in the destructor (it joins the backend's worker thread): abandoned works and
  groups must stay referenced until the process ends (then ``os._exit``).

Hence: once :func:`set_polling` turned it on (workers started with ``--in-place``; others
block in ``Work.wait`` as before), every gloo wait of :class:`~sailor.comm.api.TorchBackend`
runs on the helper thread and raises :class:`CommAbortedError` once :func:`request_abort`
was called (the worker's ``SIGUSR1`` handler calls it). NCCL's ``Work.wait`` only orders
the CUDA stream and returns: :func:`wait` checks the flag and calls it, and the host
blocks only where it reads the device back (step timestamps, values of collectives), each
through :func:`host_sync`: an event polled with a short backoff (:func:`poll_until`), so
the handler runs and the wait leaves. :func:`abandon_world` aborts the communicators
(``_abort_process_group`` aborts every NCCL communicator inside one group call). The NCCL
side is untested here (no GPU): its logic is (``poll_until``, the stream-ordered wait).

This module never decides when to abort: the worker does.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

__all__ = [
    "CommAbortedError",
    "abandon_world",
    "abandoned",
    "abort_requested",
    "backend_error",
    "clear_abort",
    "host_sync",
    "keep_alive",
    "poll_until",
    "polling",
    "request_abort",
    "set_polling",
    "wait",
    "wait_threaded",
]

# The poll (works that report completion: NCCL's): a few immediate checks, then sleeps of
# a tenth of the time waited so far (at least 20 us, at most 1 ms): an abort is seen within
# ~1 ms and a long idle wait costs ~1000 wake-ups/s. On gloo (benchmarks/comm_abort.py,
# 2 ranks, this loaded 2-core machine) such polling cost +170..+320 us on a 1-element
# all-reduce and up to +50% at 1 MiB (sleeps overshoot on a loaded host); waiting on the
# helper thread instead (wait_threaded) costs +75 us (745 -> 820 us) and +37 us at 1 MiB
# (2537 -> 2574 us), so gloo uses the helper thread for every work. Opt-in either way
# (set_polling).
_SPINS = 20
_FIRST_SLEEP_S = 20e-6
_MAX_SLEEP_S = 1e-3
_SLEEP_FRACTION = 0.1

_abort = False
_polling = False
_graveyard: list[Any] = []


class CommAbortedError(RuntimeError):
    """A wait left because the world was abandoned (``request_abort``): not a bug, the
    worker holds for a relayout directive. Its text names gloo/abort so that failure
    records classify it as a peer's failure."""


def set_polling(on: bool) -> None:
    """Poll waits (abortable) or block in them (the default: no overhead at all). A worker
    that takes part in in-place reconfiguration turns polling on before its first group."""
    global _polling
    _polling = on


def polling() -> bool:
    """Whether waits are abortable (:func:`set_polling`)."""
    return _polling


def request_abort() -> None:
    """Make every current and later wait raise :class:`CommAbortedError` (signal-safe)."""
    global _abort
    _abort = True


def clear_abort() -> None:
    """Forget an abort request (once the old world is abandoned)."""
    global _abort
    _abort = False


def abort_requested() -> bool:
    return _abort


def keep_alive(obj: Any) -> None:
    """Keep ``obj`` (a ``Work`` or a process group that may be blocked) referenced for the
    life of the process: its destructor could join a thread blocked on a dead peer.

    Only the object: nothing of this module keeps a tensor beside it (a finished wait's
    work is let go by the helper thread). A work keeps its own tensors alive inside torch
    (an NCCL work its outputs, e.g. a gradient bucket), and those stay allocated with it:
    device memory each broken generation may pin, which the planner does not price.
    Whether NCCL does is measured where 2 GPUs are
    (``tests/gpu/test_comm_abort_memory_gpu.py``), not here."""
    _graveyard.append(obj)


def abandoned() -> bool:
    """Whether anything was abandoned (the process must then end with ``os._exit``)."""
    return bool(_graveyard)


def _raise_aborted() -> None:
    raise CommAbortedError("communication aborted: world abandoned (SIGUSR1, gloo/nccl)")


def wait(work: Any) -> Any:
    """Wait for a work whose ``wait`` is stream-ordered (NCCL's: it makes the current CUDA
    stream wait for the operation and returns at once), leaving with
    :class:`CommAbortedError` if an abort was requested.

    The host does not poll the work: ``is_completed`` is true only once the GPU has run the
    operation, after everything queued before it, so polling made every collective and
    p2p exchange a host-device synchronization (the host could no longer run ahead of the
    GPU). Where the host really blocks on the device (a timestamp, a value read back) it
    waits through :func:`host_sync`, which is abortable. A work that fails raises its own
    error from ``wait``; on any exception the work is kept alive (:func:`keep_alive`).
    """
    if work is None:  # a collective this rank is not a member of
        return None
    if not _polling:
        return work.wait()
    try:
        if _abort:
            _raise_aborted()
        return work.wait()
    except BaseException:
        keep_alive(work)
        raise


def poll_until(done: Callable[[], bool]) -> None:
    """Return once ``done()`` is true, checking a few times at once, then with sleeps of a
    tenth of the time waited so far (20 us to 1 ms); :class:`CommAbortedError` once an abort
    is requested. The main thread never blocks uninterruptibly, so a Python signal handler
    runs promptly."""
    if _abort:
        _raise_aborted()
    for _ in range(_SPINS):
        if done():
            return
    start = time.perf_counter()
    while not done():
        if _abort:
            _raise_aborted()
        waited = time.perf_counter() - start
        time.sleep(min(_MAX_SLEEP_S, max(_FIRST_SLEEP_S, waited * _SLEEP_FRACTION)))


def host_sync(device: Any) -> None:
    """Wait until ``device`` has run its queued work (a CUDA device; nothing elsewhere, where
    the work is done when a call returns): ``torch.cuda.synchronize``, or with polling on
    (in-place workers) an event recorded on the current stream and polled
    (:func:`poll_until`), so that a rank whose queued collective waits on a dead peer still
    leaves on ``SIGUSR1`` (inside ``cudaStreamSynchronize`` no Python handler runs)."""
    if getattr(device, "type", "cpu") != "cuda":
        return
    import torch

    if not _polling:
        torch.cuda.synchronize(device)
    else:
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(device))
        poll_until(event.query)
    if dist.is_available() and dist.is_initialized():
        from torch.distributed import distributed_c10d as c10d

        failed = backend_error(list(c10d._world.pg_map.items()), device)
        if failed is not None:
            raise dist.DistBackendError(failed)


def backend_error(groups: list[tuple[Any, Any]], device: Any) -> str | None:
    """Why the first communicator of ``groups`` (``(group, ...)`` pairs, as torch's group
    map holds them) that reports an error failed, or None when none does.

    After a host sync, before any value is read back: with
    ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` (``devices.nccl_env``) NCCL's watchdog aborts a
    communicator whose collective timed out or whose peer failed *without raising in
    Python*. Its kernels then end, the sync returns, and the buffers hold no result: a loss,
    a gradient norm or an agreed stop step read from them would be used, until the next
    collective raises. ``get_error`` (ProcessGroupNCCL's) tells; backends without it (gloo,
    torch builds without NCCL) are skipped."""
    for group, _ in groups:
        try:
            backend = group._get_backend(device)
        except (RuntimeError, ValueError):  # the group has no backend for this device
            continue
        get_error = getattr(backend, "get_error", None)
        if get_error is None:
            continue
        err = get_error()
        name = getattr(err, "name", str(err))
        if name != "SUCCESS":
            return (
                f"NCCL communicator of group {group.group_name!r} (size {group.size()}) "
                f"reports {name} after a host sync: a collective timed out or a peer "
                "failed; values read back from the device are not results"
            )
    return None


# How often a caller blocked in wait_threaded looks at the abort flag (the wake-up on completion
# is immediate: an event): within 10 ms of SIGUSR1, 100 wake-ups/s while it waits.
_P2P_SLICE_S = 0.01


class _Waiter:
    """One daemon thread that calls ``wait()`` on the works it is given, in order."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[tuple[Any, threading.Event, list[BaseException]]] = (
            queue.SimpleQueue()
        )
        threading.Thread(target=self._serve, name="sailor-p2p-waiter", daemon=True).start()

    def _serve(self) -> None:
        while True:
            work, done, errors = self.jobs.get()
            try:
                work.wait()
            except BaseException as exc:  # handed to the caller
                errors.append(exc)
            done.set()
            # not held while waiting for the next job: a work keeps its tensors (gloo's its
            # buffers, NCCL's its outputs), and the last one stayed referenced until the
            # next wait, for good when no world came after it
            del work, done, errors


_waiter: _Waiter | None = None


def wait_threaded(work: Any) -> Any:
    """Wait for a gloo ``work`` on the helper thread (see the module docstring), abortably."""
    global _waiter
    if not _polling:
        return work.wait()
    if _abort:
        keep_alive(work)
        _raise_aborted()
    if _waiter is None:
        _waiter = _Waiter()
    done = threading.Event()
    errors: list[BaseException] = []
    _waiter.jobs.put((work, done, errors))
    while not done.wait(_P2P_SLICE_S):
        if _abort:
            keep_alive(work)
            _waiter = None  # blocked for good: the next world gets its own thread
            _raise_aborted()
    if errors:
        keep_alive(work)
        raise errors[0]
    return True


def abandon_world(idle: bool = False) -> None:
    """Leave the current world without waiting on anyone: every group is aborted (NCCL
    communicators included) and the default group is unset so that ``init_process_group``
    may start a new world. A no-op without a world.

    ``idle``: nothing of the world is blocked (a held world left cleanly, its device's work
    drained): its groups are dropped once aborted, and their destructors free their sockets,
    threads and host objects now. Else (a broken world: a thread may block on a dead peer)
    they are kept alive for the process's life (:func:`keep_alive`). Before, every clean
    leave kept them too: each in-place generation added its world's groups (8 descriptors a
    one-rank gloo world with one subgroup) for good."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    from torch.distributed import distributed_c10d as c10d

    if not idle:
        for pg in list(c10d._world.pg_map):
            keep_alive(pg)
    c10d._abort_process_group()
