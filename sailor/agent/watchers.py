"""Preemption watchers behind one interface: GCP, AWS IMDSv2, Azure Scheduled Events, a file.

Each ``check()`` asks its source once and returns a ``Notice`` (deadline, source) or None;
the agent polls them and publishes a ``PreemptionNotice`` at once. Endpoints are configurable
so that tests point them at a tiny local HTTP server. HTTP runs through urllib in a worker
thread with a timeout (no extra HTTP dependency); an unreachable endpoint is "no notice".

Deadlines when the source gives none: GCP gives 30 s from the notice (documented preemption
notice period); AWS gives the ``time`` of the instance action (2 min after the notice);
Azure gives ``NotBefore``.
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import math
import urllib.error
import urllib.request
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Protocol

import structlog

from sailor.coordination import Clock

__all__ = [
    "GCP_NOTICE_S",
    "AwsWatcher",
    "AzureWatcher",
    "FileWatcher",
    "GcpWatcher",
    "Notice",
    "PreemptionWatcher",
    "make_watcher",
]

_log = structlog.get_logger("sailor.agent")

GCP_NOTICE_S = 30.0
"""GCP's preemption notice: 30 s between the ACPI signal and the stop (GCP docs)."""


@dataclass(frozen=True)
class Notice:
    deadline: float
    source: str


class PreemptionWatcher(Protocol):
    name: str

    async def check(self) -> Notice | None: ...


def _http(
    method: str, url: str, headers: dict[str, str], timeout: float
) -> tuple[int, bytes] | None:
    req = urllib.request.Request(url, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return int(resp.status), resp.read()
    except urllib.error.HTTPError as exc:
        return int(exc.code), b""
    except (urllib.error.URLError, OSError, TimeoutError):
        return None


class GcpWatcher:
    """``instance/preempted`` on the GCP metadata server: 'TRUE' once preempted."""

    name = "gcp"

    def __init__(self, base_url: str, clock: Clock, timeout: float = 1.0) -> None:
        self.url = base_url.rstrip("/") + "/computeMetadata/v1/instance/preempted"
        self.clock = clock
        self.timeout = timeout

    async def check(self) -> Notice | None:
        got = await asyncio.to_thread(
            _http, "GET", self.url, {"Metadata-Flavor": "Google"}, self.timeout
        )
        if got and got[0] == 200 and got[1].strip().upper() == b"TRUE":
            return Notice(self.clock.now() + GCP_NOTICE_S, self.name)
        return None


class AwsWatcher:
    """IMDSv2: PUT a session token, then GET ``spot/instance-action`` (404 = none)."""

    name = "aws"

    def __init__(self, base_url: str, clock: Clock, timeout: float = 1.0) -> None:
        self.base = base_url.rstrip("/")
        self.clock = clock
        self.timeout = timeout

    async def check(self) -> Notice | None:
        tok = await asyncio.to_thread(
            _http,
            "PUT",
            self.base + "/latest/api/token",
            {"X-aws-ec2-metadata-token-ttl-seconds": "60"},
            self.timeout,
        )
        if not tok or tok[0] != 200:
            return None
        got = await asyncio.to_thread(
            _http,
            "GET",
            self.base + "/latest/meta-data/spot/instance-action",
            {"X-aws-ec2-metadata-token": tok[1].decode(errors="replace")},
            self.timeout,
        )
        if not got or got[0] != 200:
            return None
        try:
            body = json.loads(got[1])
            when = datetime.fromisoformat(str(body["time"]).replace("Z", "+00:00")).timestamp()
        except (ValueError, KeyError, TypeError, RecursionError):
            when = self.clock.now() + 120.0
        return Notice(when, self.name)


class AzureWatcher:
    """Scheduled Events: an event of type Preempt; ``NotBefore`` is the deadline."""

    name = "azure"

    def __init__(self, base_url: str, clock: Clock, timeout: float = 1.0) -> None:
        self.url = base_url.rstrip("/") + "/metadata/scheduledevents?api-version=2020-07-01"
        self.clock = clock
        self.timeout = timeout

    async def check(self) -> Notice | None:
        got = await asyncio.to_thread(_http, "GET", self.url, {"Metadata": "true"}, self.timeout)
        if not got or got[0] != 200:
            return None
        try:
            events = json.loads(got[1]).get("Events", [])
        except (ValueError, AttributeError, RecursionError):
            return None
        for ev in events:
            if isinstance(ev, dict) and ev.get("EventType") == "Preempt":
                nb = ev.get("NotBefore") or ""
                try:
                    when = email.utils.parsedate_to_datetime(str(nb)).timestamp()
                except (TypeError, ValueError):
                    when = self.clock.now() + GCP_NOTICE_S
                return Notice(when, self.name)
        return None


class FileWatcher:
    """A JSON file ``{"deadline": UNIX_TIME}`` (or ``{"in_s": SECONDS}``) appearing = notice."""

    name = "file"

    def __init__(self, path: Path, clock: Clock) -> None:
        self.path = path
        self.clock = clock

    async def check(self) -> Notice | None:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return None
        except OSError:
            text = ""
        return Notice(self._deadline(text), self.name)

    def _deadline(self, text: str) -> float:
        """The file's deadline; the file's appearance is the notice, so a body that says no
        usable time gives the default one (GCP's 30 s), with a warning naming it (a wrong
        field crashed the watcher, an infinite one lost the notice)."""
        now = self.clock.now()
        try:
            body = json.loads(text or "{}")
        except (ValueError, RecursionError):
            body = None
        if not isinstance(body, dict):
            _log.warning("notice_file_unreadable", path=str(self.path), body=text[:200])
            return now + GCP_NOTICE_S
        for key, base in (("deadline", 0.0), ("in_s", now)):
            if key not in body:
                continue
            v = body[key]
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
                return base + float(v)
            _log.warning(
                "notice_file_field",
                path=str(self.path),
                field=key,
                value=repr(v)[:100],
                why="not a finite number: the default deadline is taken",
            )
            return now + GCP_NOTICE_S
        return now + GCP_NOTICE_S


def make_watcher(kind: str, target: str, clock: Clock) -> PreemptionWatcher:
    """A watcher from config: kind in gcp|aws|azure|file, target = base URL or path."""
    if kind == "gcp":
        return GcpWatcher(target, clock)
    if kind == "aws":
        return AwsWatcher(target, clock)
    if kind == "azure":
        return AzureWatcher(target, clock)
    if kind == "file":
        return FileWatcher(Path(target), clock)
    raise ValueError(f"watcher kind={kind!r}: must be gcp, aws, azure or file")
