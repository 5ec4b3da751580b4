"""The file half of a revocation (``sailor certs revoke``): a node's NATS login leaves the
generated nats-server configs and the login directory, a record is kept, and the revoked
name cannot be issued again. The etcd and nats-server half:
tests/integration/test_security_revoke.py."""

from __future__ import annotations

import datetime as dt
import json
import stat
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sailor.cli.main import app
from sailor.coordination.security.certs import CertKind
from sailor.coordination.security.pki import (
    Role,
    init_ca,
    issue_cert,
    record_revocation,
    remove_nats_login,
    revoked_record,
    write_nats_config,
)


def _pki(tmp_path: Path) -> Path:
    d = tmp_path / "pki"
    init_ca(d, "ca", days=1)
    issue_cert(d, "nats", CertKind.server, days=1)
    issue_cert(d, "controller", CertKind.client, role=Role.controller, days=1)
    for node in ("n1", "n2"):
        issue_cert(d, node, CertKind.client, role=Role.agent, days=1)
    return d


def _users(conf: Path) -> list[str]:
    body = conf.read_text().split("\n", 1)[1]
    body = body.removeprefix("authorization: ")
    data = json.loads(body)
    auth = data.get("authorization", data)
    return [u["user"] for u in auth["users"]]


def test_the_login_leaves_both_generated_configs_and_stays_gone(tmp_path: Path) -> None:
    d = _pki(tmp_path)
    full = write_nats_config(d, "j", "127.0.0.1:4222", tmp_path / "js", "nats")
    only = write_nats_config(d, "j", "", tmp_path / "js", "nats", authorization_only=True)
    assert _users(full) == _users(only) == ["controller", "n1", "n2"]
    full_before = json.loads(full.read_text().split("\n", 1)[1])

    changed = remove_nats_login(d, "n1")
    assert changed == [only, full, d / "n1.nats.json"]
    assert _users(full) == _users(only) == ["controller", "n2"]
    assert not (d / "n1.nats.json").exists()
    for conf in (full, only):
        assert stat.S_IMODE(conf.stat().st_mode) == 0o600  # still holds passwords
    # everything else of the server config is as it was
    full_after = json.loads(full.read_text().split("\n", 1)[1])
    del full_before["authorization"], full_after["authorization"]
    assert full_after == full_before
    # idempotent, and a later nats-config does not bring the login back
    assert remove_nats_login(d, "n1") == []
    write_nats_config(d, "j", "", tmp_path / "js", "nats", authorization_only=True)
    assert _users(only) == ["controller", "n2"]


def test_a_config_not_written_by_nats_config_is_refused_naming_it(tmp_path: Path) -> None:
    d = _pki(tmp_path)
    hand = d / "nats-authorization.conf"
    hand.write_text("authorization { users: [ {user: n1, password: x} ] }\n")
    with pytest.raises(ValueError, match=r"nats-authorization\.conf: not a file written by"):
        remove_nats_login(d, "n1")
    assert (d / "n1.nats.json").exists()  # nothing was removed


def test_a_revoked_name_is_recorded_and_never_issued_again(tmp_path: Path) -> None:
    d = _pki(tmp_path)
    assert revoked_record(d, "n1") is None
    path = record_revocation(d, "n1", "op@head", dt.datetime(2026, 1, 2, tzinfo=dt.UTC))
    rec = revoked_record(d, "n1")
    assert rec is not None and path == d / "n1.revoked.json"
    assert rec["by"] == "op@head" and rec["revoked_at"].startswith("2026-01-02")
    assert "serial" in rec and "not_after" in rec  # the certificate stays valid until then
    with pytest.raises(ValueError, match="name='n1' was revoked"):
        issue_cert(d, "n1", CertKind.client, role=Role.agent, days=1, force=True)
    issue_cert(d, "n3", CertKind.client, role=Role.agent, days=1)  # another id is fine


def test_etcd_rbac_refuses_a_revoked_node_before_connecting(tmp_path: Path) -> None:
    """Re-running ``certs etcd-rbac`` with every node (as after adding one) would create the
    revoked node's user again, and its old certificate would log in as it."""
    d = _pki(tmp_path)
    issue_cert(d, "root", CertKind.client, role=Role.admin, days=1)
    record_revocation(d, "n1", "op", dt.datetime.now(dt.UTC))
    argv = ["certs", "etcd-rbac", str(d), "--endpoint", "127.0.0.1:1", "--node", "n2"]
    res = CliRunner().invoke(app, [*argv, "--node", "n1"])
    assert res.exit_code == 1 and "node='n1' was revoked" in res.output
