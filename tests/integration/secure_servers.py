"""Names and client settings of the secure test servers (``conftest.servers``).

The servers themselves come from :mod:`sailor.localservers` (one launcher for the demo, the
tests, the chaos suite and the benchmarks); this module names the job and the identities the
security tests use, and reads a test PKI directory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sailor.coordination.security import SecurityConfig

JOB = "secjob"
CONTROLLER = "controller"
NODES = ("node-a", "node-b")


@dataclass(frozen=True)
class Pki:
    dir: Path

    def security(self, name: str, nats: bool = True) -> SecurityConfig:
        login = self.dir / f"{name}.nats.json"
        return SecurityConfig(
            ca_file=self.dir / "ca.crt",
            cert_file=self.dir / f"{name}.crt",
            key_file=self.dir / f"{name}.key",
            nats_login_file=login if nats and login.exists() else None,
        )
