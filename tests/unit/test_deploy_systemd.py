"""deploy/systemd: every unit passes ``systemd-analyze verify`` with no warning, is hardened,
and the daemons' units are ``Type=notify`` with a watchdog.

``systemd-analyze`` works without a running systemd. ``verify`` also checks that ExecStart
binaries exist, so each unit is verified from a copy whose ``/opt/sailor/venv`` (where the
units expect the install) points at this checkout's venv, which has the same executables.
"""

from __future__ import annotations

import configparser
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
UNITS = ROOT / "deploy" / "systemd"
VENV = Path(sys.executable).parent.parent
ANALYZE = shutil.which("systemd-analyze")
PACKAGED_ETCD = Path("/lib/systemd/system/etcd.service")

needs_analyze = pytest.mark.skipif(
    ANALYZE is None, reason="systemd-analyze not installed (apt-get install systemd)"
)

SERVICES = sorted(p.name for p in UNITS.glob("*.service"))


def _local_copy(text: str, tmp: Path, name: str) -> Path:
    out = tmp / name
    out.write_text(text.replace("/opt/sailor/venv", str(VENV)))
    return out


def _verify(unit: Path) -> subprocess.CompletedProcess[str]:
    assert ANALYZE is not None
    return subprocess.run(
        [ANALYZE, "verify", "--man=no", str(unit)],
        capture_output=True,
        text=True,
        timeout=30,
    )


def _directives(path: Path) -> dict[str, list[str]]:
    """key -> values in the [Service] section (keys may repeat)."""
    out: dict[str, list[str]] = {}
    section = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            section = line
            continue
        if section == "[Service]":
            k, _, v = line.partition("=")
            out.setdefault(k, []).append(v)
    return out


def test_expected_units_exist() -> None:
    assert SERVICES == ["sailor-agent.service", "sailor-controller.service", "sailor-nats.service"]
    assert (UNITS / "etcd.service.d" / "sailor.conf").is_file()
    assert (UNITS / "sailor.sysusers.conf").read_text().count("\nu sailor ") == 1


@needs_analyze
@pytest.mark.parametrize("name", SERVICES)
def test_unit_verifies_without_warnings(name: str, tmp_path: Path) -> None:
    unit = _local_copy((UNITS / name).read_text(), tmp_path, name)
    res = _verify(unit)
    assert res.returncode == 0, res.stderr
    assert res.stderr.strip() == "", res.stderr


@needs_analyze
def test_verify_catches_a_misspelled_directive(tmp_path: Path) -> None:
    """The check above is meaningful: a typo in a hardening key is reported."""
    text = (UNITS / "sailor-controller.service").read_text()
    unit = _local_copy(text.replace("ProtectSystem=", "ProtectSytem="), tmp_path, "typo.service")
    assert "Unknown key" in _verify(unit).stderr


@needs_analyze
@pytest.mark.skipif(not PACKAGED_ETCD.is_file(), reason="Debian etcd-server not installed")
def test_etcd_dropin_verifies_on_the_packaged_unit(tmp_path: Path) -> None:
    merged = PACKAGED_ETCD.read_text() + "\n" + (UNITS / "etcd.service.d/sailor.conf").read_text()
    res = _verify(_local_copy(merged, tmp_path, "etcd.service"))
    assert res.returncode == 0 and res.stderr.strip() == "", res.stderr


@pytest.mark.parametrize("name", ["sailor-controller.service", "sailor-agent.service"])
def test_daemon_units_notify_watchdog_restart(name: str) -> None:
    d = _directives(UNITS / name)
    assert d["Type"] == ["notify"]
    assert d["NotifyAccess"] == ["main"]
    assert d["WatchdogSec"][0].endswith("s") and int(d["WatchdogSec"][0][:-1]) >= 10
    assert d["Restart"] == ["always"]
    kind = name.removeprefix("sailor-").removesuffix(".service")
    assert d["ExecStart"] == [
        f"/opt/sailor/venv/bin/sailor {kind} --config /etc/sailor/{kind}.yaml"
    ]
    # the agent first loads nvidia-uvm privileged (its sandbox forbids the setuid helper CUDA
    # would use), ignoring a failure (no GPU, no driver)
    modprobe = ["-+/usr/bin/nvidia-modprobe -u -c=0"] if kind == "agent" else []
    assert d["ExecStartPre"] == [
        *modprobe,
        f"/opt/sailor/venv/bin/sailor config check --kind {kind} /etc/sailor/{kind}.yaml",
    ]
    assert d["EnvironmentFile"] == [f"-/etc/sailor/{kind}.env"]


@pytest.mark.parametrize("name", SERVICES)
def test_units_are_hardened(name: str) -> None:
    d = _directives(UNITS / name)
    for key, value in {
        "User": "sailor",
        "Group": "sailor",
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "CapabilityBoundingSet": "",
        "AmbientCapabilities": "",
        "RestrictSUIDSGID": "yes",
    }.items():
        assert d.get(key) == [value], (name, key, d.get(key))
    assert d.get("StateDirectory"), name


def test_agent_keeps_what_gpus_need() -> None:
    d = _directives(UNITS / "sailor-agent.service")
    # /dev/nvidia* and JIT-compiled kernels must stay usable.
    for key in ("PrivateDevices", "DevicePolicy", "MemoryDenyWriteExecute", "SystemCallFilter"):
        assert key not in d, key
    assert d["KillMode"] == ["mixed"]
    assert "-/srv/sailor/checkpoints" in d["ReadWritePaths"]


@needs_analyze
@pytest.mark.parametrize(
    ("name", "limit"),
    [
        ("sailor-controller.service", 2.0),
        ("sailor-nats.service", 2.0),
        ("sailor-agent.service", 4.0),
    ],
)
def test_security_exposure_stays_low(name: str, limit: float, tmp_path: Path) -> None:
    assert ANALYZE is not None
    unit = _local_copy((UNITS / name).read_text(), tmp_path, name)
    res = subprocess.run(
        [ANALYZE, "security", "--offline=true", f"--threshold={int(limit * 10)}", str(unit)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert res.returncode == 0, res.stdout[-400:]


def test_nats_config_is_valid(tmp_path: Path) -> None:
    nats = VENV / "bin" / "nats-server"
    if not nats.is_file():
        pytest.skip("nats-server not installed (make install-servers)")
    from sailor.coordination.security.certs import CertKind
    from sailor.coordination.security.pki import Role, init_ca, issue_cert, write_nats_config

    conf = (ROOT / "deploy/config/nats-server.conf").read_text()
    assert 'store_dir: "/var/lib/sailor-nats"' in conf  # the unit's StateDirectory
    assert "verify: true" in conf and 'include "pki/nats-authorization.conf"' in conf
    # the PKI `sailor certs` makes, where the config expects it (relative to the config)
    pki = tmp_path / "pki"
    init_ca(pki, "ca", days=1)
    issue_cert(pki, "nats", CertKind.server, days=1)
    issue_cert(pki, "controller", CertKind.client, role=Role.controller, days=1)
    issue_cert(pki, "gpu-node-1", CertKind.client, role=Role.agent, days=1)
    write_nats_config(pki, "default", "", tmp_path, "nats", authorization_only=True)
    local = tmp_path / "nats.conf"
    conf = conf.replace("/var/lib/sailor-nats", str(tmp_path / "js"))
    local.write_text(conf.replace("/etc/sailor/pki", str(pki)))
    res = subprocess.run([str(nats), "-c", str(local), "-t"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def test_etcd_defaults_parse() -> None:
    cp = configparser.ConfigParser()
    cp.optionxform = str  # type: ignore[assignment,method-assign]
    cp.read_string("[x]\n" + (ROOT / "deploy/config/etcd.default").read_text())
    env = dict(cp["x"])
    assert env["ETCD_DATA_DIR"] == "/var/lib/etcd/default"
    assert all(k.startswith("ETCD_") for k in env)
