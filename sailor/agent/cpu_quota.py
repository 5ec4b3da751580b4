"""Run a node's workers (or a profiling process) under a CPU quota: the cgroup I/O shell.

One machine stands in for nodes of different speed when each agent's workers share a quota
of its cores (``AgentConfig.cpu_quota``; ``docs/runtime.md``, "Node kinds and CPU quotas").
:class:`CpuQuota` is what an agent holds:

* at start it finds a writable cpu controller (:func:`detect`: cgroup v1's
  ``cpu.cfs_quota_us``, else cgroup v2's ``cpu.max``), creates the node's cgroup
  ``sailor/<job>/<node_id>`` under its own cgroup there and writes the quota;
* every worker joins that cgroup before it runs a single instruction of its own
  (:attr:`CpuQuota.exec_prefix`, ``cgroup_layout.JOIN_AND_EXEC``);
* :meth:`CpuQuota.set` changes the quota while workers run (a node that becomes slow);
* :meth:`CpuQuota.close` removes the cgroup once the workers are gone.

Where no writable cpu controller exists (no cgroup mount with it, a read-only
``/sys/fs/cgroup``, not root), the agent logs a warning that names every place looked at
and runs its workers unthrottled; its status and join event say ``cpu_quota: unavailable``.
A quota nobody can enforce is never reported as applied.

:func:`process_quota` puts the calling process itself under a quota for a block (``sailor
profile layers --cpu-quota``); it raises instead of running unthrottled, because a profile
recorded under a kind's name must have been measured at that kind's speed.

What to write and where is decided in :mod:`sailor.agent.cgroup_layout` (pure); this module
only reads and writes the files. Blocking calls (the agent runs them in a thread). Never
touches a cgroup it did not create, except :func:`node_cgroup`'s, which a test or a chaos
scenario names.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path, PurePosixPath
from typing import Literal

import structlog

from sailor.agent.cgroup_layout import (
    CFS_PERIOD_US,
    CandidateFacts,
    Hierarchy,
    cgroup_relpath,
    choose_hierarchy,
    cores_of,
    cpu_candidates,
    exec_prefix,
    parse_cpu_max,
    parse_cpu_stat,
    parse_mountinfo,
    parse_proc_cgroup,
    v1_quota_writes,
    v2_cpu_max,
    validate_cores,
)

__all__ = [
    "CpuQuota",
    "CpuQuotaUnavailableError",
    "NodeCgroup",
    "QuotaState",
    "detect",
    "node_cgroup",
    "process_quota",
]

_log = structlog.get_logger("sailor.agent")

QuotaState = float | Literal["unavailable"] | None
"""What an agent reports: the cores' worth applied, ``"unavailable"`` (asked for, but no
writable cpu controller: unthrottled), or None (no quota)."""

_PROC = Path("/proc")


class CpuQuotaUnavailableError(RuntimeError):
    """No writable cpu controller here (a configuration fact: retrying will not help)."""


def detect(proc: Path = _PROC) -> Hierarchy | str:
    """The hierarchy to create quota cgroups in, or why there is none (every place looked
    at, and what it lacked)."""
    try:
        mounts = parse_mountinfo((proc / "self" / "mountinfo").read_text())
        own = parse_proc_cgroup((proc / "self" / "cgroup").read_text())
    except OSError as exc:
        return f"no writable cpu controller (cannot read {proc}/self/mountinfo or cgroup: {exc})"
    candidates, missing = cpu_candidates(mounts, own)
    return choose_hierarchy([_facts(h) for h in candidates], missing)


def _facts(h: Hierarchy) -> CandidateFacts:
    base = Path(h.base)
    controllers: str | None = None
    with contextlib.suppress(OSError):
        controllers = (base / "cgroup.controllers").read_text()
    return CandidateFacts(
        hierarchy=h,
        quota_file=(base / "cpu.cfs_quota_us").is_file(),
        controllers=controllers,
        # access(2) also fails on a read-only mount (EROFS), the usual container case
        writable=base.is_dir() and os.access(base, os.W_OK),
    )


class NodeCgroup:
    """One cgroup with a cpu quota, created by this module (or found by name)."""

    def __init__(
        self, hierarchy: Hierarchy, rel: PurePosixPath, period_us: int | None = None
    ) -> None:
        self.hierarchy = hierarchy
        self.rel = rel
        self.path = Path(hierarchy.base) / rel
        self.period_us = period_us
        """The enforcement period quotas are written with; None: the one the kernel holds
        (a cgroup found by name keeps the period its agent chose)."""

    @classmethod
    def create(
        cls,
        hierarchy: Hierarchy,
        rel: PurePosixPath,
        cores: float | None,
        period_us: int = CFS_PERIOD_US,
    ) -> NodeCgroup:
        """Create ``rel`` under the hierarchy's base (reusing one a killed agent left) with
        a quota of ``cores`` (None: no limit) per period of ``period_us``."""
        for attempt in range(3):
            try:
                _make(hierarchy, rel)
                break
            except FileNotFoundError:
                # another agent of the job removed an empty parent between our mkdirs
                if attempt == 2:
                    raise
        cg = cls(hierarchy, rel, period_us)
        cg.set_quota(cores)
        return cg

    @property
    def procs_file(self) -> Path:
        return self.path / "cgroup.procs"

    def set_quota(self, cores: float | None) -> None:
        """Write the quota (None: no limit); takes effect at once for the processes inside."""
        period = self.period_us if self.period_us is not None else self.period()
        if cores is not None:
            validate_cores(cores, period)
        if self.hierarchy.version == 1:
            for name, value in v1_quota_writes(cores, period):
                (self.path / name).write_text(value)
        else:
            (self.path / "cpu.max").write_text(v2_cpu_max(cores, period))

    def period(self) -> int:
        """The enforcement period the kernel holds, us (the default where none is readable)."""
        try:
            if self.hierarchy.version == 1:
                return int((self.path / "cpu.cfs_period_us").read_text())
            parts = (self.path / "cpu.max").read_text().split()
            return int(parts[1]) if len(parts) > 1 else CFS_PERIOD_US
        except (OSError, ValueError):
            return CFS_PERIOD_US

    def quota(self) -> float | None:
        """The quota the kernel holds, cores' worth (None: no limit)."""
        if self.hierarchy.version == 1:
            q = int((self.path / "cpu.cfs_quota_us").read_text())
            return cores_of(q, int((self.path / "cpu.cfs_period_us").read_text()))
        return parse_cpu_max((self.path / "cpu.max").read_text())

    def add(self, pid: int) -> None:
        """Move process ``pid`` (all its threads) into this cgroup."""
        self.procs_file.write_text(str(pid))

    def pids(self) -> list[int]:
        """Processes inside."""
        return [int(x) for x in self.procs_file.read_text().split()]

    def stat(self) -> dict[str, int]:
        """``cpu.stat``: periods, throttled periods and time (v2: usage too)."""
        return parse_cpu_stat((self.path / "cpu.stat").read_text())

    def remove(self, timeout_s: float = 2.0) -> bool:
        """Remove this cgroup once it is empty (waiting up to ``timeout_s`` for exiting
        processes to leave), then the job's and sailor's directories if nothing else uses
        them. False (and a warning naming the processes) when it stayed busy."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.path.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError as exc:
                if exc.errno != errno.EBUSY or time.monotonic() >= deadline:
                    left: list[int] = []
                    with contextlib.suppress(OSError):
                        left = self.pids()
                    _log.warning(
                        "cpu_quota_cgroup_left", path=str(self.path), pids=left, error=str(exc)
                    )
                    return False
                time.sleep(0.05)
        parent = self.path.parent
        for _ in self.rel.parts[:-1]:  # sailor/<job>, then sailor: only when empty
            try:
                parent.rmdir()
            except OSError:
                break
            parent = parent.parent
        return True


def _make(h: Hierarchy, rel: PurePosixPath) -> None:
    d = Path(h.base)
    for part in rel.parts:
        if h.version == 2:
            _enable_cpu_below(d)
        d = d / part
        with contextlib.suppress(FileExistsError):
            d.mkdir()


def _enable_cpu_below(d: Path) -> None:
    """v2: children of ``d`` get the cpu controller only if ``d`` hands it down. This fails
    (EBUSY) where ``d`` is a non-root cgroup holding processes (v2's no-internal-processes
    rule): run the agent in a cgroup delegated to it (systemd ``Delegate=yes``)."""
    control = d / "cgroup.subtree_control"
    if "cpu" not in control.read_text().split():
        try:
            control.write_text("+cpu")
        except OSError as exc:
            raise OSError(
                exc.errno, f"cannot enable the cpu controller below {d} ({exc.strerror})"
            ) from exc


def node_cgroup(job: str, node_id: str, proc: Path = _PROC) -> NodeCgroup:
    """The existing cgroup of a node that an agent created (a test or a chaos scenario
    changes its quota from outside the agent: the agent's status reads the quota back)."""
    where = detect(proc)
    if isinstance(where, str):
        raise CpuQuotaUnavailableError(where)
    cg = NodeCgroup(where, cgroup_relpath(job, node_id))
    if not cg.path.is_dir():
        raise LookupError(f"node {node_id!r} of job {job!r} has no cgroup at {cg.path}")
    return cg


class CpuQuota:
    """The quota of one node's workers: applied in the node's cgroup, or unavailable."""

    def __init__(
        self, cgroup: NodeCgroup | None, requested: float | None, reason: str = ""
    ) -> None:
        self.cgroup = cgroup
        self.requested = requested
        self.reason = reason
        """Why the quota is unavailable ('' when it is applied)."""
        self._suspended: float | None = None
        """The quota :meth:`suspend` lifted, until :meth:`resume`."""

    @classmethod
    def start(
        cls,
        job: str,
        node_id: str,
        cores: float | None,
        proc: Path = _PROC,
        period_us: int = CFS_PERIOD_US,
    ) -> CpuQuota:
        """Create the node's cgroup with ``cores`` (None: none yet, no limit) per period of
        ``period_us``. Where that is impossible, warn and return an unavailable quota (the
        workers run unthrottled)."""
        if cores is not None:
            validate_cores(cores, period_us)
        rel = cgroup_relpath(job, node_id)
        where = detect(proc)
        if isinstance(where, str):
            return cls._unavailable(node_id, cores, where)
        try:
            cg = NodeCgroup.create(where, rel, cores, period_us)
        except OSError as exc:
            return cls._unavailable(node_id, cores, f"{where.describe()}: creating {rel}: {exc}")
        _log.info("cpu_quota", node=node_id, cores=cores, period_us=period_us, cgroup=str(cg.path))
        return cls(cg, cores)

    @classmethod
    def _unavailable(cls, node_id: str, cores: float | None, why: str) -> CpuQuota:
        _log.warning(
            "cpu_quota_unavailable",
            node=node_id,
            requested_cores=cores,
            why=why,
            consequence="workers run unthrottled; status says cpu_quota: unavailable",
        )
        return cls(None, cores, why)

    @property
    def available(self) -> bool:
        return self.cgroup is not None

    @property
    def exec_prefix(self) -> tuple[str, ...]:
        """What to put before a worker's argv so that it starts inside the cgroup."""
        return () if self.cgroup is None else exec_prefix(PurePosixPath(self.cgroup.procs_file))

    def state(self) -> QuotaState:
        """The quota as the kernel holds it (an outside change shows), else as last set."""
        if self.cgroup is None:
            return "unavailable"
        try:
            return self.cgroup.quota()
        except (OSError, ValueError):
            return self.requested

    def set(self, cores: float | None) -> None:
        """Change the quota now (None: lift it). Unavailable: warn, stay unthrottled."""
        if cores is not None:
            period = self.cgroup.period_us if self.cgroup is not None else None
            validate_cores(cores, period or CFS_PERIOD_US)
        self.requested = cores
        if self.cgroup is None:
            _log.warning("cpu_quota_unavailable", requested_cores=cores, why=self.reason)
            return
        self.cgroup.set_quota(cores)
        _log.info("cpu_quota_set", cores=cores, cgroup=str(self.cgroup.path))

    def suspend(self) -> None:
        """Lift the quota for a while (an in-place relayout of workers under
        ``cpu_quota_from='ready'``: like a start, it is not training), keeping what the kernel
        held; :meth:`resume` puts it back. A change from outside in between is overwritten."""
        if self.cgroup is None or self._suspended is not None:
            return
        held = self.state()
        if isinstance(held, float):
            self._suspended = held
            self.cgroup.set_quota(None)

    def resume(self) -> None:
        """Put back the quota :meth:`suspend` lifted (nothing if none was)."""
        if self.cgroup is not None and self._suspended is not None:
            held, self._suspended = self._suspended, None
            self.cgroup.set_quota(held)

    def adopt(self, pids: Iterable[int]) -> None:
        """Move running processes in (workers started before the node had a cgroup)."""
        if self.cgroup is None:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                self.cgroup.add(pid)

    def close(self) -> bool:
        """Remove the cgroup (call once its processes are gone)."""
        return True if self.cgroup is None else self.cgroup.remove()


@contextlib.contextmanager
def process_quota(cores: float, name: str, proc: Path = _PROC) -> Iterator[NodeCgroup]:
    """This process, its threads and the children it starts, under ``cores`` for the block
    (the nodes' period); then back in its own cgroup, and the quota's cgroup removed. Raises
    :class:`CpuQuotaUnavailableError` where no writable cpu controller exists."""
    validate_cores(cores)
    where = detect(proc)
    if isinstance(where, str):
        raise CpuQuotaUnavailableError(where)
    pid = os.getpid()
    cg = NodeCgroup.create(where, cgroup_relpath("_profile", f"{name}-{pid}"), cores)
    home = Path(where.base) / "cgroup.procs"
    try:
        cg.add(pid)
        yield cg
    finally:
        home.write_text(str(pid))
        cg.remove()
