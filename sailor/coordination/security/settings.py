"""The daemons' security settings (opt-in): which CA, certificate, key and NATS login to use.

Holds *paths*, never secrets: the NATS password is read from its 0600 file only when
connecting, and comes back as a ``SecretStr`` so that a repr, a log line or a JSON dump of
any config shows ``**********``. ``ssl_context`` builds the client side of TLS for NATS.
"""

from __future__ import annotations

import ssl
from pathlib import Path

import structlog
from pydantic import Field, SecretStr, model_validator

from sailor.schemas._base import Frozen
from sailor.schemas.json_text import load_json

__all__ = ["NatsLogin", "SecurityConfig", "read_nats_login", "warn_if_unauthenticated"]

_log = structlog.get_logger("sailor.security")


def warn_if_unauthenticated(security: SecurityConfig | None, daemon: str, name: str) -> None:
    """One warning when a daemon starts without a ``security:`` section: plain TCP, no
    logins, no permissions, so anyone who reaches NATS or etcd can read and forge the
    job's commands, events and state (docs/operations.md#security)."""
    if security is None:
        _log.warning(
            "running_unauthenticated",
            daemon=daemon,
            name=name,
            why="no security: section: NATS and etcd without TLS, logins or permissions; "
            "anyone who reaches them can read and forge commands, events and state "
            "(docs/operations.md#security)",
        )


class NatsLogin(Frozen):
    """A NATS user and password, as written by ``sailor certs issue`` (``<name>.nats.json``)."""

    user: str = Field(min_length=1, description="NATS user name (the node id for an agent).")
    password: SecretStr = Field(description="NATS password (never logged).")
    role: str = Field(default="agent", description="controller or agent.")


class SecurityConfig(Frozen):
    """TLS and authentication for NATS and etcd; absent = plain TCP, no auth (development).

    A daemon reads relative paths from its config file's directory (``anchored``)."""

    ca_file: Path = Field(description="CA certificate (PEM) that signed the servers' certs.")
    cert_file: Path | None = Field(default=None, description="This client's certificate (PEM).")
    key_file: Path | None = Field(default=None, description="This client's private key (PEM).")
    nats_login_file: Path | None = Field(
        default=None, description="NATS user/password file (JSON, mode 0600)."
    )

    @model_validator(mode="after")
    def _pair(self) -> SecurityConfig:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError(
                f"cert_file and key_file go together (cert_file={self.cert_file}, "
                f"key_file={self.key_file})"
            )
        return self

    def anchored(self, base: Path) -> SecurityConfig:
        """These settings with relative paths taken from ``base`` (the directory of the
        config file that holds them: under systemd the working directory is ``/``)."""

        def under(p: Path | None) -> Path | None:
            return p if p is None or p.is_absolute() else base / p

        return self.model_copy(
            update={
                "ca_file": under(self.ca_file),
                "cert_file": under(self.cert_file),
                "key_file": under(self.key_file),
                "nats_login_file": under(self.nats_login_file),
            }
        )

    def ssl_context(self) -> ssl.SSLContext:
        """Client TLS context: verify the server against the CA, present our certificate."""
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(self.ca_file))
        if self.cert_file is not None and self.key_file is not None:
            ctx.load_cert_chain(str(self.cert_file), str(self.key_file))
        return ctx

    def grpc_pem(self) -> tuple[bytes, bytes | None, bytes | None]:
        """(CA, key, certificate) bytes for grpc's ``ssl_channel_credentials``."""
        ca = self.ca_file.read_bytes()
        key = None if self.key_file is None else self.key_file.read_bytes()
        cert = None if self.cert_file is None else self.cert_file.read_bytes()
        return ca, key, cert

    def nats_login(self) -> NatsLogin | None:
        return None if self.nats_login_file is None else read_nats_login(self.nats_login_file)


def read_nats_login(path: Path) -> NatsLogin:
    """Read a login file; the error names the file, never its content."""
    try:
        return NatsLogin.model_validate(load_json(path.read_text(), str(path)))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a NATS login file ({type(exc).__name__})") from None
