"""Credentials out of server URLs before a URL is shown or stored.

A NATS URL may carry its login: ``nats://user:password@host:4222``, or a token alone as
``nats://token@host:4222`` (nats-py sends a user part without a password as the token).
Such a URL reaches node facts (``EndpointFacts``, carried by ``NodeJoined`` into the event
stream and the audit log), ``sailor check``'s lines, connection errors and the daemons' log
lines. Everything that shows or stores one passes it through :func:`redact_url` (one URL),
:func:`redact_urls` (a list, joined as the facts keep it) or :func:`redact_text` (free text
that may quote URLs: an error message, a validation error's input): the password becomes
``***`` and the user and host stay, so a reader still sees which login and server; a token
(no password) becomes ``***`` whole.

Pure: string functions only; must never connect, log or read a file.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from urllib.parse import urlsplit, urlunsplit

__all__ = ["REDACTED", "redact_text", "redact_url", "redact_urls"]

REDACTED = "***"
"""What stands for a password (or a token) in a redacted URL."""

# scheme://userinfo@ with userinfo ending at the last '@' before whitespace, '/' or ',' (a
# list of URLs joined by commas; a raw '@' in a password still ends up hidden)
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*://)(?P<userinfo>[^\s/,]*)@")


def _hidden(userinfo: str) -> str:
    """``user:***`` for ``user:password``; ``***`` for a token (no password)."""
    user, colon, _ = userinfo.partition(":")
    return f"{user}:{REDACTED}" if colon else REDACTED


def _hide(match: re.Match[str]) -> str:
    return f"{match['scheme']}{_hidden(match['userinfo'])}@"


def redact_text(text: str) -> str:
    """``text`` with every ``scheme://user:password@`` shown as ``scheme://user:***@`` and
    every ``scheme://token@`` as ``scheme://***@``; anything else unchanged."""
    return _USERINFO.sub(_hide, text)


def redact_url(url: str) -> str:
    """``url`` without its password (or token); unchanged when it has none."""
    try:
        parts = urlsplit(url)
    except ValueError:  # not a URL urlsplit takes (a bad IPv6 literal): hidden as text
        return redact_text(url)
    userinfo, at, host = parts.netloc.rpartition("@")
    if not at:
        return url
    return urlunsplit(parts._replace(netloc=f"{_hidden(userinfo)}@{host}"))


def redact_urls(urls: str | Sequence[str]) -> str:
    """One URL, or several joined by commas (as node facts keep a server list), redacted."""
    listed = [urls] if isinstance(urls, str) else list(urls)
    return ",".join(redact_url(u) for u in listed)
