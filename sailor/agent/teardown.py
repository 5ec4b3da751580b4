"""Whether killed workers are gone: the teardown verdict (pure) and the process-group probe.

A worker runs in a session of its own (``start_new_session``: its process group id is its
pid), with whatever it started in that group (data loader workers, compile subprocesses). It
is gone when every process of its group is. SIGKILL does not make that immediate: a rank
in the GPU driver's teardown (after an NCCL hang or an XID error) sleeps uninterruptibly
(state ``D``) for tens of seconds and holds its GPU memory and CUDA context meanwhile. The
supervisor (``supervisor.Supervisor._kill``) probes, asks :func:`teardown_verdict` and
starts no rank until the verdict is :attr:`Teardown.GONE`.

This module never signals nor waits: the supervisor does both.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Collection, Mapping
from pathlib import Path

__all__ = ["GONE_STATES", "Teardown", "group_members", "teardown_verdict"]

GONE_STATES = frozenset("ZXx")
"""``/proc/<pid>/stat`` states of a process that holds nothing any more: a zombie (``Z``)
has released its memory and files, the GPU device files among them, before it became one
(the kernel's ``do_exit`` runs ``exit_mm`` and ``exit_files`` first), and ``X``/``x`` are
dead. A zombie member of a worker's group is not ours to reap: its parent was the worker, so
it was reparented to init or a subreaper, which may take its time (measured on the
development VM, Linux 6.18: an orphan stayed a zombie ~1 s before its init reaped it);
waiting for that would only delay the next launch."""


class Teardown(enum.Enum):
    """What the supervisor does about killed workers' processes, at one probe."""

    GONE = "gone"
    """None is left (or only zombies): ranks may start."""
    WAIT = "wait"
    """Some are still there, the bound not yet passed: probe again."""
    STUCK = "stuck"
    """Some are still there past the bound: report them, start nothing on top of them."""


def teardown_verdict(states: Mapping[int, str], elapsed_s: float, bound_s: float) -> Teardown:
    """The verdict on killed workers' processes still found, ``{pid: state letter}`` ('' when
    unreadable: counted as there), ``elapsed_s`` after the signal, against ``bound_s``."""
    if all(s in GONE_STATES for s in states.values()):
        return Teardown.GONE
    return Teardown.STUCK if elapsed_s >= bound_s else Teardown.WAIT


def group_members(pgids: Collection[int]) -> dict[int, dict[int, str]]:
    """Of the process groups ``pgids``, those with a member left: ``{pgid: {pid: state}}``.

    ``os.killpg(pgid, 0)`` first (ProcessLookupError: the group is empty; a zombie still
    counts as a member until it is reaped); only for a group that answers is ``/proc``
    scanned for its members and their state letters (one read of ``/proc/<pid>/stat`` per
    process of the host, ~2 ms for 70: the supervisor runs this in a thread). A group that
    answers but whose members the scan cannot see (no ``/proc``, or a member that ended
    meanwhile) is reported as its leader in state ''.
    """
    found: dict[int, dict[int, str]] = {}
    for pgid in pgids:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            continue
        except PermissionError:  # a member we may not signal: it is there all the same
            pass
        found[pgid] = {}
    if not found:
        return found
    for pid, state, pgrp in _proc_stats():
        if pgrp in found:
            found[pgrp][pid] = state
    for pgid, members in found.items():
        if not members:
            members[pgid] = ""
    return found


def _proc_stats() -> list[tuple[int, str, int]]:
    """``(pid, state, pgrp)`` of every process ``/proc`` shows (none without ``/proc``)."""
    out: list[tuple[int, str, int]] = []
    try:
        entries = [e.name for e in os.scandir("/proc") if e.name.isdigit()]
    except OSError:
        return out
    for name in entries:
        try:
            text = Path(f"/proc/{name}/stat").read_text()
        except OSError:  # it ended meanwhile
            continue
        # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses
        fields = text.rsplit(")", 1)[-1].split()
        if len(fields) >= 3 and fields[2].lstrip("-").isdigit():
            out.append((int(name), fields[0], int(fields[2])))
    return out
