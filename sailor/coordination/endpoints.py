"""Where the servers are: the etcd endpoints and NATS URLs of a daemon's configuration.

Production runs a 3-member etcd cluster and a NATS cluster, so both daemons take a list of
each (``etcd_endpoints``, ``nats_urls``); the clients fail over along it (nats-py cycles its
server pool itself; ``EtcdStore`` switches endpoint on connection errors, since aetcd talks to
one). A configuration written before the lists — ``etcd_endpoint: host:port`` and
``nats_url: nats://…`` — still loads: the old key is read as a list of one. Every entry is
checked on load, and an error names the field and the value.

Pure: parsing and validation only; must never connect to anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from sailor.schemas._base import Frozen
from sailor.schemas.redact import redact_text, redact_url

__all__ = [
    "ServerEndpoints",
    "check_etcd_endpoint",
    "check_nats_url",
    "distinct_nats_servers",
    "endpoint_list",
]

_LEGACY = {"etcd_endpoint": "etcd_endpoints", "nats_url": "nats_urls"}
NATS_SCHEMES = ("nats", "tls")


def _port(field: str, value: str, port: str) -> None:
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{field}: {value!r} has no valid port (1-65535)")


def check_etcd_endpoint(value: str, field: str = "etcd_endpoints") -> str:
    """``host:port`` (IPv6 as ``[::1]:2379``); returned unchanged."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or any(c.isspace() for c in value) or "/" in value:
        raise ValueError(f"{field}: {value!r} is not host:port")
    _port(field, value, port)
    return value


def check_nats_url(value: str, field: str = "nats_urls") -> str:
    """``nats://host:port`` or ``tls://host:port`` (a login in it, ``user:password@``, is
    allowed); returned unchanged. An error shows the value without its password."""
    shown = redact_url(value)
    try:
        url = urlsplit(value)
        port = url.port
    except ValueError:
        raise ValueError(f"{field}: {shown!r} is not a NATS URL (nats://host:port)") from None
    if url.scheme not in NATS_SCHEMES or not url.hostname or any(c.isspace() for c in value):
        raise ValueError(f"{field}: {shown!r} is not a NATS URL (nats://host:port)")
    if port is None:
        raise ValueError(f"{field}: {shown!r} has no port (nats://host:4222)")
    return value


def distinct_nats_servers(urls: Sequence[str]) -> int:
    """How many servers ``urls`` name: distinct host (case-insensitive) and port, whatever
    the scheme (``nats://a:4222`` and ``tls://a:4222`` are one server). A count of names,
    not of machines: two names of one host count twice, one name (a DNS name, a load
    balancer) fronting a cluster counts once."""
    return len({((u.hostname or "").lower(), u.port) for u in map(urlsplit, urls)})


def endpoint_list(value: str | Sequence[str], field: str) -> tuple[str, ...]:
    """A string (one server, or several separated by commas) or a list: a tuple, checked
    to be non-empty and without repeats."""
    items = value.split(",") if isinstance(value, str) else list(value)
    out = tuple(str(v).strip() for v in items)
    if not out or not all(out):
        raise ValueError(
            f"{field}: {redact_text(repr(value))} must name at least one server, none empty"
        )
    dupes = sorted({v for v in out if out.count(v) > 1})
    if dupes:
        raise ValueError(f"{field}: {redact_text(repr(dupes))} listed twice")
    check = check_etcd_endpoint if field.startswith("etcd") else check_nats_url
    return tuple(check(v, field) for v in out)


class ServerEndpoints(Frozen):
    """The servers part of the controller's and the agent's configuration."""

    nats_urls: tuple[str, ...] = Field(
        default=("nats://127.0.0.1:4222",),
        description="NATS servers (nats://host:port; every server of the cluster, the client "
        "fails over along the list). A single string is accepted; old key: nats_url.",
    )
    etcd_endpoints: tuple[str, ...] = Field(
        default=("127.0.0.1:2379",),
        description="etcd members (host:port each; the store fails over to the next one on a "
        "connection error). A single string is accepted; old key: etcd_endpoint.",
    )

    @model_validator(mode="before")
    @classmethod
    def _legacy_keys(cls, data: Any) -> Any:
        """``etcd_endpoint`` / ``nats_url`` (configurations before the lists)."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for old, new in _LEGACY.items():
            if old in data:
                if new in data:
                    raise ValueError(f"{old} and {new} both given: keep {new} only")
                data[new] = data.pop(old)
        return data

    @field_validator("nats_urls", "etcd_endpoints", mode="before")
    @classmethod
    def _lists(cls, value: Any, info: Any) -> tuple[str, ...]:
        if not isinstance(value, str | list | tuple):
            raise ValueError(
                f"{info.field_name}: {redact_text(repr(value))} is not a string or a list"
            )
        return endpoint_list(value, info.field_name)
