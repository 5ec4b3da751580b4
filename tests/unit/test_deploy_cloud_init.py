"""deploy/cloud-init/agent.yaml: valid cloud-config that installs, configures and starts the agent.

The embedded config script runs here against a fake ``nvidia-smi`` and ``cloud-init query``
and the config it writes must pass ``sailor config check``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from sailor.cli.config_cmd import Kind, check_config

ROOT = Path(__file__).resolve().parents[2]
CLOUD_INIT = ROOT / "deploy/cloud-init/agent.yaml"


def _doc() -> dict[str, Any]:
    text = CLOUD_INIT.read_text()
    assert text.startswith("#cloud-config\n")
    doc = yaml.safe_load(text)
    assert isinstance(doc, dict)
    return doc


def _file(path: str) -> str:
    files = {f["path"]: f for f in _doc()["write_files"]}
    return str(files[path]["content"])


def test_top_level_keys_and_boot_steps() -> None:
    doc = _doc()
    assert set(doc) == {"package_update", "packages", "write_files", "runcmd"}
    assert "python3-venv" in doc["packages"]
    cmds = [" ".join(c) if isinstance(c, list) else c for c in doc["runcmd"]]
    order = [
        "systemd-sysusers",
        "chown root:sailor $f",  # the node's key and login, once the user exists
        "python3 -m venv",
        "sailor-install",
        "sailor-agent-config",
        "config check",
        "daemon-reload",
        "enable --now sailor-agent.service",
    ]
    at = [next(i for i, c in enumerate(cmds) if step in c) for step in order]
    assert at == sorted(at), cmds
    env = _file("/etc/sailor/install.env")
    for var in (
        "SAILOR_PACKAGE=@SAILOR_PACKAGE@",
        "SAILOR_HEAD=@SAILOR_HEAD@",
        "SAILOR_JOB=@SAILOR_JOB@",
    ):
        assert var in env


def test_embedded_unit_and_sysusers_match_deploy_systemd() -> None:
    unit = (ROOT / "deploy/systemd/sailor-agent.service").read_text()
    assert _file("/etc/systemd/system/sailor-agent.service") == unit
    sysusers = (ROOT / "deploy/systemd/sailor.sysusers.conf").read_text()
    assert _file("/usr/lib/sysusers.d/sailor.conf") == sysusers


def _fake_bin(tmp: Path, gpus: str) -> Path:
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(f"#!/bin/sh\nprintf '{gpus}'\n")
    (bin_dir / "cloud-init").write_text(
        '#!/bin/sh\ncase "$2" in\n'
        "v1.instance_id) echo 5551234;;\n"
        "v1.availability_zone) echo europe-west4-a;;\n"
        "v1.cloud_name) echo ${FAKE_CLOUD:-gce};;\nesac\n"
    )
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return bin_dir


def _run_script(tmp: Path, gpus: str, **env: str) -> subprocess.CompletedProcess[str]:
    script = tmp / "sailor-agent-config"
    script.write_text(_file("/usr/local/sbin/sailor-agent-config"))
    bin_dir = _fake_bin(tmp, gpus)
    full = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SAILOR_HEAD": "10.0.0.2",
        "SAILOR_AGENT_CONFIG": str(tmp / "etc/agent.yaml"),
        **env,
    }
    return subprocess.run(
        ["bash", str(script)], env=full, capture_output=True, text=True, timeout=20
    )


@pytest.mark.parametrize(
    ("smi", "gpu", "count"),
    [
        ("NVIDIA A100-SXM4-40GB, 40960\\n" * 8, "A100-40", 8),
        ("NVIDIA A100-SXM4-80GB, 81920\\n" * 2, "A100-80", 2),
        ("NVIDIA H100 80GB HBM3, 81559\\n" * 8, "H100-80", 8),
        ("NVIDIA L4, 23034\\n", "L4", 1),
        ("Tesla T4, 15360\\n" * 4, "T4", 4),
    ],
)
def test_config_script_writes_a_valid_agent_config(
    tmp_path: Path, smi: str, gpu: str, count: int
) -> None:
    res = _run_script(tmp_path, smi, SAILOR_JOB="llm")
    assert res.returncode == 0, res.stderr
    out = tmp_path / "etc/agent.yaml"
    code, kind, messages = check_config(out, files=False)  # no PKI on this machine
    assert (code, kind, messages) == (0, Kind.agent, [])
    cfg = yaml.safe_load(out.read_text())
    assert cfg["job"] == "llm"
    assert cfg["node"] == {
        "node_id": "5551234",
        "gpu_type": gpu,
        "gpus": count,
        "zone": "europe-west4-a",
        "spot": True,
        "address": cfg["node"]["address"],
    }
    assert cfg["nats_urls"] == ["nats://10.0.0.2:4222"] and cfg["etcd_endpoints"] == [
        "10.0.0.2:2379"
    ]
    assert cfg["watchers"] == [
        {"kind": "gcp", "target": "http://metadata.google.internal"},
        {"kind": "file", "target": "/var/lib/sailor/drain"},
    ]


def test_config_script_lists_every_server_of_the_clusters(tmp_path: Path) -> None:
    servers = "10.0.0.2,10.0.0.3,10.0.0.4"
    res = _run_script(tmp_path, "NVIDIA L4, 23034\\n", SAILOR_SERVERS=servers)
    assert res.returncode == 0, res.stderr
    out = tmp_path / "etc/agent.yaml"
    assert check_config(out, files=False) == (0, Kind.agent, [])
    cfg = yaml.safe_load(out.read_text())
    hosts = servers.split(",")
    assert cfg["nats_urls"] == [f"nats://{h}:4222" for h in hosts]
    assert cfg["etcd_endpoints"] == [f"{h}:2379" for h in hosts]


def test_config_script_refuses_an_unknown_gpu(tmp_path: Path) -> None:
    res = _run_script(tmp_path, "NVIDIA B200, 183359\\n")
    assert res.returncode == 1
    assert "NVIDIA B200" in res.stderr and "not in the catalog" in res.stderr
    assert not (tmp_path / "etc/agent.yaml").exists()


@pytest.mark.skipif(
    shutil.which("cloud-init") is None, reason="cloud-init not installed (optional)"
)
def test_cloud_init_schema() -> None:
    res = subprocess.run(
        ["cloud-init", "schema", "--config-file", str(CLOUD_INIT)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.parametrize(
    ("cloud", "watcher", "warned"),
    [
        ("gce", "gcp", False),
        ("aws", "aws", False),
        ("azure", "azure", False),
        ("other", None, True),
    ],
)
def test_config_script_knows_cloud_inits_cloud_names(
    tmp_path: Path, cloud: str, watcher: str | None, warned: bool
) -> None:
    """``cloud-init query v1.cloud_name`` says ``gce`` on Google Cloud, not ``gcp``: the
    preemption watcher must follow it, and a spot VM without one is said plainly."""
    res = _run_script(tmp_path, "NVIDIA L4, 23034\\n", FAKE_CLOUD=cloud)
    assert res.returncode == 0, res.stderr
    kinds = [
        w["kind"] for w in yaml.safe_load((tmp_path / "etc/agent.yaml").read_text())["watchers"]
    ]
    assert kinds == ([watcher] if watcher else []) + ["file"]
    assert ("without a preemption watcher" in res.stderr) == warned, res.stderr


def test_the_config_script_does_not_die_of_sigpipe_on_a_long_gpu_list(tmp_path: Path) -> None:
    """Under ``pipefail``, ``printf "$gpus" | head -1`` exits 141 (SIGPIPE) whenever head is
    done before printf: a race with 8 lines (it failed one fresh-clone CI run), certain once
    the list outgrows the pipe's buffer (here 4,000 lines, ~120 KB)."""
    res = _run_script(tmp_path, "NVIDIA H100 80GB HBM3, 81559\\n" * 4000, SAILOR_JOB="llm")
    assert res.returncode != 141, res.stderr


def _run_install(tmp: Path, **env: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """The embedded install script against a fake venv whose pip logs its arguments."""
    venv = tmp / "venv"
    (venv / "bin").mkdir(parents=True)
    log = tmp / "pip.log"
    (venv / "bin/pip").write_text(f'#!/bin/sh\necho "$*" >> {log}\n')
    (venv / "bin/python").write_text("#!/bin/sh\necho 2.13.0+cu126 12.6\n")
    for f in (venv / "bin").iterdir():
        f.chmod(0o755)
    script = tmp / "sailor-install"
    script.write_text(_file("/usr/local/sbin/sailor-install"))
    install_env = tmp / "install.env"
    install_env.write_text(
        _file("/etc/sailor/install.env").replace("@SAILOR_PACKAGE@", "sailor==0.1.0")
    )
    full = {
        "PATH": os.environ["PATH"],
        "SAILOR_VENV": str(venv),
        "SAILOR_INSTALL_ENV": str(install_env),
        **env,
    }
    res = subprocess.run(
        ["bash", str(script)], env=full, capture_output=True, text=True, timeout=20
    )
    calls = log.read_text().splitlines() if log.exists() else []
    return res, calls


def test_install_puts_the_torch_build_that_runs_every_catalog_gpu_before_the_package(
    tmp_path: Path,
) -> None:
    """Plain pip took torch from PyPI: the CUDA 13.0 build, without V100 kernels, and any
    other build on a node set up by hand gave the job two NCCL versions."""
    from sailor.catalog.torch_builds import DEFAULT_BUILD, TORCH_VERSION

    env = _file("/etc/sailor/install.env")
    assert f"SAILOR_TORCH_INDEX={DEFAULT_BUILD.index_url}\n" in env
    assert f"SAILOR_TORCH=torch=={TORCH_VERSION}\n" in env  # the pin of pyproject.toml
    res, calls = _run_install(tmp_path)
    assert res.returncode == 0, res.stderr
    assert calls == [
        f"install --quiet --upgrade --index-url {DEFAULT_BUILD.index_url} torch=={TORCH_VERSION}",
        "install --quiet --upgrade sailor==0.1.0",
    ]
    assert "torch 2.13.0+cu126 12.6" in res.stdout


def test_install_without_a_torch_index_installs_the_package_alone(tmp_path: Path) -> None:
    res, calls = _run_install(tmp_path, SAILOR_TORCH_INDEX="")
    assert res.returncode == 0, res.stderr
    assert calls == ["install --quiet --upgrade sailor==0.1.0"]
