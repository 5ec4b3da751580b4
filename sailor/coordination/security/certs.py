"""Building a deployment's X.509 certificates: a CA, server and client certificates.

Pure: every function takes the keys, names and validity window as values and returns PEM
bytes; nothing here reads the clock, the disk or the environment (``sailor certs`` does that
around it). Keys are ECDSA P-256: small, fast to sign on a spot VM at boot, and accepted by
Go's TLS (nats-server, etcd) and by OpenSSL (Python's ``ssl``, grpc).

A server certificate carries the SANs clients dial (``127.0.0.1`` and ``localhost`` always,
plus the given hosts) and ``serverAuth``; a client certificate carries ``clientAuth`` and the
identity in its common name, which etcd's ``--client-cert-auth`` uses as the user name for
RBAC. Must never import NATS or etcd clients.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import re
from dataclasses import dataclass
from enum import StrEnum

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = [
    "CertKind",
    "IssuedCert",
    "build_ca",
    "build_leaf",
    "check_host",
    "key_pem",
    "load_ca",
    "new_key",
    "sans_for",
]

DEFAULT_HOSTS: tuple[str, ...] = ("127.0.0.1", "localhost")
"""Every server certificate names these, so a co-located client and the tests can dial it."""


class CertKind(StrEnum):
    """What a leaf certificate is for."""

    server = "server"
    client = "client"


@dataclass(frozen=True, slots=True)
class IssuedCert:
    """A certificate and its private key, both PEM."""

    cert_pem: bytes
    key_pem: bytes


def new_key() -> ec.EllipticCurvePrivateKey:
    """A fresh P-256 private key (the only randomness in this module)."""
    return ec.generate_private_key(ec.SECP256R1())


def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    """PKCS#8 PEM, unencrypted: its 0600 mode protects it (daemons start unattended)."""
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "sailor"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def build_ca(
    key: ec.EllipticCurvePrivateKey,
    name: str,
    now: dt.datetime,
    days: int,
    serial: int,
) -> bytes:
    """A self-signed CA certificate (path length 0: it signs leaves only)."""
    if days <= 0:
        raise ValueError(f"days must be positive, got {days}")
    subject = _name(name)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(serial)
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM)


_DNS_LABEL = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)")
"""One label of a DNS name: letters, digits, ``-`` (not first or last) and ``_`` (which Go's
TLS, nats-server's and etcd's, accepts in a name it verifies)."""


def check_host(host: str) -> None:
    """Refuse a SAN that is neither an IP address nor a DNS name (labels of
    :data:`_DNS_LABEL` joined by dots, 253 characters at most; the first label may be ``*``,
    a wildcard): a client dialling ``"bad host"`` could never match it, and the mistake (a
    space, a ``host:port``, a URL) would show only as a TLS failure on another VM."""
    try:
        ipaddress.ip_address(host)
        return
    except ValueError:
        pass
    labels = host.split(".")
    if labels[0] == "*" and len(labels) > 1:
        labels = labels[1:]
    if 0 < len(host) <= 253 and all(_DNS_LABEL.fullmatch(label) for label in labels):
        return
    raise ValueError(
        f"host={host!r}: not an IP address or a DNS name (letters, digits, '-' and '_' in "
        "dot-separated labels, no spaces, port or scheme): give each address or name "
        "clients dial as its own --host"
    )


def sans_for(hosts: tuple[str, ...]) -> list[x509.GeneralName]:
    """IP SANs for addresses, DNS SANs for names; the defaults first, no duplicates. A host
    that is neither is refused (:func:`check_host`)."""
    out: list[x509.GeneralName] = []
    seen: set[str] = set()
    for host in (*DEFAULT_HOSTS, *hosts):
        if not host or host in seen:
            continue
        check_host(host)
        seen.add(host)
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            out.append(x509.DNSName(host))
    return out


def load_ca(
    cert_pem: bytes, key_pem_bytes: bytes
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """Parse a CA written by ``build_ca``; refuses a key that is not P-256."""
    cert = x509.load_pem_x509_certificate(cert_pem)
    key = serialization.load_pem_private_key(key_pem_bytes, password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"CA key must be an EC key, got {type(key).__name__}")
    return cert, key


def build_leaf(
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    key: ec.EllipticCurvePrivateKey,
    name: str,
    kind: CertKind,
    hosts: tuple[str, ...],
    now: dt.datetime,
    days: int,
    serial: int,
) -> IssuedCert:
    """A server or client certificate for ``name`` signed by the CA.

    Server certificates also allow ``clientAuth`` so that one etcd member can dial another
    with the same certificate; client certificates name no hosts.
    """
    if days <= 0:
        raise ValueError(f"days must be positive, got {days}")
    if not name:
        raise ValueError("name must not be empty")
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH]
    if kind is CertKind.server:
        usages.insert(0, ExtendedKeyUsageOID.SERVER_AUTH)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(name))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(serial)
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=True,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
    )
    if kind is CertKind.server:
        builder = builder.add_extension(
            x509.SubjectAlternativeName(sans_for(hosts)), critical=False
        )
    cert = builder.sign(ca_key, hashes.SHA256())
    return IssuedCert(cert.public_bytes(serialization.Encoding.PEM), key_pem(key))
