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
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Mapping

__all__ = ["PARENT_ENV", "die_with_parent"]

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
