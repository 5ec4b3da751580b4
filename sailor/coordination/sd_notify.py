"""systemd readiness and watchdog notifications (``Type=notify``, ``WatchdogSec=``).

The protocol (sd_notify(3)) is one datagram of ``KEY=VALUE`` lines sent to the unix socket
named by ``$NOTIFY_SOCKET`` (a leading ``@`` means the abstract namespace). ``READY=1`` ends
the unit's start-up, ``WATCHDOG=1`` must arrive more often than ``$WATCHDOG_USEC``
microseconds or systemd kills and restarts the service, ``STOPPING=1`` says shutdown began,
``STATUS=`` is the line ``systemctl status`` shows. Outside systemd (no ``NOTIFY_SOCKET``)
every call is a no-op, so the daemons call it unconditionally.

A few lines over the standard library instead of a dependency (``sdnotify``, ``systemd-python``).
Must never raise into the daemon: a notification that cannot be sent is logged and dropped,
since losing one is better than crashing training over it.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Mapping

import structlog

__all__ = ["SystemdNotifier"]

_log = structlog.get_logger("sailor.sd_notify")


class SystemdNotifier:
    """Sends notifications to systemd's notify socket; a no-op without one.

    ``watchdog()`` may be called as often as the caller likes (e.g. every loop iteration): it
    sends ``WATCHDOG=1`` at most once per third of the watchdog interval, and only when
    systemd asked for it (``WATCHDOG_USEC`` set, and ``WATCHDOG_PID`` unset or our pid).
    """

    def __init__(
        self,
        address: str | None,
        watchdog_usec: int = 0,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.address = address
        self.watchdog_s = watchdog_usec / 1e6 if address else 0.0
        self._monotonic = monotonic
        self._last_ping = float("-inf")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> SystemdNotifier:
        """Read ``NOTIFY_SOCKET``, ``WATCHDOG_USEC`` and ``WATCHDOG_PID`` (from os.environ)."""
        env = os.environ if env is None else env
        address = env.get("NOTIFY_SOCKET") or None
        usec = 0
        pid = env.get("WATCHDOG_PID")
        if pid is None or pid == str(os.getpid()):
            try:
                usec = max(0, int(env.get("WATCHDOG_USEC", "0")))
            except ValueError:
                usec = 0
        return cls(address, usec)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    @property
    def watchdog_enabled(self) -> bool:
        return self.watchdog_s > 0

    def notify(self, *lines: str) -> bool:
        """Send ``lines`` as one datagram; True if it was sent."""
        if self.address is None:
            return False
        addr = self.address
        if addr.startswith("@"):
            addr = "\0" + addr[1:]
        payload = "\n".join(lines).encode()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.connect(addr)
                sock.sendall(payload)
        except OSError as exc:
            _log.warning("sd_notify_failed", address=self.address, error=str(exc))
            return False
        return True

    def ready(self, status: str = "") -> bool:
        """Start-up is complete (``READY=1``), with an optional status line."""
        lines = ["READY=1"] + ([f"STATUS={_one_line(status)}"] if status else [])
        return self.notify(*lines)

    def status(self, text: str) -> bool:
        return self.notify(f"STATUS={_one_line(text)}")

    def stopping(self) -> bool:
        return self.notify("STOPPING=1")

    def watchdog(self) -> bool:
        """Keep-alive (``WATCHDOG=1``), rate-limited to three per watchdog interval."""
        if not self.watchdog_enabled:
            return False
        now = self._monotonic()
        if now - self._last_ping < self.watchdog_s / 3:
            return False
        self._last_ping = now
        return self.notify("WATCHDOG=1")


def _one_line(text: str) -> str:
    return " ".join(text.split())[:200]
