"""``sailor certs``: a deployment's CA, certificates, NATS logins, nats-server config, etcd RBAC.

Thin shell around the pure builders in ``sailor.coordination.security``: this module reads
the clock and the CA from disk, draws keys, serials and passwords, and writes files. Every
private key and every file holding a password is created with mode 0600 (never readable by
other users, even for an instant: the mode is set when the file is created).

Layout of DIR::

    ca.crt, ca.key                  the CA (``init``)
    <name>.crt, <name>.key          a server or client certificate (``issue``)
    <name>.nats.json                the NATS login of a client with role controller or agent
    nats-server.conf                ``nats-config``: TLS, JetStream and every login's permissions
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import secrets
from enum import StrEnum
from pathlib import Path

import typer

from sailor.coordination.keys import Keys
from sailor.coordination.security.certs import (
    CertKind,
    build_ca,
    build_leaf,
    key_pem,
    load_ca,
    new_key,
)
from sailor.coordination.security.etcd_rbac import etcd_tls_flags, rbac_plan
from sailor.coordination.security.nats_auth import NatsRole, NatsUser, nats_server_config
from sailor.coordination.security.settings import SecurityConfig, read_nats_login

__all__ = ["Role", "certs_app", "init_ca", "issue_cert", "write_nats_config"]

certs_app = typer.Typer(
    help="CA, certificates and credentials for a deployment.", no_args_is_help=True
)


class Role(StrEnum):
    controller = "controller"
    agent = "agent"
    admin = "admin"  # an etcd operator (e.g. 'root'): a certificate, no NATS login


def _write(path: Path, data: bytes, secret: bool) -> None:
    """Write atomically enough for a CLI; secrets are created 0600 (umask cannot widen it)."""
    mode = 0o600 if secret else 0o644
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.fchmod(fd, mode)
        os.write(fd, data)
    finally:
        os.close(fd)


def _serial() -> int:
    return secrets.randbits(120) + 1  # positive, below RFC 5280's 20-octet limit


def init_ca(directory: Path, name: str, days: int, force: bool = False) -> Path:
    """Create DIR/ca.crt and DIR/ca.key; refuses to replace an existing CA unless ``force``."""
    directory.mkdir(parents=True, exist_ok=True)
    if (directory / "ca.key").exists() and not force:
        raise FileExistsError(f"{directory / 'ca.key'} exists (use --force to replace the CA)")
    key = new_key()
    cert = build_ca(key, name, dt.datetime.now(dt.UTC), days, _serial())
    _write(directory / "ca.key", key_pem(key), secret=True)
    _write(directory / "ca.crt", cert, secret=False)
    return directory / "ca.crt"


def issue_cert(
    directory: Path,
    name: str,
    kind: CertKind,
    hosts: tuple[str, ...] = (),
    role: Role | None = None,
    days: int = 825,
) -> list[Path]:
    """Issue ``name``'s certificate (and NATS login for controller/agent clients)."""
    ca_cert, ca_key = load_ca(
        (directory / "ca.crt").read_bytes(), (directory / "ca.key").read_bytes()
    )
    issued = build_leaf(
        ca_cert, ca_key, new_key(), name, kind, hosts, dt.datetime.now(dt.UTC), days, _serial()
    )
    crt, key = directory / f"{name}.crt", directory / f"{name}.key"
    _write(key, issued.key_pem, secret=True)
    _write(crt, issued.cert_pem, secret=False)
    written = [crt, key]
    if kind is CertKind.client and role in (Role.controller, Role.agent):
        login = {"user": name, "password": secrets.token_urlsafe(24), "role": role.value}
        path = directory / f"{name}.nats.json"
        _write(path, (json.dumps(login) + "\n").encode(), secret=True)
        written.append(path)
    return written


def write_nats_config(
    directory: Path, job: str, listen: str, store_dir: Path, server: str, verify: bool = True
) -> Path:
    """DIR/nats-server.conf from every ``*.nats.json`` login in DIR (0600: it holds passwords)."""
    users = []
    for path in sorted(directory.glob("*.nats.json")):
        login = read_nats_login(path)
        users.append(NatsUser(login.user, login.password.get_secret_value(), NatsRole(login.role)))
    text = nats_server_config(
        Keys(job=job),
        tuple(users),
        listen=listen,
        store_dir=store_dir,
        ca_file=(directory / "ca.crt").resolve(),
        cert_file=(directory / f"{server}.crt").resolve(),
        key_file=(directory / f"{server}.key").resolve(),
        verify_clients=verify,
    )
    out = directory / "nats-server.conf"
    _write(out, text.encode(), secret=True)
    return out


@certs_app.command("init")
def init_cmd(
    directory: Path = typer.Argument(..., help="Directory for the CA and certificates."),
    name: str = typer.Option("sailor-ca", "--name", help="CA common name."),
    days: int = typer.Option(3650, "--days", help="Validity in days."),
    force: bool = typer.Option(False, "--force", help="Replace an existing CA."),
) -> None:
    """Create a CA (DIR/ca.crt, DIR/ca.key mode 0600)."""
    try:
        path = init_ca(directory, name, days, force)
    except (FileExistsError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
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
    days: int = typer.Option(825, "--days", help="Validity in days."),
) -> None:
    """Issue a server or client certificate; controller/agent clients also get a NATS login."""
    try:
        paths = issue_cert(directory, name, kind, tuple(host), role, days)
    except (OSError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    for p in paths:
        typer.echo(f"written: {p}")


@certs_app.command("nats-config")
def nats_config_cmd(
    directory: Path = typer.Argument(..., help="Directory holding the CA and logins."),
    job: str = typer.Option("default", "--job", help="Job name (subjects are per job)."),
    listen: str = typer.Option("127.0.0.1:4222", "--listen", help="host:port to listen on."),
    store_dir: Path = typer.Option(Path("/var/lib/sailor/nats"), "--store-dir"),
    server: str = typer.Option("nats", "--server", help="Name of the server certificate."),
) -> None:
    """Write DIR/nats-server.conf: TLS, JetStream, users and permissions (mode 0600)."""
    typer.echo(f"written: {write_nats_config(directory, job, listen, store_dir, server)}")


@certs_app.command("etcd-flags")
def etcd_flags_cmd(
    directory: Path = typer.Argument(..., help="Directory holding the CA."),
    server: str = typer.Option("etcd", "--server", help="Name of the server certificate."),
) -> None:
    """Print the etcd flags for TLS with client-certificate authentication."""
    d = directory.resolve()
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
