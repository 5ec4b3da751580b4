"""What NCCL's configuration files set: the settings the environment variables the worker
adds must not override (``devices.nccl_env``).

NCCL reads ``NAME=value`` settings from a file of the user's and from ``/etc/nccl.conf``
(an administrator's system-wide values), and applies them *under* the environment: a file's
setting is only taken where the variable is not already set (``setEnvFile`` →
``ncclOsSetEnv`` → ``setenv(name, value, 0)``, ``src/misc/param.cc`` and ``src/os/linux.cc``
of NCCL 2.2x; older releases call ``setenv(..., 0)`` directly). The files, in the order
read, so the first one to set a name wins:

1. ``$NCCL_CONF_FILE`` if set and not empty, else ``~/.nccl.conf`` (the home directory of
   the process's user from the password database, not ``$HOME``);
2. ``/etc/nccl.conf``.

A line is ``NAME=value`` exactly as NCCL cuts it (``setEnvFile``): a line
starting with ``#`` is a comment, one without ``=`` is skipped, the name is everything
before the first ``=`` and the value everything after it, less the line's final ``\\n``
only. Nothing else is stripped: not blanks (``NAME = 1`` sets a name with a blank in it,
which no NCCL variable matches) and not a ``\\r`` (a file saved with CRLF line ends sets
``NCCL_DEBUG=WARN\\r``; NCCL reads a number up to it). Name and value are cut at 1023
characters, as NCCL's 1024-byte buffers cut them (bytes there: the same for ASCII).

So a variable Sailor puts in the environment overrides an administrator's ``/etc/nccl.conf``
for it; :func:`read_nccl_conf` lets the worker see such a setting first and leave the
variable alone. :func:`parse_nccl_conf` and :func:`conf_files` are pure; only
:func:`read_nccl_conf` reads files (a file that cannot be read is skipped, as NCCL skips it).
"""

from __future__ import annotations

import os
import pwd
from collections.abc import Callable, Mapping
from pathlib import Path

__all__ = ["SYSTEM_CONF", "conf_files", "nccl_conf_settings", "parse_nccl_conf", "read_nccl_conf"]

SYSTEM_CONF = "/etc/nccl.conf"

_CUT = 1023
"""NCCL copies a name and a value into ``char[1024]`` buffers (``strncpy`` of 1023)."""


def parse_nccl_conf(text: str) -> dict[str, str]:
    """The settings of one file, as NCCL reads them (the first of a name wins)."""
    out: dict[str, str] = {}
    for line in text.split("\n"):
        if line.startswith("#") or "=" not in line:
            continue
        name, _, value = line.partition("=")
        out.setdefault(name[:_CUT], value[:_CUT])
    return out


def conf_files(environ: Mapping[str, str], home: str | None) -> list[str]:
    """The files NCCL reads, in its order: the user's (``NCCL_CONF_FILE``, else
    ``home/.nccl.conf``; none without either), then the system's."""
    user = environ.get("NCCL_CONF_FILE", "")
    if user:
        return [user, SYSTEM_CONF]
    return [f"{home}/.nccl.conf", SYSTEM_CONF] if home else [SYSTEM_CONF]


def nccl_conf_settings(
    environ: Mapping[str, str], home: str | None, read: Callable[[str], str | None]
) -> dict[str, str]:
    """Every setting NCCL's files give it (``read`` returns a file's text, None when it
    cannot be read); the first file to set a name wins, as in NCCL."""
    out: dict[str, str] = {}
    for path in conf_files(environ, home):
        text = read(path)
        if text is not None:
            for name, value in parse_nccl_conf(text).items():
                out.setdefault(name, value)
    return out


def _read(path: str) -> str | None:
    try:
        # newline="": the text as NCCL's getline sees it (no '\r' dropped or made a line end)
        with Path(path).open(encoding="utf-8", errors="replace", newline="") as f:
            return f.read()
    except OSError:
        return None


def _home() -> str | None:
    try:
        return pwd.getpwuid(os.getuid()).pw_dir
    except KeyError:  # a uid without a passwd entry (containers): NCCL reads no user file
        return None


def read_nccl_conf(environ: Mapping[str, str]) -> dict[str, str]:
    """The settings of this host's NCCL configuration files, for this process's user."""
    return nccl_conf_settings(environ, _home(), _read)
