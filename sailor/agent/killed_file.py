"""The killed workers' process groups an agent keeps on disk (``killed.json``) for the next one.

:class:`~sailor.agent.killed_groups.KilledGroups` signals a worker's process group (SIGTERM,
SIGKILL after the grace period) and waits until it is gone; an agent restarted meanwhile
(a crash, an upgrade, systemd's watchdog) must not start a rank on a GPU such a group still
holds, nor forget to SIGKILL one whose kill was cut short before it. So every group from its
SIGTERM until it is found gone is an entry of :data:`KILLED_FILE` in the run directory:
:func:`save_killed` writes them, :func:`load_killed` reads them back. A group recorded in
another boot is gone with it (``teardown.boot_id``).

This module never signals, probes nor decides what a group read back is: ``killed_groups``
does.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from sailor.agent.teardown import boot_id
from sailor.schemas.json_text import load_json

__all__ = ["KILLED_FILE", "KilledGroup", "load_killed", "save_killed"]

_log = structlog.get_logger("sailor.agent")

KILLED_FILE = "killed.json"
"""In the run directory: the process groups signalled (SIGTERM, then SIGKILL) and not yet
found gone, for a restarted agent (``KilledGroups.restore``)."""


@dataclass
class KilledGroup:
    """A killed worker's process group, signalled and not yet found gone."""

    pgid: int
    rank: int
    step: int
    born_by: int
    """Its members had started by then (the last signal, in ``teardown.boot_ticks``): one
    started later is another session's that got the id once ours had gone."""
    killed_at: float
    """Wall-clock time of the SIGKILL (of the SIGTERM until then): a restarted agent's
    bound and record count from it."""
    sigkilled: bool = True
    """SIGKILL was sent (False: SIGTERM only, so far; a restarted agent sends it)."""
    proc: asyncio.subprocess.Process | None = None
    """The worker, there until reaped (None: a previous agent's). Not saved."""
    processes: tuple[tuple[int, str], ...] = ()
    """``(pid, state)`` of its members still there at the verdict. Not saved."""
    seconds: float = 0.0
    """How long after the SIGKILL they were still there. Not saved."""

    def saved(self) -> dict[str, Any]:
        return {
            "pgid": self.pgid,
            "rank": self.rank,
            "step": self.step,
            "born_by": self.born_by,
            "killed_at": self.killed_at,
            "sigkilled": self.sigkilled,
        }


def save_killed(run_dir: Path, groups: Iterable[KilledGroup]) -> None:
    """``groups`` into :data:`KILLED_FILE` (atomically; removed when there are none). Not
    synced to disk: a power loss is a reboot, which ends those processes anyway."""
    path = run_dir / KILLED_FILE
    saved = [k.saved() for k in groups]
    try:
        if saved:
            run_dir.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(json.dumps({"boot_id": boot_id(), "groups": saved}))
            tmp.replace(path)
        else:
            path.unlink(missing_ok=True)
    except OSError as exc:  # a restarted agent would not know them: say so
        _log.warning("killed_groups_not_saved", path=str(path), error=str(exc))


def load_killed(run_dir: Path) -> list[KilledGroup] | None:
    """The groups :func:`save_killed` left in ``run_dir`` in this boot ([] if the file is
    another boot's; None if there is none, or it is unreadable: logged, and left for a
    look). An entry without ``sigkilled`` was written by a release that saved a group only
    once SIGKILLed."""
    path = run_dir / KILLED_FILE
    try:
        data = load_json(path.read_text(), str(path))
        saved_boot, this_boot = str(data.get("boot_id", "")), boot_id()
        groups = [
            KilledGroup(
                int(g["pgid"]),
                int(g["rank"]),
                int(g["step"]),
                int(g["born_by"]),
                float(g["killed_at"]),
                sigkilled=bool(g.get("sigkilled", True)),
            )
            for g in data["groups"]
        ]
        bad = [g.pgid for g in groups if g.pgid <= 1]
        if bad:  # 0 is the agent's own group, 1 init's, below is no group: never signalled
            raise ValueError(f"pgid={bad[0]}: not a worker's process group")
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, KeyError, AttributeError, OverflowError) as exc:
        # OverflowError: ``int(Infinity)`` (JSON as Python reads it), which ended the agent's
        # start before it took a command
        _log.warning("killed_groups_unreadable", path=str(path), error=repr(exc)[:300])
        return None
    if saved_boot and this_boot and saved_boot != this_boot:
        return []
    return groups
