"""A deployment's PKI directory on disk: CA, certificates, NATS logins, nats-server config.

The file-writing half of ``sailor certs`` (the pure builders are ``certs`` and
``nats_auth``), shared by the CLI and by the local servers that the demo, the tests and the
chaos suite start (:mod:`sailor.localservers`). Reads the clock, draws keys, serials and
passwords, writes files. Every private key and every file holding a password is created with
mode 0600 (never readable by other users, even for an instant: the mode is set when the file
is created). Must never import NATS or etcd clients.

Layout of DIR::

    ca.crt, ca.key                  the CA (``init_ca``)
    <name>.crt, <name>.key          a server or client certificate (``issue_cert``)
    <name>.nats.json                the NATS login of a client with role controller or agent
    nats-server.conf                ``write_nats_config``: TLS, JetStream and every login
    <name>.revoked.json             ``record_revocation``: the name's credentials were revoked
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import secrets
from collections.abc import Sequence
from enum import StrEnum
from pathlib import Path

from sailor.coordination.keys import Keys, safe_token
from sailor.coordination.security.certs import (
    CertKind,
    build_ca,
    build_leaf,
    key_pem,
    load_ca,
    new_key,
)
from sailor.coordination.security.nats_auth import (
    NatsRole,
    NatsUser,
    nats_authorization_config,
    nats_server_config,
)
from sailor.coordination.security.settings import read_nats_login
from sailor.schemas.json_text import load_json

__all__ = [
    "REVOKED_SUFFIX",
    "Role",
    "check_name",
    "init_ca",
    "issue_cert",
    "nats_login_role",
    "record_revocation",
    "remove_nats_login",
    "revoked_record",
    "write_nats_config",
]

_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")
"""A certificate name: a node id or server name, and a file name in the PKI directory."""


REVOKED_SUFFIX = ".revoked.json"
"""``DIR/<name>.revoked.json``: the record that ``name``'s credentials were revoked."""


class Role(StrEnum):
    controller = "controller"
    agent = "agent"
    admin = "admin"  # an etcd operator (e.g. 'root'): a certificate, no NATS login


def check_name(name: str) -> None:
    """Refuse a name that is no node id or server name (it names files in DIR)."""
    if not _NAME.fullmatch(name):
        raise ValueError(
            f"name={name!r}: use letters, digits, '.', '_' and '-' (a node id or server "
            "name), not starting with '.'; it names files in the directory"
        )


def _write(path: Path, data: bytes, secret: bool) -> None:
    """Write a file; secrets are created 0600 (umask cannot widen it)."""
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
    force: bool = False,
) -> list[Path]:
    """Issue ``name``'s certificate (and NATS login for controller/agent clients).

    ``name`` is a file name in ``directory`` and a node id or server name: letters, digits,
    ``.``, ``_`` and ``-``, not starting with a dot. An existing certificate, key or login
    of ``name`` is replaced only with ``force`` (a new login's password no longer matches
    the NATS server's configuration until ``certs nats-config`` is run again)."""
    check_name(name)
    if (directory / f"{name}{REVOKED_SUFFIX}").exists():
        # etcd takes the user from the certificate's common name: a new user of this name
        # would let the revoked certificate (valid until it expires: no revocation list) in
        raise ValueError(
            f"name={name!r} was revoked ({directory / (name + REVOKED_SUFFIX)}): its old "
            "certificate stays valid until it expires and would log in as the new one; "
            "give the node another id"
        )
    crt, key = directory / f"{name}.crt", directory / f"{name}.key"
    login_path = directory / f"{name}.nats.json"
    if kind is CertKind.client and role in (Role.controller, Role.agent):
        _refuse_token_clash(directory, name)
    if not force:
        there = [p for p in (crt, key, login_path) if p.exists()]
        if there:
            raise FileExistsError(
                f"{', '.join(str(p) for p in there)} exist: use --force to replace them (then "
                "re-run `sailor certs nats-config` for a new NATS password)"
            )
    ca_cert, ca_key = load_ca(
        (directory / "ca.crt").read_bytes(), (directory / "ca.key").read_bytes()
    )
    issued = build_leaf(
        ca_cert, ca_key, new_key(), name, kind, hosts, dt.datetime.now(dt.UTC), days, _serial()
    )
    _write(key, issued.key_pem, secret=True)
    _write(crt, issued.cert_pem, secret=False)
    written = [crt, key]
    if kind is CertKind.client and role in (Role.controller, Role.agent):
        login = {"user": name, "password": secrets.token_urlsafe(24), "role": role.value}
        _write(login_path, (json.dumps(login) + "\n").encode(), secret=True)
        written.append(login_path)
    return written


def _refuse_token_clash(directory: Path, name: str) -> None:
    """A new NATS login whose subject token is an existing login's (``gpu.1`` beside
    ``gpu_1``) would share all its permissions: refused, naming both."""
    logins = [p.name.removesuffix(".nats.json") for p in directory.glob("*.nats.json")]
    clash = [other for other in logins if other != name and safe_token(other) == safe_token(name)]
    if clash:
        raise ValueError(
            f"name={name!r}: its NATS subject token {safe_token(name)!r} is that of the "
            f"existing login {clash[0]!r} ('.' and other characters become '_'), so both "
            "would have the same NATS permissions; choose another name"
        )


def write_nats_config(
    directory: Path,
    job: str | Sequence[str],
    listen: str,
    store_dir: Path,
    server: str,
    verify: bool = True,
    authorization_only: bool = False,
) -> Path:
    """DIR/nats-server.conf from every ``*.nats.json`` login in DIR (0600: it holds passwords).

    ``job`` may name several jobs served by the one server; each login then gets its
    permissions in every one of them. ``authorization_only``: DIR/nats-authorization.conf
    with the users and permissions only, which deploy/config/nats-server.conf includes.
    """
    jobs = (job,) if isinstance(job, str) else tuple(job)
    users = []
    for path in sorted(directory.glob("*.nats.json")):
        login = read_nats_login(path)
        users.append(NatsUser(login.user, login.password.get_secret_value(), NatsRole(login.role)))
    if authorization_only:
        auth = directory / "nats-authorization.conf"
        text = nats_authorization_config(tuple(Keys(job=j) for j in jobs), tuple(users))
        _write(auth, text.encode(), secret=True)
        return auth
    text = nats_server_config(
        tuple(Keys(job=j) for j in jobs),
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


def revoked_record(directory: Path, name: str) -> dict[str, object] | None:
    """The revocation record of ``name`` in DIR, or None if it was never revoked."""
    path = directory / f"{name}{REVOKED_SUFFIX}"
    if not path.exists():
        return None
    data = load_json(path.read_text(), str(path))
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a revocation record (a JSON object)")
    return data


def nats_login_role(directory: Path, name: str) -> str | None:
    """The role of ``name``'s NATS login in DIR (agent, controller), or None without one."""
    path = directory / f"{name}.nats.json"
    return read_nats_login(path).role if path.exists() else None


_AUTH_FILES = ("nats-authorization.conf", "nats-server.conf")
"""The generated files in DIR that hold the logins nats-server accepts
(``write_nats_config``, with and without ``authorization_only``)."""


def _split_config(path: Path) -> tuple[str, str, str]:
    """(comment line, prefix before the JSON, JSON text) of a config ``write_nats_config``
    wrote; a file of any other shape is refused naming it."""
    text = path.read_text()
    head, _, body = text.partition("\n")
    prefix = "authorization: " if body.startswith("authorization: ") else ""
    if not head.startswith("# generated by `sailor certs nats-config") or not body.strip():
        raise ValueError(
            f"{path}: not a file written by `sailor certs nats-config`: remove the login "
            "from it by hand, or re-run `sailor certs nats-config` after the revocation"
        )
    return head, prefix, body[len(prefix) :]


def remove_nats_login(directory: Path, name: str) -> list[Path]:
    """Take ``name``'s login out of every generated nats-server config in DIR and delete
    its ``<name>.nats.json`` (so no later ``nats-config`` writes it back). Returns the files
    changed or deleted; none when the login is already gone (idempotent).

    nats-server accepts the logins its config names: the server must then reload it
    (``systemctl reload sailor-nats``, SIGHUP), which also disconnects the clients logged in
    as ``name``."""
    changed: list[Path] = []
    for file in _AUTH_FILES:
        path = directory / file
        if not path.exists():
            continue
        head, prefix, body = _split_config(path)
        try:
            conf = load_json(body, str(path))
        except ValueError:
            raise ValueError(
                f"{path}: its authorization is not the JSON `sailor certs nats-config` "
                "writes: remove the login by hand"
            ) from None
        auth = conf if prefix else conf.get("authorization", {})
        users = auth.get("users", [])
        kept = [u for u in users if u.get("user") != name]
        if len(kept) == len(users):
            continue
        auth["users"] = kept
        _write(path, f"{head}\n{prefix}{json.dumps(conf, indent=2)}\n".encode(), secret=True)
        changed.append(path)
    login = directory / f"{name}.nats.json"
    if login.exists():
        login.unlink()
        changed.append(login)
    return changed


def record_revocation(directory: Path, name: str, by: str, now: dt.datetime) -> Path:
    """Write DIR/<name>.revoked.json: when, by whom, and the certificate's serial and end
    of validity (it stays valid for TLS until then: there is no revocation list)."""
    path = directory / f"{name}{REVOKED_SUFFIX}"
    record: dict[str, object] = {"name": name, "revoked_at": now.isoformat(), "by": by}
    crt = directory / f"{name}.crt"
    if crt.exists():
        from cryptography import x509

        cert = x509.load_pem_x509_certificate(crt.read_bytes())
        record["serial"] = format(cert.serial_number, "x")
        record["not_after"] = cert.not_valid_after_utc.isoformat()
    _write(path, (json.dumps(record, sort_keys=True) + "\n").encode(), secret=False)
    return path
