"""nats-server and etcd 3.4 with TLS, authentication and permissions, for the security tests.

A fresh PKI per test (``sailor certs`` functions): a CA, server certificates for both servers,
client certificates and NATS logins for one controller and two agents, and etcd's ``root``.
etcd runs with ``--client-cert-auth`` and the job's RBAC applied (so auth is on).
"""

from __future__ import annotations

import asyncio
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from sailor.cli.certs_cmd import Role, init_ca, issue_cert, write_nats_config
from sailor.coordination.etcd_auth import apply_rbac
from sailor.coordination.etcd_store import connect_etcd
from sailor.coordination.keys import Keys
from sailor.coordination.security import SecurityConfig
from sailor.coordination.security.certs import CertKind
from sailor.coordination.security.etcd_rbac import etcd_tls_flags, rbac_plan

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


def make_pki(root: Path) -> Pki:
    d = root / "pki"
    init_ca(d, "test-ca", days=1)
    for server in ("nats", "etcd"):
        issue_cert(d, server, CertKind.server, days=1)
    issue_cert(d, CONTROLLER, CertKind.client, role=Role.controller, days=1)
    for node in NODES:
        issue_cert(d, node, CertKind.client, role=Role.agent, days=1)
    issue_cert(d, "root", CertKind.client, role=Role.admin, days=1)
    return Pki(d)


def nats_argv(binary: str, pki: Pki, port: int, store: Path) -> list[str]:
    conf = write_nats_config(pki.dir, JOB, f"127.0.0.1:{port}", store, "nats")
    return [binary, "-c", str(conf)]


def etcd_argv(pki: Pki, port: int, peer: int, data: Path) -> list[str]:
    etcd = shutil.which("etcd")
    if not etcd:
        pytest.skip("etcd not installed (deploy/install-servers.sh)")
    d = pki.dir
    return [
        etcd,
        "--name", "t",
        "--data-dir", str(data),
        "--listen-client-urls", f"https://127.0.0.1:{port}",
        "--advertise-client-urls", f"https://127.0.0.1:{port}",
        "--listen-peer-urls", f"http://127.0.0.1:{peer}",
        "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
        "--initial-cluster", f"t=http://127.0.0.1:{peer}",
        "--heartbeat-interval", "10",
        "--election-timeout", "50",
        "--log-level", "warn",
        # client side only: the single test member has no peers to authenticate
        *etcd_tls_flags(d / "ca.crt", d / "etcd.crt", d / "etcd.key")[:4],
    ]  # fmt: skip


def apply_job_rbac(pki: Pki, endpoint: str) -> None:
    async def _run() -> None:
        store = await connect_etcd(endpoint, security=pki.security("root"))
        try:
            await apply_rbac(store, rbac_plan(Keys(job=JOB), (CONTROLLER,), NODES))
        finally:
            await store.close()

    asyncio.run(_run())
