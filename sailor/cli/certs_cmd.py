"""``sailor certs``: a deployment's CA, certificates, NATS logins, nats-server config, etcd RBAC.

Thin command-line shell around ``sailor.coordination.security``: the builders are pure, and
``security.pki`` writes the files (keys and passwords with mode 0600 from creation on).

Layout of DIR::

    ca.crt, ca.key                  the CA (``init``)
    <name>.crt, <name>.key          a server or client certificate (``issue``)
    <name>.nats.json                the NATS login of a client with role controller or agent
    nats-server.conf                ``nats-config``: TLS, JetStream and every login's permissions
    <name>.revoked.json             ``revoke``: the node's credentials were revoked
"""

from __future__ import annotations

import asyncio
import getpass
import json
import os
import shlex
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import typer

from sailor.cli._io import fail
from sailor.coordination.keys import Keys
from sailor.coordination.security.certs import CertKind, check_host
from sailor.coordination.security.etcd_rbac import etcd_tls_flags, rbac_plan
from sailor.coordination.security.pki import (
    REVOKED_SUFFIX,
    Role,
    init_ca,
    issue_cert,
    revoked_record,
    write_nats_config,
)
from sailor.coordination.security.settings import SecurityConfig

__all__ = ["Role", "certs_app", "init_ca", "issue_cert", "write_nats_config"]

certs_app = typer.Typer(
    help="CA, certificates and credentials for a deployment.", no_args_is_help=True
)


def _require(path: Path, kind: str = "") -> None:
    """``path`` exists: the CA's (``ca.crt``) or, with ``kind`` (server or client), a
    certificate or key that ``sailor certs issue`` writes; the error says which command
    makes it."""
    if path.is_file():
        return
    if path.name == "ca.crt":
        make = f"create the CA with `sailor certs init {path.parent}` first"
    else:
        make = (
            f"issue it with `sailor certs issue {path.parent} --name {path.stem} --kind "
            f"{kind}` first"
        )
    raise fail(f"{path}: no such file: {make}")


@certs_app.command("init")
def init_cmd(
    directory: Path = typer.Argument(..., help="Directory to write the CA and certificates to."),
    name: str = typer.Option("sailor-ca", "--name", help="CA common name."),
    days: int = typer.Option(3650, "--days", min=1, max=36500, help="Validity in days."),
    force: bool = typer.Option(False, "--force", help="Replace an existing CA."),
) -> None:
    """Create a CA (DIR/ca.crt, DIR/ca.key mode 0600)."""
    try:
        path = init_ca(directory, name, days, force)
    except (FileExistsError, ValueError) as exc:
        raise fail(str(exc), code=1) from None
    typer.echo(f"CA written: {path}")


@certs_app.command("issue")
def issue_cmd(
    directory: Path = typer.Argument(..., help="Directory holding the CA (from `certs init`)."),
    name: str = typer.Option(
        ...,
        "--name",
        help="Common name: node id, controller identity, "
        "server name, or 'root' for the etcd operator.",
    ),
    kind: CertKind = typer.Option(..., "--kind", help="server (nats/etcd) or client."),
    host: list[str] = typer.Option([], "--host", help="Extra SAN (server); repeatable."),
    role: Role = typer.Option(Role.agent, "--role", help="Client role (NATS permissions)."),
    days: int = typer.Option(825, "--days", min=1, max=36500, help="Validity in days."),
    force: bool = typer.Option(
        False, "--force", help="Replace this name's certificate, key and NATS login."
    ),
) -> None:
    """Issue a server or client certificate; controller/agent clients also get a NATS login."""
    for h in host:
        try:
            check_host(h)
        except ValueError as exc:
            raise fail(f"--host: {exc}") from None
    _require(directory / "ca.crt")
    try:
        paths = issue_cert(directory, name, kind, tuple(host), role, days, force)
    except (OSError, ValueError) as exc:
        raise fail(str(exc), code=1) from None
    for p in paths:
        typer.echo(f"written: {p}")
    if kind.value == "server" and not any(h not in ("localhost", "127.0.0.1", "::1") for h in host):
        typer.echo(
            "warning: this server certificate names only localhost and 127.0.0.1: clients and "
            "peers on other VMs will fail TLS (IP address mismatch); issue it with --host for "
            "every address and name they dial",
            err=True,
        )


@certs_app.command("nats-config")
def nats_config_cmd(
    directory: Path = typer.Argument(..., help="Directory holding the CA and logins."),
    job: str = typer.Option("default", "--job", help="Job name (subjects are per job)."),
    listen: str = typer.Option("127.0.0.1:4222", "--listen", help="host:port to listen on."),
    store_dir: Path = typer.Option(Path("/var/lib/sailor/nats"), "--store-dir"),
    server: str = typer.Option("nats", "--server", help="Name of the server certificate."),
    authorization_only: bool = typer.Option(
        False,
        "--authorization-only",
        help="Write only DIR/nats-authorization.conf (users and permissions), which "
        "deploy/config/nats-server.conf includes.",
    ),
) -> None:
    """Write DIR/nats-server.conf: TLS, JetStream, users and permissions (mode 0600)."""
    _require(directory / "ca.crt")
    try:
        path = write_nats_config(
            directory, job, listen, store_dir, server, authorization_only=authorization_only
        )
    except ValueError as exc:  # logins that would share NATS permissions
        raise fail(str(exc), code=1) from None
    typer.echo(f"written: {path}")


@certs_app.command("etcd-flags")
def etcd_flags_cmd(
    directory: Path = typer.Argument(..., help="Directory holding the CA."),
    server: str = typer.Option("etcd", "--server", help="Name of the server certificate."),
) -> None:
    """Print the etcd flags for TLS with client-certificate authentication."""
    d = directory.resolve()
    _require(d / "ca.crt")
    for suffix in (".crt", ".key"):  # the flags would start etcd on files not there
        _require(d / f"{server}{suffix}", "server")
    for flag in etcd_tls_flags(d / "ca.crt", d / f"{server}.crt", d / f"{server}.key"):
        typer.echo(flag)


@certs_app.command("etcd-rbac")
def etcd_rbac_cmd(
    directory: Path = typer.Argument(..., help="Directory holding the CA and root's certificate."),
    endpoint: str = typer.Option("127.0.0.1:2379", "--endpoint", help="etcd host:port."),
    job: str = typer.Option("default", "--job", help="Job name."),
    controller: list[str] = typer.Option(["controller"], "--controller", help="Repeatable."),
    node: list[str] = typer.Option([], "--node", help="Agent node id; repeatable."),
    admin: str = typer.Option("root", "--admin", help="Certificate to connect with."),
) -> None:
    """Create etcd users and roles for a job, enable auth (idempotent; re-run for new nodes)."""
    from sailor.coordination.etcd_auth import apply_rbac
    from sailor.coordination.etcd_store import connect_etcd

    for name in ("ca", admin):
        _require(directory / f"{name}.crt", "client")
    revoked = [n for n in node if revoked_record(directory, n) is not None]
    if revoked:
        # its user would be created again, and its old certificate (no revocation list)
        # would log in as that user
        raise fail(
            f"node={revoked[0]!r} was revoked ({directory / (revoked[0] + REVOKED_SUFFIX)}): "
            "leave it out of --node (its old certificate would log in again)",
            code=1,
        )
    plan = rbac_plan(Keys(job=job), tuple(controller), tuple(node))
    sec = SecurityConfig(
        ca_file=directory / "ca.crt",
        cert_file=directory / f"{admin}.crt",
        key_file=directory / f"{admin}.key",
    )

    async def _run() -> None:
        store = await connect_etcd(endpoint, security=sec)
        try:
            await apply_rbac(store, plan)
        finally:
            await store.close()

    asyncio.run(_run())
    typer.echo(f"etcd RBAC applied: {len(plan.roles)} roles, {len(plan.users)} users, auth on")


_DEFAULT_RELOAD = "systemctl reload sailor-nats"


def _nats_reloader(pid: int | None, command: str) -> tuple[str, Callable[[], None]] | None:
    """(what, callable) that makes nats-server read its config again; None: nothing."""
    if pid is not None:

        def hup() -> None:
            os.kill(pid, signal.SIGHUP)  # what the unit's ExecReload does

        return f"SIGHUP to {pid}", hup
    if not command.strip():
        return None

    def run() -> None:
        subprocess.run(shlex.split(command), check=True, timeout=60, capture_output=True)

    return command, run


def _audit(path: Path, record: dict[str, object]) -> bool:
    """Append one record to an existing controller audit log (fsynced); False if there is
    none there (never created here: the controller's user must own it)."""
    if not path.is_file():
        return False
    line = json.dumps(record, sort_keys=True) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        os.write(fd, line.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    return True


@certs_app.command("revoke")
def revoke_cmd(
    directory: Path = typer.Argument(
        ..., help="Directory holding the CA, root's certificate and the NATS logins."
    ),
    name: str = typer.Option(..., "--name", help="Node id whose credentials are revoked."),
    endpoint: str = typer.Option("127.0.0.1:2379", "--endpoint", help="etcd host:port."),
    admin: str = typer.Option("root", "--admin", help="Certificate to connect to etcd with."),
    nats_reload: str = typer.Option(
        _DEFAULT_RELOAD,
        "--nats-reload",
        help="Command that makes nats-server read its config again ('' : none, reload by hand).",
    ),
    nats_pid: int | None = typer.Option(
        None, "--nats-pid", min=1, help="Send SIGHUP to this nats-server instead."
    ),
    audit_log: Path = typer.Option(
        Path("/var/log/sailor/audit.jsonl"),
        "--audit-log",
        help="The controller's audit log to record the revocation in (if it exists).",
    ),
) -> None:
    """Revoke a node's credentials: delete its etcd user and roles, remove its NATS login and
    reload nats-server (idempotent). Its certificate stays valid for TLS until it expires."""
    from sailor.coordination.errors import CoordinationError
    from sailor.coordination.revocation import NotANodeError, UnknownNodeError, revoke_node

    for cert in ("ca", admin):
        _require(directory / f"{cert}.crt", "client")
    reloader = _nats_reloader(nats_pid, nats_reload)
    who = f"{getpass.getuser()}@{socket.gethostname()}"
    reload_error: list[str] = []

    def reload() -> None:
        if reloader is None:
            return
        try:
            reloader[1]()
        except (OSError, subprocess.SubprocessError) as exc:
            reload_error.append(f"{reloader[0]}: {exc}")

    try:
        done = asyncio.run(revoke_node(directory, name, endpoint, who, admin, reload))
    except (UnknownNodeError, NotANodeError, ValueError) as exc:
        raise fail(str(exc), code=1) from None
    except CoordinationError as exc:
        raise fail(f"node={name!r}: nothing revoked (etcd: {exc})", code=1) from None
    if done.already:
        typer.echo(f"{name}: already revoked ({done.record}): nothing left to revoke")
        return
    configs = [str(f) for f in done.nats_files if not f.name.endswith(".nats.json")]
    audited = _audit(
        audit_log,
        {
            "kind": "credentials_revoked",
            "time": round(time.time(), 6),
            "node": name,
            "by": who,
            "etcd_user_deleted": done.etcd.user_deleted,
            "etcd_roles": list(done.etcd.roles_deleted),
            "etcd_keys": list(done.etcd.keys_deleted),
            "nats_configs": configs,
            "nats_reloaded": bool(configs) and reloader is not None and not reload_error,
        },
    )
    roles = ", ".join(done.etcd.roles_deleted) or "none"
    user = "deleted" if done.etcd.user_deleted else "none left"
    typer.echo(f"{name}: etcd user {user}; roles deleted: {roles}")
    if done.etcd.keys_deleted:
        typer.echo(f"{name}: deleted with their leases: {', '.join(done.etcd.keys_deleted)}")
    typer.echo(f"{name}: NATS login removed from {', '.join(configs) or 'no server config'}")
    typer.echo(f"recorded: {done.record}" + ("" if audited else f" (no audit log at {audit_log})"))
    if configs and reload_error:
        raise fail(
            f"node={name!r}: nats-server was not reloaded ({reload_error[0]}): it accepts the "
            "node's login until it reads its config again: reload it by hand",
            code=1,
        )
    if configs and reloader is None:
        typer.echo(
            "nats-server accepts the node's login until it reads its config again: reload it "
            f"({_DEFAULT_RELOAD}), and copy the changed file to every NATS server",
            err=True,
        )
    elif configs and reloader is not None:
        typer.echo(
            f"nats-server reloaded ({reloader[0]}); copy {', '.join(configs)} to every "
            "other NATS server and reload it"
        )
