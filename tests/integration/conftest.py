"""Real servers for the integration tests: nats-server -js and etcd 3.4, secure by default.

Each test gets fresh servers from :mod:`sailor.localservers` on free loopback ports with data
in a temp dir, both stopped after the test. **Security is on**, as in a deployment: TLS with
client certificates on both, a NATS login per identity with the per-node permissions, etcd
RBAC (see ``IDENTITIES`` for who has a certificate). ``servers.security(name)`` is the
``security:`` setting of one identity. ``plain_servers`` (no TLS, no auth) is only for tests
about something else that say why. ``Server.restart()`` stops and starts a server on the same
port and data dir. ``module_plain_servers`` is one plain pair shared by a module's tests, each
under a job of its own. ``cluster`` is controllers and agents on the secure servers
(``cluster_kit``). ``released`` waits for the test's closed etcd clients to let go of the
servers before they stop (etcd's stop waits on them). ``no_task_leak`` fails a test that
leaves asyncio tasks behind. No mocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from sailor.localnet import free_port
from sailor.localservers import (
    Identities,
    LocalServers,
    ServerMissingError,
    ServerProcess,
    start_local_servers,
)
from tests.integration.cluster_kit import Cluster
from tests.integration.secure_servers import CONTROLLER, JOB, NODES, Pki

__all__ = ["IDENTITIES", "Server", "connected_to", "free_port", "released"]

Server = ServerProcess

IDENTITIES = Identities(
    jobs=("t", "contract", JOB, "chaos"),
    controllers=("c1", "c2", "c3", CONTROLLER),
    agents=(*(f"n{i}" for i in range(1, 7)), *NODES),
)
"""Every job, controller and node id the integration tests use (certificates and logins are
fixed when the servers start, as in a deployment)."""


def _start(root: Path, secure: bool) -> LocalServers:
    try:
        return start_local_servers(root, IDENTITIES, secure=secure)
    except ServerMissingError as exc:
        pytest.skip(str(exc))


@pytest.fixture
def _secure_pair(tmp_path: Path) -> Iterator[LocalServers]:
    s = _start(tmp_path / "servers", secure=True)
    yield s
    s.stop()


@pytest.fixture
async def servers(_secure_pair: LocalServers) -> AsyncIterator[LocalServers]:
    """nats-server and etcd with TLS, logins, permissions and RBAC (the default)."""
    yield _secure_pair
    await released(_secure_pair)


@pytest.fixture
def _plain_pair(tmp_path: Path) -> Iterator[LocalServers]:
    s = _start(tmp_path / "plain-servers", secure=False)
    yield s
    s.stop()


@pytest.fixture
async def plain_servers(_plain_pair: LocalServers) -> AsyncIterator[LocalServers]:
    """Both servers without TLS or auth: only for a test that says why it needs that."""
    yield _plain_pair
    await released(_plain_pair)


async def released(s: LocalServers, timeout_s: float = 1.0) -> None:
    """Until this process holds no connection to ``s``'s etcd: the test's closed clients
    let go of it before the server stops (at most ``timeout_s``; the stop goes ahead then).

    etcd's stop (SIGTERM) waits ~1.1 s on a TLS connection still open (measured: 1.07-1.19
    s; 0.01-0.07 s without). A closed ``EtcdStore`` lets go of its connections at once
    (tests/integration/test_security_etcd.py checks it without the garbage collector); a
    client that does not (a library's object in a reference cycle, as the store's gRPC
    calls were) is freed by a collection, made only then: a full collection costs
    0.05-0.5 s in a test process (measured), more than most teardowns."""
    ports = {m.port for m in s.etcd_members}
    start = time.monotonic()
    end, collected = start + timeout_s, False
    while connected_to(ports) and time.monotonic() < end:
        if not collected and time.monotonic() - start > 0.05:  # a few loop turns
            gc.collect()
            collected = True
        await asyncio.sleep(0.01)


def connected_to(ports: set[int]) -> bool:
    """Whether this process holds an established TCP connection to one of ``ports``
    (Linux's /proc; False where it cannot tell)."""
    try:
        inodes = {
            link[len("socket:[") : -1]
            for fd in Path("/proc/self/fd").iterdir()
            if (link := _readlink(fd)).startswith("socket:[")
        }
        for table in ("tcp", "tcp6"):
            with (Path("/proc/self/net") / table).open() as fh:
                next(fh)
                for row in fh:
                    f = row.split()  # remote address HEX_IP:HEX_PORT; state 01: established
                    port = int(f[2].rsplit(":", 1)[1], 16)
                    if f[3] == "01" and port in ports and f[9] in inodes:
                        return True
    except OSError:
        return False
    return False


def _readlink(fd: Path) -> str:
    try:
        return str(fd.readlink())
    except OSError:  # closed since the listing
        return ""


@pytest.fixture
def nats_server(servers: LocalServers) -> Server:
    return servers.nats


@pytest.fixture
def etcd_server(servers: LocalServers) -> Server:
    return servers.etcd


@pytest.fixture
def nats_url(servers: LocalServers) -> str:
    return servers.nats_url


@pytest.fixture
def etcd_endpoint(servers: LocalServers) -> str:
    return servers.etcd_endpoint


@pytest.fixture
def pki(servers: LocalServers) -> Pki:
    """The servers' CA, certificates and NATS logins (job ``secure_servers.JOB``)."""
    assert servers.pki_dir is not None
    return Pki(servers.pki_dir)


@pytest.fixture
def secure_nats_server(servers: LocalServers) -> Server:
    return servers.nats


@pytest.fixture
def secure_etcd_server(servers: LocalServers) -> Server:
    return servers.etcd


@pytest.fixture
async def cluster(tmp_path: Path, servers: LocalServers) -> AsyncIterator[Cluster]:
    """Controllers and agents of job ``t`` on the secure servers (``cluster_kit.Cluster``
    with its defaults), all stopped after the test. A file that needs other settings
    defines a ``cluster`` of its own."""
    async with Cluster(tmp_path, servers) as c:
        yield c


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


@pytest.fixture
def favoured_cpu() -> Iterator[Path]:
    """This test process, and what it starts from now on, in a fresh cgroup of ten times the
    default CPU weight; skips where CPU quotas cannot be used (``sailor.agent.cpu_quota``).

    For tests that measure what a CPU quota does: other jobs share this machine's two cores
    (load averages of 6-7 were seen), and a process of default weight then gets ~0.4 core
    with or without a quota, which hides the quota. With the weight, the quota is the only
    limit of the test's own processes. Node cgroups the test creates go below this one
    (their base is the creating process's own cgroup); it is removed after the test.
    """
    from sailor.agent.cpu_quota import detect

    where = detect()
    if isinstance(where, str):
        pytest.skip(f"CPU quotas cannot be tested here: {where}")
    base = Path(where.base)
    home = base / f"sailor-test-{os.getpid()}"
    home.mkdir()
    pid = str(os.getpid())
    try:
        if where.version == 1:
            (home / "cpu.shares").write_text("10240")  # default 1024
        else:  # v2: only where the base hands the cpu controller down (else unweighted)
            with contextlib.suppress(OSError):
                (home / "cpu.weight").write_text("1000")  # default 100
        (home / "cgroup.procs").write_text(pid)
        yield home
    finally:
        (base / "cgroup.procs").write_text(pid)
        for _ in range(40):  # children of the test may take a moment to be reaped
            try:
                home.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.05)


@pytest.fixture(scope="module")
def module_plain_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServers]:
    """Plain servers shared by the tests of one module, each test under a job of its own:
    for tests of something else (the executor, an operator command's wait) whose files would
    otherwise start a pair (~1 s each) per test. Plain, because the secure servers fix the
    jobs' logins and RBAC when they start; security has its own tests (test_security_*)."""
    s = _start(tmp_path_factory.mktemp("module-servers"), secure=False)
    yield s
    s.stop()
