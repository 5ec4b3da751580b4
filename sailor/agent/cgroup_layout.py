"""Where a node's CPU quota lives and what is written there (pure).

An agent may run its workers under a CPU quota (``AgentConfig.cpu_quota``, cores' worth for
all of the node's workers together), so that one machine hosts nodes of different speed
(``docs/runtime.md``, "Node kinds and CPU quotas"). The Linux cgroup cpu controller enforces
it, through one of two interfaces:

* **cgroup v1**: a hierarchy mounted with the ``cpu`` controller (``/sys/fs/cgroup/cpu`` on
  most hosts); a cgroup's ``cpu.cfs_quota_us`` microseconds of CPU time per
  ``cpu.cfs_period_us`` period, ``-1`` for no limit.
* **cgroup v2**: the unified hierarchy, where ``cpu`` must be listed in a cgroup's
  ``cgroup.controllers`` (and enabled in its parent's ``cgroup.subtree_control``); one file,
  ``cpu.max``, holds ``"<quota> <period>"`` or ``"max <period>"``.

The controller can be bound to only one of them at a time; v1 is looked at first. Each
node's cgroup is ``sailor/<job>/<node_id>`` under the agent's own cgroup of that hierarchy.

This module parses what the kernel says (``/proc/self/mountinfo``, ``/proc/self/cgroup``,
``cpu.stat``, the quota files), decides which hierarchy to use from facts the I/O shell
gathered (:func:`choose_hierarchy`), and computes what to write. It never touches a file;
:mod:`sailor.agent.cpu_quota` does.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Literal

__all__ = [
    "CFS_PERIOD_US",
    "JOIN_AND_EXEC",
    "MIN_QUOTA_US",
    "CandidateFacts",
    "Hierarchy",
    "Mount",
    "cgroup_relpath",
    "choose_hierarchy",
    "cores_of",
    "cpu_candidates",
    "exec_prefix",
    "parse_cpu_max",
    "parse_cpu_stat",
    "parse_mountinfo",
    "parse_proc_cgroup",
    "quota_us",
    "v1_quota_writes",
    "v2_cpu_max",
    "validate_cores",
]

CFS_PERIOD_US = 100_000
"""The enforcement period, 100 ms: the kernel's default ``cpu.cfs_period_us`` and ``cpu.max``
period (Documentation/scheduler/sched-bwc.rst). A worker whose work between two waits is
shorter than a period runs at full speed until the quota is used up, then stalls to the end
of the period; only over several periods does it average ``cores`` (so a profile taken under
a quota times spans of many periods, ``sailor profile layers --cpu-quota``). A shorter period
was tried for profiles and rejected: at 10 ms tiny-gpt's layers took 3.0-3.6x their
unthrottled time under 0.4 cores instead of 2.5x at 100 ms (the frequent preemptions on this
shared host cost CPU time of their own), and the nodes run at 100 ms."""

MIN_QUOTA_US = 1_000
"""The kernel refuses a quota (or a period) below 1 ms (sched-bwc.rst): 0.01 cores at 100 ms."""


# -- what the kernel says ----------------------------------------------------------------


@dataclass(frozen=True)
class Mount:
    """One line of ``/proc/self/mountinfo`` (the fields used here)."""

    mount_point: str
    root: str
    """The directory of the mounted filesystem that appears at ``mount_point`` (``/``
    unless a container sees only its part of the hierarchy)."""
    fstype: str
    super_options: tuple[str, ...]
    """For a v1 cgroup mount, its controllers among the options (``rw,cpu,cpuacct``)."""


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash in paths as octal escapes."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str) -> list[Mount]:
    """The mounts of ``/proc/self/mountinfo`` (proc(5)); malformed lines are skipped."""
    out: list[Mount] = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        a, b = left.split(), right.split()
        if len(a) < 5 or len(b) < 3:
            continue
        out.append(
            Mount(
                mount_point=_unescape(a[4]),
                root=_unescape(a[3]),
                fstype=b[0],
                super_options=tuple(b[2].split(",")),
            )
        )
    return out


def parse_proc_cgroup(text: str) -> dict[str, str]:
    """``/proc/self/cgroup`` as controller -> this process's cgroup path; ``""`` is the v2
    (unified) hierarchy's entry (``0::/path``), named v1 hierarchies (``name=systemd``)
    keep their name."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if not controllers:
            out[""] = path
            continue
        for c in controllers.split(","):
            out[c] = path
    return out


def parse_cpu_stat(text: str) -> dict[str, int]:
    """``cpu.stat`` as name -> value (v1: ``nr_periods nr_throttled throttled_time``; v2
    also ``usage_usec``, ``throttled_usec``)."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].lstrip("-").isdigit():
            out[parts[0]] = int(parts[1])
    return out


# -- which hierarchy ---------------------------------------------------------------------


@dataclass(frozen=True)
class Hierarchy:
    """A cgroup hierarchy with a cpu controller this process may use."""

    version: Literal[1, 2]
    base: PurePosixPath
    """This process's own cgroup directory in it: node cgroups are created below."""

    def describe(self) -> str:
        files = "cpu.cfs_quota_us" if self.version == 1 else "cpu.max"
        return f"cgroup v{self.version} at {self.base} ({files})"


@dataclass(frozen=True)
class CandidateFacts:
    """What the I/O shell found about one place a cpu controller could be."""

    hierarchy: Hierarchy
    quota_file: bool
    """v1: ``cpu.cfs_quota_us`` exists in ``base``. v2: unused (``controllers`` decides)."""
    controllers: str | None
    """v2: ``base/cgroup.controllers`` as read (None: unreadable). v1: unused."""
    writable: bool
    """``base`` is a directory this process may create cgroups in."""


def _under(mount: Mount, path: str) -> PurePosixPath:
    """The directory of cgroup ``path`` (as /proc/self/cgroup names it) in ``mount``."""
    root = mount.root.rstrip("/")
    inside = not root or path == root or path.startswith(root + "/")
    rel = path[len(root) :] if inside else ""  # outside what is mounted here: its root
    return PurePosixPath(mount.mount_point) / rel.lstrip("/")


def cpu_candidates(mounts: list[Mount], own: dict[str, str]) -> tuple[list[Hierarchy], list[str]]:
    """The places to look for a usable cpu controller, v1 first, and what was not found
    (each a phrase for the warning that names everything looked for)."""
    out: list[Hierarchy] = []
    missing: list[str] = []
    v1 = [m for m in mounts if m.fstype == "cgroup" and "cpu" in m.super_options]
    if v1:
        out.append(Hierarchy(1, _under(v1[0], own.get("cpu", "/"))))
    else:
        missing.append("cgroup v1: no hierarchy mounted with the cpu controller")
    v2 = [m for m in mounts if m.fstype == "cgroup2"]
    if v2:
        out.append(Hierarchy(2, _under(v2[0], own.get("", "/"))))
    else:
        missing.append("cgroup v2: no cgroup2 mount")
    return out, missing


def choose_hierarchy(facts: list[CandidateFacts], missing: list[str]) -> Hierarchy | str:
    """The first usable hierarchy, or why none is (every place looked at and what it lacked)."""
    why = list(missing)
    for f in facts:
        h, listed = f.hierarchy, (f.controllers or "").split()
        if h.version == 1 and not f.quota_file:
            why.append(f"cgroup v1 at {h.base}: no cpu.cfs_quota_us")
        elif h.version == 2 and f.controllers is None:
            why.append(f"cgroup v2 at {h.base}: cgroup.controllers unreadable")
        elif h.version == 2 and "cpu" not in listed:
            what = " ".join(listed) or "nothing"
            why.append(f"cgroup v2 at {h.base}: cgroup.controllers lists {what}, not cpu")
        elif not f.writable:
            why.append(f"cgroup v{h.version} at {h.base}: not writable by this user")
        else:
            return h
    return "no writable cpu controller (" + "; ".join(why) + ")"


# -- what to write -------------------------------------------------------------------------


def validate_cores(cores: float, period_us: int = CFS_PERIOD_US) -> float:
    """``cores`` if it is a quota the kernel can enforce at a period of ``period_us``."""
    if not math.isfinite(cores) or cores <= 0:
        raise ValueError(f"cpu_quota={cores!r}: must be a number of cores > 0 (e.g. 0.4)")
    if cores * period_us < MIN_QUOTA_US:
        raise ValueError(
            f"cpu_quota={cores!r}: below the kernel's minimum quota of {MIN_QUOTA_US} us per "
            f"{period_us} us period ({MIN_QUOTA_US / period_us:g} cores)"
        )
    return cores


def quota_us(cores: float, period_us: int = CFS_PERIOD_US) -> int:
    """Microseconds of CPU time per period for ``cores`` cores' worth."""
    return max(MIN_QUOTA_US, round(validate_cores(cores, period_us) * period_us))


def cores_of(quota: int, period_us: int) -> float | None:
    """The cores' worth of a quota (None: unlimited, a negative quota)."""
    if quota < 0 or period_us <= 0:
        return None
    return quota / period_us


def v1_quota_writes(cores: float | None, period_us: int = CFS_PERIOD_US) -> list[tuple[str, str]]:
    """(file, value) pairs to write, in order, for ``cores`` on v1 (None: no limit)."""
    if cores is None:
        return [("cpu.cfs_quota_us", "-1")]
    return [
        ("cpu.cfs_period_us", str(period_us)),
        ("cpu.cfs_quota_us", str(quota_us(cores, period_us))),
    ]


def v2_cpu_max(cores: float | None, period_us: int = CFS_PERIOD_US) -> str:
    """The ``cpu.max`` line for ``cores`` (None: no limit)."""
    return f"{'max' if cores is None else quota_us(cores, period_us)} {period_us}"


def parse_cpu_max(text: str) -> float | None:
    """Cores' worth of a ``cpu.max`` line (None: ``max``, no limit)."""
    parts = text.split()
    if not parts or parts[0] == "max":
        return None
    period = int(parts[1]) if len(parts) > 1 else CFS_PERIOD_US
    return cores_of(int(parts[0]), period)


_SAFE = re.compile(r"[^A-Za-z0-9_.-]")


def cgroup_relpath(job: str, node_id: str) -> PurePosixPath:
    """``sailor/<job>/<node_id>``, each part reduced to characters safe in a directory name
    (anything else becomes ``_``; ``.`` and ``..`` are refused)."""
    parts = []
    for what, name in (("job", job), ("node_id", node_id)):
        safe = _SAFE.sub("_", name)
        if not safe or safe in (".", ".."):
            raise ValueError(f"{what}={name!r}: not usable as a cgroup name")
        parts.append(safe)
    return PurePosixPath("sailor", *parts)


JOIN_AND_EXEC = (
    'echo $$ > "$0" || { echo "sailor: cannot join the cgroup of $0" >&2; exit 125; }; exec "$@"'
)
"""A POSIX shell writes its own pid into the cgroup's ``cgroup.procs`` (``$0``), then
``exec``s the worker: the worker keeps the shell's pid and starts inside the cgroup, so none
of its instructions run unthrottled. Why not the alternatives: a ``preexec_fn`` is unsafe in
a process with threads (the agent has them: ``asyncio.to_thread``, the etcd client) and
disables ``vfork``; moving the pid after the spawn leaves the interpreter's start-up, which is
most of a short worker's CPU, outside the quota."""


def exec_prefix(procs_file: PurePosixPath) -> tuple[str, ...]:
    """The argv prefix that runs a command inside the cgroup of ``procs_file``."""
    return ("/bin/sh", "-c", JOIN_AND_EXEC, str(procs_file))
