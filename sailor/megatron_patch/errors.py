"""A worker's failure report: the first cause, written once, where the agent can read it.

A worker that fails writes one JSON object to its error file and exits non-zero; it never
waits for peers (they may be dead). The record says whether the failure is this rank's own
(``origin="local"``: an exception in its code, injected or real) or a consequence of another
rank's failure (``origin="peer"``: a collective or p2p operation failed because a peer
closed its connections or stopped answering within the timeout). The agent reports the
local causes; peer records only confirm that the rank stopped. A peer record that knows the
guilty rank (a ``PeerObjectError``: bytes a rank sent that do not decode, an oversized size,
an object of the wrong shape) also names it, ``culprit`` (its global rank): the controller
charges that rank's node, not this one (``controller/culprits.py``). Both are ``retry=True``
from the runtime's point of view: restart from the last committed checkpoint, maybe on
another layout; a bad configuration (``ValueError`` before training) is ``retry=False``.
A rendezvous store that cannot bind its port (``EADDRINUSE`` before training: rank 0's
``TCPStore`` at ``--master``, whose port another process holds) is ``origin="rendezvous"``:
neither this node's fault nor a peer's, and a launch on another port succeeds (the
controller relaunches at the next generation's port, ``controller/rendezvous_ports.py``).

A worker killed by a signal cannot write its record (NCCL's watchdog aborts the process from
a C++ thread: ``SIGABRT``, no Python exception). Its parent (the agent's supervisor, or
``launch_local``) then writes :func:`signal_failure_record` in its place, with the Python
stacks the worker's ``faulthandler`` left in :func:`fault_path` of its error file.

A killed worker whose process is still there after SIGKILL and the agent's whole teardown
bound (a rank in uninterruptible sleep in the GPU driver's teardown, after an NCCL hang or
an XID error) still holds its GPU: the agent reports :func:`outlived_kill_record`, with
``retry=False`` because no restart on that node frees the GPU; only the process's end or a
reboot does.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import re
import signal
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from sailor.comm.codec import PeerObjectError

__all__ = [
    "AGREED",
    "MAX_RANK",
    "FailureRecord",
    "InjectedFailureError",
    "PeerFailedError",
    "SaveTimeoutError",
    "classify",
    "close_fault_file",
    "culprit_of",
    "failure_record",
    "fault_path",
    "outlived_kill_record",
    "read_error_file",
    "signal_failure_record",
    "write_error_file",
    "write_error_file_within",
]

FailureRecord = dict[str, Any]
Origin = Literal["local", "peer", "config", "rendezvous"]

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

# Fragments of the error of a listening socket whose port is taken (errno EADDRINUSE, as
# torch's TCPStore server words it: "The server socket has failed to listen on any local
# network address. port: P, ..., code: -98, name: EADDRINUSE, message: address already in
# use"), matched before the peer markers (the text says "socket"). Before training the
# only socket a rank binds to a given port is rank 0's rendezvous store (gloo and NCCL
# listen on ports the kernel picks).
_RENDEZVOUS_MARKERS = ("eaddrinuse", "address already in use")

# Fragments of errors that NCCL or CUDA raise about this rank's own work, matched before the
# peer markers (their text says "nccl" too): NCCL's ncclUnhandledCudaError (a CUDA failure
# inside NCCL, out of memory among them), ncclInvalidArgument and ncclInvalidUsage (a bug
# in this rank's call), and CUDA's own out-of-memory and illegal-access errors. A peer
# that died shows as a timeout, a remote error or a closed connection, never as these.
_LOCAL_MARKERS = (
    "out of memory",
    "outofmemoryerror",
    "unhandled cuda error",
    "invalid usage",
    "invalid argument",
    "illegal memory access",
    "illegal address",
)


class InjectedFailureError(RuntimeError):
    """Raised on purpose (``--fail-at-step``) to test failure handling."""


class PeerFailedError(RuntimeError):
    """Raised by a rank that is fine because another rank's failure was agreed (a save that
    failed on another rank's storage): ``origin="peer"``, never charged to this node.

    It names no ``culprit`` in its record (:func:`failure_record`): the rank it speaks of
    failed on its own and reports that itself (its node is charged by its own record), or
    was preempted, or failed of a third rank's bytes; this rank's word that it stopped is no
    evidence that it is to blame."""


class SaveTimeoutError(RuntimeError):
    """A save not durable on this rank within its deadline (``boundary``: the periodic saves,
    ``--periodic-save-timeout-s``): this rank's write or, on the committer, the wait for
    every part has not ended. The save is dropped (an optional one is reported and training
    goes on); its write, if hung, is left running. This rank's own failure (its storage)."""


AGREED = ("NonFiniteGradientsError", "LabelOutOfRangeError", "NonFiniteCheckpointError")
"""Errors every rank raises alike after a collective agreed on them (the controller's
``failure_text.AGREED_ERRORS``, kept equal by a test): this rank's own, whatever their text
says (it names ranks and hosts, and a host named ``gloo-3`` read as a peer's failure)."""


def classify(exc: BaseException, in_training: bool) -> Origin:
    """Whether ``exc`` is this rank's own failure, a peer's, a configuration error, or, before
    training, its rendezvous store's port taken by another process (``rendezvous``). A
    peer's object collective bytes that do not decode (``PeerObjectError``, a
    ``ValueError``) are that peer's fault, before training too: ``peer``, not ``config``."""
    if isinstance(exc, InjectedFailureError) or type(exc).__name__ in AGREED:
        return "local"
    if isinstance(exc, PeerFailedError | PeerObjectError):  # the sender's fault, not ours
        return "peer"
    if not in_training and isinstance(exc, ValueError):
        return "config"
    text = f"{type(exc).__name__} {exc}".lower()
    if not in_training and any(m in text for m in _RENDEZVOUS_MARKERS):
        return "rendezvous"
    if any(m in text for m in _LOCAL_MARKERS):
        return "local"
    if any(m in text for m in _PEER_MARKERS):
        return "peer"
    return "local"


def failure_record(
    exc: BaseException, rank: int, step: int, in_training: bool, last_step: int | None = None
) -> FailureRecord:
    """The JSON-able record of the first failure of a rank.

    ``step``: the step it failed at (inside an iteration, the one it computes: the step the
    engine's agreed errors name); ``last_step``: the last step it finished (what a parent's
    :func:`signal_failure_record` calls ``step``; None: the same as ``step``).

    A peer's failure that names its guilty rank (a ``PeerObjectError``'s sender) carries it
    as ``culprit``, right after ``retry``: the agent keeps a record's first 2000 characters
    only, and the controller reads these keys from the text, whole or cut off
    (``controller/failure_text.py``)."""
    origin = classify(exc, in_training)
    record: FailureRecord = {
        "rank": rank,
        "step": step,
        "origin": origin,
        "retry": origin != "config",
    }
    if origin == "peer" and isinstance(exc, PeerObjectError) and exc.rank >= 0:
        record["culprit"] = exc.rank
    return record | {
        "last_step": step if last_step is None else last_step,
        "error_type": type(exc).__name__,
        "message": str(exc)[:4000],
        "traceback": "".join(traceback.format_exception(exc))[-8000:],
        "pid": os.getpid(),
        "time": time.time(),
    }


def write_error_file(
    path: str | Path | None, record: FailureRecord, writer_gone: bool = False
) -> None:
    """Write ``record`` atomically to ``path`` unless a first cause is already there.

    Two threads of a worker may write at once (its main handler, and its load barrier's
    heartbeat ending it of a peer's failure): each writes a temporary file of its own (the
    process and the thread in its name) and links it into place, which fails if a record
    is there already, so the first writer's stays whole. A file system without hard links
    (some FUSE and CIFS mounts) gets a claim instead: the first writer to create
    ``<path>.claim`` exclusively (``O_EXCL``) renames its temporary file into place, still
    atomically; the others give way. ``writer_gone``: the worker's own writers are gone (the
    agent's record of a worker that wrote none): a claim without a record is not waited
    for. A record there that does not parse (a writer cut off) counts as none."""
    if path is None:
        return
    p = Path(path)
    if read_error_file(p) is not None:
        return
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(p.suffix + f".tmp{os.getpid()}-{threading.get_ident()}")
    try:
        tmp.write_text(json.dumps(record) + "\n")
        try:
            os.link(tmp, p)
        except FileExistsError:
            if read_error_file(p) is None:  # not a record: a writer cut off mid-write
                tmp.replace(p)
        except OSError:  # no hard links here: the first claim's writer renames
            claim = p.with_suffix(p.suffix + ".claim")
            try:
                os.close(os.open(claim, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            except FileExistsError:
                if writer_gone and read_error_file(p) is None:
                    tmp.replace(p)
            else:
                tmp.replace(p)
    finally:
        tmp.unlink(missing_ok=True)


def write_error_file_within(path: str | None, record: FailureRecord, wait_s: float) -> bool:
    """:func:`write_error_file` on a daemon thread, waited for ``wait_s`` at most; whether
    it wrote (or found a record there) in time. For a worker's handler, whose failure
    event is printed before and whose peers are told after: a write that raises (the
    directory gone or replaced, a full disk) is reported on stderr and swallowed, one that
    hangs (a hard-mounted NFS whose server is gone) is left to its thread, and neither
    keeps the handler from telling the others and exiting."""
    if path is None:
        return True
    done: list[bool] = []

    def write() -> None:
        try:
            write_error_file(path, record)
            done.append(True)
        except Exception as exc:  # (a thread's error would only be printed)
            print(f"error file {path} not written: {exc!r}", file=sys.stderr, flush=True)

    writer = threading.Thread(target=write, name="sailor-error-file", daemon=True)
    writer.start()
    writer.join(wait_s)
    return bool(done)


def fault_path(error_file: str | Path) -> Path:
    """Where a worker's ``faulthandler`` writes its Python stacks on a fatal signal: next to
    its error file (not into it: the error file holds one JSON record)."""
    return Path(f"{error_file}.fault")


def close_fault_file(error_file: str) -> None:
    """The end of a worker that did not fail: ``faulthandler`` off, and its file next to
    ``error_file`` deleted if nothing was written to it (an empty one left behind reads as
    a crash that said nothing). A no-op without an error file."""
    if not error_file:
        return
    faulthandler.disable()
    with contextlib.suppress(OSError):
        if fault_path(error_file).stat().st_size == 0:
            fault_path(error_file).unlink()


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def signal_failure_record(
    rank: int,
    returncode: int,
    step: int,
    fault_text: str = "",
    stderr_tail: str = "",
    pid: int | None = None,
) -> FailureRecord:
    """The record a parent writes for a worker that died by a signal (``returncode`` < 0,
    as ``subprocess`` reports it) or exited without writing its own.

    ``step`` is the last step the parent saw the rank report (-1: none). A ``SIGABRT`` under
    NCCL is most often the watchdog giving up on a collective (a dead or silent peer), but
    the parent cannot tell, so the origin is this rank (``local``) and the retry policy is
    the runtime's usual one. A ``SIGBUS`` is most often a memory-mapped file (the data set's
    ``.bin``) that shrank under the rank; the message says so, the policy is the same.
    """
    name = _signal_name(-returncode) if returncode < 0 else ""
    what = f"killed by {name}" if name else f"exited with status {returncode}"
    hint = ""
    if name == "SIGABRT":
        hint = " (under NCCL: the watchdog aborts a rank whose collective timed out)"
    elif name == "SIGBUS":  # a read past the end of a mapped file: the kernel's answer
        hint = (
            " (most often a memory-mapped file cut short under it: a data .bin truncated or "
            "rewritten in place; replace data files by writing a new file and renaming it "
            "over the old one, docs/data.md)"
        )
    return {
        "rank": rank,
        "step": step,
        "origin": "local",
        "retry": True,
        "error_type": "Signal" if name else "Exit",
        "signal": name,
        "returncode": returncode,
        "message": f"rank {rank} {what} after step {step} without an error record{hint}",
        "traceback": (fault_text or stderr_tail)[-8000:],
        "pid": pid,
        "time": time.time(),
        "written_by": "parent",
    }


_STATES = {
    "D": "uninterruptible sleep: in the kernel, most often the GPU driver's teardown",
    "R": "running",
    "S": "sleeping",
    "T": "stopped",
    "t": "stopped by a tracer",
}


def outlived_kill_record(
    processes: Sequence[tuple[int, int, str]], seconds: float, step: int = -1
) -> FailureRecord:
    """The record an agent writes when killed workers' processes ``(pid, rank, state)`` (the
    ``/proc/<pid>/stat`` state letter, '' if unreadable; the first is the one named) are
    still there ``seconds`` after SIGKILL. ``retry`` is False: their GPU stays taken, and a
    rank started on it runs out of memory or hangs, so retrying on this node does not help.
    """
    if not processes:
        raise ValueError("outlived_kill_record: processes is empty")
    pid, rank, state = processes[0]
    what = _STATES.get(state, "state unknown") if state else "state unreadable"
    others = f" and {len(processes) - 1} more process(es)" if len(processes) > 1 else ""
    return {
        "rank": rank,
        "step": step,
        "origin": "local",
        "retry": False,
        "error_type": "OutlivedKill",
        "message": (
            f"rank {rank}'s process {pid} (state {state or '?'}: {what}){others} outlived "
            f"SIGKILL for {seconds:.0f} s: its GPU is not free, no rank starts on this node"
        ),
        "traceback": "",
        "pid": pid,
        "state": state,
        "seconds": round(seconds, 1),
        "processes": [{"pid": p, "rank": r, "state": s} for p, r, s in processes],
        "time": time.time(),
        "written_by": "parent",
    }


def read_error_file(path: str | Path) -> FailureRecord | None:
    """The record in ``path``, or None if there is none (or it is not a JSON object)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError, RecursionError):  # nested past json's recursion limit
        return None
    return data if isinstance(data, dict) else None


# The record's own key, as JSON writes it: a quote inside a string value is escaped (\"),
# so this matches the key only, in a whole record and in one cut off alike.
_CULPRIT = re.compile(r'"culprit"\s*:\s*(-?\d{1,10})(?![\d.eE])')

MAX_RANK = 2**31 - 1
"""The largest global rank a record may name (torch.distributed's ranks are C ints)."""


def culprit_of(text: str) -> int:
    """The ``culprit`` rank a failure record's text (whole, or its first characters as the
    agent keeps them) names; -1 when it names none, or a value that is no rank (negative,
    not an integer, past :data:`MAX_RANK`): a record is what a worker wrote, and a bad one
    never stops its reader."""
    m = _CULPRIT.search(text) if text.lstrip().startswith("{") else None
    if m is None:
        return -1
    rank = int(m.group(1))
    return rank if 0 <= rank <= MAX_RANK else -1
