"""Real servers for the runtime's integration tests: nats-server -js and etcd 3.4.

Each test gets fresh servers on free loopback ports with data in a temp dir; both are stopped
after the test. ``restart()`` stops and starts a server on the same port and data dir (the
chaos of a server restart). ``no_task_leak`` fails a test that leaves asyncio tasks behind.
No mocks of either server.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from sailor.localnet import free_port, wait_port
from tests.integration.secure_servers import Pki, apply_job_rbac, etcd_argv, make_pki, nats_argv

VENV_BIN = Path(sys.executable).parent


class Server:
    """One server process we started, restartable on the same port and data dir."""

    def __init__(self, name: str, argv: list[str], port: int, log: Path) -> None:
        self.name = name
        self.argv = argv
        self.port = port
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        fh = self.log.open("ab")
        self.proc = subprocess.Popen(self.argv, stdout=fh, stderr=subprocess.STDOUT)
        fh.close()
        wait_port(self.port, 15.0, self.name)

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)
        self.proc = None

    def restart(self, down_s: float = 0.5) -> None:
        self.stop()
        time.sleep(down_s)
        self.start()


def _nats_binary() -> str:
    cand = VENV_BIN / "nats-server"
    if cand.exists():
        return str(cand)
    found = shutil.which("nats-server")
    if not found:
        pytest.skip("nats-server not installed (deploy/install-servers.sh)")
    return found


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[Server]:
    port = free_port()
    store = tmp_path / "nats"
    store.mkdir()
    argv = [_nats_binary(), "-js", "-a", "127.0.0.1", "-p", str(port), "-sd", str(store)]
    server = Server("nats", argv, port, tmp_path / "nats.log")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def etcd_server(tmp_path: Path) -> Iterator[Server]:
    etcd = shutil.which("etcd")
    if not etcd:
        pytest.skip("etcd not installed (deploy/install-servers.sh)")
    port, peer = free_port(), free_port()
    data = tmp_path / "etcd"
    argv = [
        etcd,
        "--name",
        "t",
        "--data-dir",
        str(data),
        "--listen-client-urls",
        f"http://127.0.0.1:{port}",
        "--advertise-client-urls",
        f"http://127.0.0.1:{port}",
        "--listen-peer-urls",
        f"http://127.0.0.1:{peer}",
        "--initial-advertise-peer-urls",
        f"http://127.0.0.1:{peer}",
        "--initial-cluster",
        f"t=http://127.0.0.1:{peer}",
        "--heartbeat-interval",
        "10",
        "--election-timeout",
        "50",
        "--log-level",
        "warn",
    ]
    server = Server("etcd", argv, port, tmp_path / "etcd.log")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    """A CA and every certificate and NATS login of ``secure_servers`` (job ``secjob``)."""
    return make_pki(tmp_path)


@pytest.fixture
def secure_nats_server(tmp_path: Path, pki: Pki) -> Iterator[Server]:
    """nats-server -js with TLS (client certificates required), users and permissions."""
    port = free_port()
    store = tmp_path / "nats-secure"
    store.mkdir()
    argv = nats_argv(_nats_binary(), pki, port, store)
    server = Server("nats", argv, port, tmp_path / "nats-secure.log")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def secure_etcd_server(tmp_path: Path, pki: Pki) -> Iterator[Server]:
    """etcd 3.4 over TLS with --client-cert-auth and the job's RBAC applied (auth on)."""
    port, peer = free_port(), free_port()
    argv = etcd_argv(pki, port, peer, tmp_path / "etcd-secure")
    server = Server("etcd", argv, port, tmp_path / "etcd-secure.log")
    server.start()
    apply_job_rbac(pki, f"127.0.0.1:{port}")
    yield server
    server.stop()


@pytest.fixture
def nats_url(nats_server: Server) -> str:
    return f"nats://127.0.0.1:{nats_server.port}"


@pytest.fixture
def etcd_endpoint(etcd_server: Server) -> str:
    return f"127.0.0.1:{etcd_server.port}"


@pytest.fixture
async def no_task_leak() -> AsyncIterator[None]:
    """Fail the test if it leaves asyncio tasks running (kopf's habit)."""
    before = set(asyncio.all_tasks())
    yield
    current = asyncio.current_task()
    leaked: set[asyncio.Task[object]] = set()
    for _ in range(50):
        leaked = {t for t in asyncio.all_tasks() - before if t is not current and not t.done()}
        # grpc/nats internals may need a few loop turns to finish after close()
        leaked = {t for t in leaked if not _is_library_internal(t)}
        if not leaked:
            return
        await asyncio.sleep(0.05)
    names = sorted(t.get_name() for t in leaked)
    for t in leaked:
        t.cancel()
        with contextlib.suppress(BaseException):
            await t
    pytest.fail(f"asyncio tasks leaked: {names}")


def _is_library_internal(task: asyncio.Task[object]) -> bool:
    coro = task.get_coro()
    qual = getattr(coro, "__qualname__", "") or ""
    module = getattr(getattr(coro, "cr_code", None), "co_filename", "") or ""
    return "grpc" in module or "grpc" in qual
