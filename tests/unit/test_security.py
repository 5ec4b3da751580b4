"""Pure security builders: certificates, NATS permissions and config, etcd RBAC; redaction."""

from __future__ import annotations

import datetime as dt
import json
import stat
from pathlib import Path

import pytest
import structlog
from cryptography import x509
from typer.testing import CliRunner

from sailor.agent.agent_config import AgentConfig
from sailor.cli.main import app
from sailor.coordination.etcd_store import EtcdStore
from sailor.coordination.keys import Keys
from sailor.coordination.security import SecurityConfig, read_nats_login
from sailor.coordination.security.certs import CertKind, build_ca, build_leaf, new_key
from sailor.coordination.security.etcd_rbac import REVISION_PROBE, Perm, prefix_end, rbac_plan
from sailor.coordination.security.nats_auth import NatsRole, NatsUser, nats_server_config
from sailor.localservers import Identities

NOW = dt.datetime(2025, 1, 1, tzinfo=dt.UTC)


def test_server_cert_is_signed_by_the_ca_and_names_loopback_and_hosts() -> None:
    ca_key = new_key()
    ca_pem = build_ca(ca_key, "ca", NOW, 10, serial=1)
    ca_cert = x509.load_pem_x509_certificate(ca_pem)
    leaf = build_leaf(
        ca_cert, ca_key, new_key(), "etcd", CertKind.server, ("10.0.0.5", "e.x"), NOW, 5, 2
    )
    cert = x509.load_pem_x509_certificate(leaf.cert_pem)
    cert.verify_directly_issued_by(ca_cert)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(v) for v in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1", "10.0.0.5"]
    assert san.get_values_for_type(x509.DNSName) == ["localhost", "e.x"]
    assert cert.not_valid_after_utc == NOW + dt.timedelta(days=5)


def test_client_cert_carries_the_identity_as_common_name_and_no_sans() -> None:
    ca_key = new_key()
    ca_cert = x509.load_pem_x509_certificate(build_ca(ca_key, "ca", NOW, 10, 1))
    leaf = build_leaf(ca_cert, ca_key, new_key(), "node-a", CertKind.client, (), NOW, 5, 3)
    cert = x509.load_pem_x509_certificate(leaf.cert_pem)
    cn = cert.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)[0].value
    assert cn == "node-a"
    with pytest.raises(x509.ExtensionNotFound):
        cert.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    with pytest.raises(ValueError, match="days"):
        build_leaf(ca_cert, ca_key, new_key(), "x", CertKind.client, (), NOW, 0, 4)


def test_nats_permissions_confine_an_agent_to_its_node() -> None:
    keys = Keys(job="j")
    conf = json.loads(
        nats_server_config(
            keys,
            (NatsUser("ctl", "p1", NatsRole.controller), NatsUser("n1", "p2", NatsRole.agent)),
            "127.0.0.1:4222",
            Path("/s"),
            Path("/ca"),
            Path("/c"),
            Path("/k"),
        ).split("\n", 1)[1]
    )
    ctl, agent = conf["authorization"]["users"]
    assert agent["permissions"]["publish"]["allow"] == ["sailor.j.events.n1.>"]
    assert agent["permissions"]["subscribe"]["allow"] == ["sailor.j.cmd.n1", "_INBOX_n1.>"]
    assert agent["permissions"]["allow_responses"] is True
    assert "sailor.j.cmd.*" in ctl["permissions"]["publish"]["allow"]
    assert keys.event_subject("node_joined", "n1").startswith("sailor.j.events.n1.")
    assert "p2" not in repr(NatsUser("n1", "p2", NatsRole.agent))
    with pytest.raises(ValueError, match="duplicate"):
        nats_server_config(
            keys, (NatsUser("a", "x", NatsRole.agent),) * 2, "l", Path(), Path(), Path(), Path()
        )


def test_rbac_plan_grants_agents_only_their_own_keys() -> None:
    keys = Keys(job="j")
    plan = rbac_plan(keys, ("ctl",), ("n1",))
    roles = {r.name: r for r in plan.roles}
    agent = roles["sailor/j/node/n1"]
    rw = [(p.key, p.range_end) for p in agent.permissions if p.perm is Perm.readwrite]
    assert rw == [(b"/sailor/j/nodes/n1", b""), (b"/sailor/j/status/n1", b"")]
    ctl = roles["sailor/j/controller"].permissions[0]
    assert (ctl.key, ctl.range_end) == (b"/sailor/j/", b"/sailor/j0")
    assert dict(plan.users)["root"] == ("root",)
    assert prefix_end(b"a\xff") == b"b"
    with pytest.raises(ValueError):
        rbac_plan(keys, ("x",), ("x",))


def test_revision_probe_key_matches_the_store() -> None:
    import inspect

    assert REVISION_PROBE.decode() in inspect.getsource(EtcdStore.revision).replace("\\x00", "\x00")


def test_certs_cli_writes_secrets_0600_and_configs_never_show_passwords(tmp_path: Path) -> None:
    d = tmp_path / "pki"
    run = CliRunner()
    for argv in (
        ["certs", "init", str(d)],
        ["certs", "issue", str(d), "--name", "nats", "--kind", "server", "--host", "nats.x"],
        ["certs", "issue", str(d), "--name", "node-a", "--kind", "client"],
        ["certs", "nats-config", str(d), "--job", "j", "--store-dir", str(tmp_path / "js")],
    ):
        res = run.invoke(app, argv)
        assert res.exit_code == 0, res.output
    for name in ("ca.key", "nats.key", "node-a.key", "node-a.nats.json", "nats-server.conf"):
        assert stat.S_IMODE((d / name).stat().st_mode) == 0o600, name
    assert run.invoke(app, ["certs", "init", str(d)]).exit_code == 1  # never replace a CA
    # a server certificate for loopback only is said to be one (peers on other VMs fail TLS)
    res = run.invoke(app, ["certs", "issue", str(d), "--name", "etcd", "--kind", "server"])
    assert res.exit_code == 0 and "names only localhost and 127.0.0.1" in res.stderr
    assert (
        "names only"
        not in run.invoke(
            app,
            ["certs", "issue", str(d), "--name", "e2", "--kind", "server", "--host", "10.0.0.2"],
        ).stderr
    )
    password = read_nats_login(d / "node-a.nats.json").password.get_secret_value()
    sec = SecurityConfig(
        ca_file=d / "ca.crt",
        cert_file=d / "node-a.crt",
        key_file=d / "node-a.key",
        nats_login_file=d / "node-a.nats.json",
    )
    login = sec.nats_login()
    assert login is not None
    cfg = AgentConfig.model_validate(
        {
            "node": {"node_id": "node-a", "gpu_type": "A100-40", "gpus": 1, "zone": "z"},
            "security": sec.model_dump(mode="json"),
        }
    )
    with structlog.testing.capture_logs() as logs:
        structlog.get_logger("t").info("config", cfg=cfg, login=login)
    for text in (
        repr(login),
        login.model_dump_json(),
        str(login),
        cfg.model_dump_json(),
        repr(logs),
    ):
        assert password not in text
    (tmp_path / "bad.json").write_text(json.dumps({"user": "u", "password": password, "x": 1}))
    with pytest.raises(ValueError) as info:
        read_nats_login(tmp_path / "bad.json")
    assert password not in str(info.value)


def test_an_agent_reads_its_security_files_relative_to_its_config() -> None:
    """Under systemd the working directory is ``/``: relative CA, key and login paths are the
    config file's neighbours; absolute ones and the work_dir it writes stay as given."""
    from sailor.schemas import NodeSpec

    node = NodeSpec(node_id="n1", gpu_type="cpu", gpus=1, zone="z", address="127.0.0.1")
    sec = SecurityConfig(
        ca_file=Path("ca.pem"),
        cert_file=Path("/abs/n1.pem"),
        key_file=Path("keys/n1.key"),
        nats_login_file=Path("n1.nats.json"),
    )
    cfg = AgentConfig(node=node, security=sec, work_dir=Path("w")).anchored(
        Path("/etc/sailor/agent.yaml")
    )
    assert cfg.security == SecurityConfig(
        ca_file=Path("/etc/sailor/ca.pem"),
        cert_file=Path("/abs/n1.pem"),
        key_file=Path("/etc/sailor/keys/n1.key"),
        nats_login_file=Path("/etc/sailor/n1.nats.json"),
    )
    assert cfg.work_dir == Path("w")
    plain = AgentConfig(node=node)
    assert plain.anchored(Path("/etc/sailor/agent.yaml")) == plain


def test_certs_issue_refuses_a_path_as_name_and_an_overwrite(tmp_path: Path) -> None:
    """A name is a node id and a file name in DIR: ``../x`` would write outside it. Issuing
    a name again would silently replace its key and NATS password (the server's config
    would then refuse that node): only with --force."""
    d = tmp_path / "pki"
    run = CliRunner().invoke
    assert run(app, ["certs", "init", str(d)]).exit_code == 0
    bad = run(app, ["certs", "issue", str(d), "--name", "../evil", "--kind", "client"])
    assert bad.exit_code == 1 and "name='../evil'" in bad.output
    assert not (tmp_path / "evil.key").exists()
    args = ["certs", "issue", str(d), "--name", "gpu-node-1", "--kind", "client"]
    assert run(app, args).exit_code == 0
    login = (d / "gpu-node-1.nats.json").read_text()
    again = run(app, args)
    assert again.exit_code == 1 and "--force" in again.output
    assert (d / "gpu-node-1.nats.json").read_text() == login  # untouched
    assert run(app, [*args, "--force"]).exit_code == 0
    assert (d / "gpu-node-1.nats.json").read_text() != login


def test_logins_whose_nats_tokens_clash_are_refused(tmp_path: Path) -> None:
    """``gpu.1`` and ``gpu_1`` map to one NATS subject token: one command subject, one
    event subject, one reply inbox, so either agent would read the other's commands,
    answer them and publish its events. Refused when a login is issued beside an existing
    one, when the server config is written, and by the local servers' identities."""
    d = tmp_path / "pki"
    run = CliRunner().invoke
    assert run(app, ["certs", "init", str(d)]).exit_code == 0
    first = ["certs", "issue", str(d), "--name", "gpu_1", "--kind", "client"]
    assert run(app, first).exit_code == 0
    clash = run(app, ["certs", "issue", str(d), "--name", "gpu.1", "--kind", "client"])
    assert clash.exit_code == 1
    assert "name='gpu.1'" in clash.output and "'gpu_1'" in clash.output
    assert not (d / "gpu.1.nats.json").exists() and not (d / "gpu.1.key").exists()
    assert run(app, [*first, "--force"]).exit_code == 0  # its own login again: no clash
    # a server certificate has no login: nothing to clash with
    server = ["certs", "issue", str(d), "--name", "gpu.1", "--kind", "server"]
    assert run(app, server).exit_code == 0
    users = (
        NatsUser("gpu_1", "p1", NatsRole.agent),
        NatsUser("gpu.1", "p2", NatsRole.agent),
        NatsUser("c1", "p3", NatsRole.controller),
    )
    with pytest.raises(ValueError, match=r"\('gpu.1', 'gpu_1'\)"):
        nats_server_config(
            Keys(job="j"), users, "127.0.0.1:4222", d, d / "ca.crt", d / "a", d / "b"
        )
    with pytest.raises(ValueError, match=r"\('gpu.1', 'gpu_1'\)"):
        Identities(agents=("gpu_1", "gpu.1"))
    with pytest.raises(ValueError, match="share a NATS subject token"):
        Identities(controllers=("ctl.a",), agents=("ctl_a",))


def test_certs_cli_refuses_a_bad_job_name(tmp_path: Path) -> None:
    d = tmp_path / "pki"
    run = CliRunner().invoke
    assert run(app, ["certs", "init", str(d)]).exit_code == 0
    bad = run(app, ["certs", "nats-config", str(d), "--job", "a/b"])
    assert bad.exit_code != 0 and "job='a/b'" in bad.output
