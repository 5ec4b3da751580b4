"""A worker dies with the agent that started it.

The agent starts each worker in a session of its own (so that it can signal the worker's
whole process group), so the kernel does not end the worker when the agent dies. Under the
shipped systemd unit (``KillMode=mixed``) the unit's cgroup is killed anyway; run any other
way, a worker outlived a ``kill -9`` of its agent, held its GPU, and (held in place) kept its
stage there while the restarted agent launched new ranks on it. The agent names itself in
``SAILOR_PARENT_PID``; the worker then asks the kernel for SIGKILL when its parent dies
(Linux ``prctl(PR_SET_PDEATHSIG)``) and exits at once if the parent is already gone.
Elsewhere, or without the variable (a worker run by hand, the tests' own launchers), nothing
changes.

:func:`death_signal_preexec` is the same request made by the parent, between fork and exec,
for children that cannot make it themselves (nats-server, etcd) or that the demo starts.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from collections.abc import Callable, Mapping

__all__ = ["PARENT_ENV", "death_signal_preexec", "die_with_parent"]

PARENT_ENV = "SAILOR_PARENT_PID"
_PR_SET_PDEATHSIG = 1


def die_with_parent(env: Mapping[str, str] = os.environ) -> bool:
    """Arrange to be killed with the parent ``env[PARENT_ENV]`` names; True if armed. A
    parent already gone ends this process (exit 1)."""
    want = env.get(PARENT_ENV, "")
    if not want.isdigit() or not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        return False
    if os.getppid() != int(want):  # it died before the request: no signal will come
        os._exit(1)
    return True


def death_signal_preexec() -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the child SIGKILLed when this process ends (it exits 1 if
    this process is already gone); None where that cannot be asked: not Linux, or not the
    main thread (the kernel signals when the *thread* that started the child ends)."""
    if not sys.platform.startswith("linux"):
        return None
    if threading.current_thread() is not threading.main_thread():
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the child only calls it
    parent = os.getpid()

    def arm() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:  # the parent ended before the request took
            os._exit(1)

    return arm
