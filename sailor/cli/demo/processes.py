"""Every process the demo starts, and how to find and end them all again.

Each child runs in a session of its own (so a Ctrl-C at the terminal reaches only the demo,
which then tears down in order) and carries the demo's marker in its environment. The
agents start their workers in sessions of their own too, so killing an agent's process group
does not reach its workers; and a worker orphaned by a SIGKILLed agent is reparented to
init. The marker is how the demo still finds every one of them: :func:`marked_pids` scans
``/proc/*/environ`` (Linux; no psutil), and :meth:`ProcessRegistry.kill_all` ends whatever
carries it. Must never signal a process that does not carry this run's marker.

A child also dies with the demo itself (Linux ``prctl(PR_SET_PDEATHSIG)``, armed between fork
and exec): a demo or test run killed outright (``kill -9``, an interrupted pytest) left its
servers, controllers and agents running, and the agents' workers with them, until something
found the marker. The kernel sends the signal when the thread that started the child ends, so
it is armed only for children started from the main thread.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from sailor.megatron_patch.parent_death import death_signal_preexec

__all__ = ["MARKER_ENV", "ProcessRegistry", "children_of", "marked_pids"]

MARKER_ENV = "SAILOR_DEMO_RUN"
"""Environment variable every process of one demo run inherits, holding the run's token."""


def marked_pids(token: str, env_var: str = MARKER_ENV) -> list[int]:
    """Live (non-zombie) processes whose environment holds ``env_var=token``, this one aside."""
    needle = f"{env_var}={token}".encode()
    out: list[int] = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            env = (d / "environ").read_bytes()
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and needle in env.split(b"\0"):
            out.append(int(d.name))
    return sorted(out)


def children_of(pid: int) -> list[int]:
    """Direct children of ``pid`` (from ``/proc/*/stat``)."""
    out: list[int] = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(d.name))
    return out


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


@dataclass
class ProcessRegistry:
    """The demo's children by name, each in its own session, all carrying one marker."""

    log_dir: Path
    token: str = field(default_factory=lambda: uuid.uuid4().hex)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        return {**os.environ, MARKER_ENV: self.token, **(extra or {})}

    def start(self, name: str, argv: Sequence[str]) -> subprocess.Popen[bytes]:
        """Start ``argv`` as ``name`` with its output in ``log_dir/name.log``."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with (self.log_dir / f"{name}.log").open("ab") as fh:
            proc = subprocess.Popen(
                list(argv),
                stdout=fh,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env(),
                start_new_session=True,
                preexec_fn=death_signal_preexec(),  # one prctl call between fork and exec
            )
        self.procs[name] = proc
        return proc

    def kill_node(self, name: str) -> list[int]:
        """SIGKILL process ``name`` and its children's process groups at once (a lost node)."""
        proc = self.procs[name]
        victims = [proc.pid, *children_of(proc.pid)]
        for pid in victims:
            _signal_group(pid, signal.SIGKILL)
        proc.wait(timeout=10)
        return victims

    def stop(self, names: Sequence[str], grace_s: float) -> None:
        """SIGTERM the named processes' groups, wait up to ``grace_s``, then SIGKILL."""
        live = [self.procs[n] for n in names if n in self.procs and self.procs[n].poll() is None]
        for p in live:
            _signal_group(p.pid, signal.SIGTERM)
        end = time.monotonic() + grace_s
        for p in live:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.0, end - time.monotonic()))
            if p.poll() is None:
                _signal_group(p.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=5)

    def kill_all(self, timeout_s: float = 5.0) -> list[int]:
        """SIGKILL every process that carries the marker (workers included); return leftovers."""
        end = time.monotonic() + timeout_s
        left = marked_pids(self.token)
        while left and time.monotonic() < end:
            for pid in left:
                _signal_group(pid, signal.SIGKILL)
            for p in self.procs.values():
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=0.05)
            time.sleep(0.05)
            left = marked_pids(self.token)
        return left
