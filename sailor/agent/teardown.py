"""Whether killed workers are gone: the teardown verdict (pure) and the process-group probe.

A worker runs in a session of its own (``start_new_session``: its process group id is its
pid), with whatever it started in that group (data loader workers, compile subprocesses). It
is gone when every process of its group is. SIGKILL does not make that immediate: a rank
in the GPU driver's teardown (after an NCCL hang or an XID error) sleeps uninterruptibly
(state ``D``) for tens of seconds and holds its GPU memory and CUDA context meanwhile. The
supervisor's :class:`~sailor.agent.killed_groups.KilledGroups` probes, asks
:func:`teardown_verdict` and lets no rank start until the verdict is :attr:`Teardown.GONE`.

A process is its threads: ``/proc/<pid>/stat`` shows the thread-group leader's state, which
reads ``Z`` once the main thread has ended, though another thread (one in the driver, say)
still runs and the process still holds its memory and files. The probe reads every
thread's state (``/proc/<pid>/task/*/stat``) before it calls such a process a zombie.

A process group's id can be another session's once all of ours are gone (a new process
gets the pid, then calls ``setsid``). A group probed long after its SIGKILL (a restarted
agent's, or one probed every few seconds for minutes) is therefore probed with the time of
that SIGKILL (``born_by``, in :func:`boot_ticks`): a member started later is not ours.

This module never signals (but ``killpg(pgid, 0)``, which asks) nor waits:
:mod:`killed_groups` does both.
"""

from __future__ import annotations

import enum
import os
import time
from collections.abc import Collection, Mapping
from pathlib import Path

__all__ = [
    "GONE_STATES",
    "Teardown",
    "boot_id",
    "boot_ticks",
    "group_members",
    "start_ticks",
    "teardown_verdict",
]

GONE_STATES = frozenset("ZXx")
"""States of a process that holds nothing any more, as :func:`group_members` reports them
(a ``Z`` from ``/proc/<pid>/stat`` is one only if every thread of it reads ``Z`` or ``X``:
see the module docstring). A zombie (``Z``) has released its memory and files, the GPU
device files among them, before it became one (the kernel's ``do_exit`` runs ``exit_mm``
and ``exit_files`` first), and ``X``/``x`` are dead. A zombie member of a worker's group is
not ours to reap: its parent was the worker, so it was reparented to init or a subreaper,
which may take its time (measured on the development VM, Linux 6.18: an orphan stayed a
zombie ~1 s before its init reaped it); waiting for that would only delay the next launch.
A worker itself (the group leader, our child) is another matter: it counts as there until
the supervisor has reaped it (:mod:`killed_groups`)."""


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


def boot_ticks() -> int:
    """Now, in the unit of a process's start time in ``/proc/<pid>/stat`` (field 22: clock
    ticks since boot, counted on ``CLOCK_BOOTTIME``)."""
    return int(time.clock_gettime(time.CLOCK_BOOTTIME) * os.sysconf("SC_CLK_TCK"))


def start_ticks(pid: int | str = "self") -> int | None:
    """When process ``pid`` started, in :func:`boot_ticks`' unit (field 22 of its ``stat``);
    None if ``/proc`` has no answer (it ended, or there is no ``/proc``)."""
    fields = _stat_fields(f"/proc/{pid}/stat")
    return int(fields[19]) if len(fields) >= 20 and fields[19].isdigit() else None


def boot_id() -> str:
    """This boot's id ('' if unknown): a group recorded in another boot is gone with it."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def group_members(
    pgids: Collection[int], born_by: Mapping[int, int] | None = None
) -> dict[int, dict[int, str]]:
    """Of the process groups ``pgids``, those with a member left: ``{pgid: {pid: state}}``.

    ``os.killpg(pgid, 0)`` first (ProcessLookupError: the group is empty; a zombie still
    counts as a member until it is reaped); only for a group that answers is ``/proc``
    scanned for its members and their state letters (one read of ``/proc/<pid>/stat`` per
    process of the host, ~2 ms for 70, and of its threads' for one that reads ``Z``: the
    supervisor runs this in a thread). A member started after ``born_by[pgid]``
    (:func:`boot_ticks`) is left out, and a group with no member left then is another
    session's that got the id: it is left out too. A group that answers but whose members
    the scan cannot see at all (no ``/proc``, or a member that ended meanwhile) is reported
    as its leader in state ''.
    """
    born_by = born_by or {}
    found: dict[int, dict[int, str]] = {}
    for pgid in pgids:
        if pgid <= 1:  # 0 would probe our own group, 1 init's: no worker's group
            continue
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            continue
        except PermissionError:  # a member we may not signal: it is there all the same
            pass
        except OSError:  # an id no group can have (EINVAL): none of ours
            continue
        found[pgid] = {}
    if not found:
        return found
    seen: set[int] = set()
    for pid, state, pgrp, start in _proc_stats():
        if pgrp in found:
            seen.add(pgrp)
            if start <= born_by.get(pgrp, start):
                found[pgrp][pid] = state
    for pgid in list(found):
        if found[pgid]:
            continue
        if pgid in seen:  # only members started after ours were killed: not our group
            del found[pgid]
        else:
            found[pgid][pgid] = ""
    return found


def _proc_stats() -> list[tuple[int, str, int, int]]:
    """``(pid, state, pgrp, start ticks)`` of every process ``/proc`` shows (none without
    ``/proc``). A process whose leader thread reads ``Z`` while another thread of it runs on
    gets that thread's state (``D`` first): it is not gone."""
    out: list[tuple[int, str, int, int]] = []
    try:
        entries = [e.name for e in os.scandir("/proc") if e.name.isdigit()]
    except OSError:
        return out
    for name in entries:
        fields = _stat_fields(f"/proc/{name}/stat")
        # fields from the state on: state ppid pgrp ... starttime (field 22, here 19)
        if len(fields) < 20 or not fields[2].lstrip("-").isdigit() or not fields[19].isdigit():
            continue
        state = fields[0]
        if state == "Z":
            state = _live_thread_state(name) or state
        out.append((int(name), state, int(fields[2]), int(fields[19])))
    return out


def _stat_fields(path: str) -> list[str]:
    """The fields of a ``stat`` file after ``comm`` ([] if it cannot be read: ended)."""
    try:
        text = Path(path).read_text()
    except OSError:
        return []
    # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses
    return text.rsplit(")", 1)[-1].split()


def _live_thread_state(pid: str) -> str:
    """The state of a thread of process ``pid`` that has not exited ('' if none has not):
    ``D`` if one is in it, else the first found."""
    try:
        tids = [e.name for e in os.scandir(f"/proc/{pid}/task")]
    except OSError:
        return ""
    live = [s for t in tids for s in _stat_fields(f"/proc/{pid}/task/{t}/stat")[:1]]
    live = [s for s in live if s not in GONE_STATES]
    return "D" if "D" in live else (live[0] if live else "")
