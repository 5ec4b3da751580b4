"""A NATS URL's login (``nats://user:password@host``, or ``nats://token@host``) is never
shown or stored: node facts, ``sailor check`` lines, connection errors, config errors and
CLI error lines show the user and host with ``***`` for the password (``schemas.redact``)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from sailor.schemas.node_check import EndpointFacts
from sailor.schemas.redact import redact_text, redact_url, redact_urls

SECRET = "s3cr3t-Pw"


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        (f"nats://alice:{SECRET}@10.0.0.2:4222", "nats://alice:***@10.0.0.2:4222"),
        (f"tls://alice:{SECRET}@[fd00::4]:4222", "tls://alice:***@[fd00::4]:4222"),
        (f"nats://{SECRET}@h:4222", "nats://***@h:4222"),  # a token alone: all of it
        (f"nats://alice:{SECRET}@x@h:4222", "nats://alice:***@h:4222"),  # a raw '@' in it
        ("nats://10.0.0.2:4222", "nats://10.0.0.2:4222"),  # nothing to hide
        ("10.0.0.2:2379", "10.0.0.2:2379"),
    ],
    ids=["user-password", "ipv6", "token", "at-in-password", "plain", "etcd"],
)
def test_a_url_keeps_its_user_and_host_and_loses_its_password(url: str, shown: str) -> None:
    assert redact_url(url) == shown
    assert redact_text(f"error: url={url!r}, then {url}") == f"error: url={shown!r}, then {shown}"
    assert redact_urls([url, url]) == f"{shown},{shown}"


def test_node_facts_never_hold_a_password() -> None:
    """Whoever builds them (the agent's join, ``sailor check``), facts travel in
    NodeJoined into the event stream and the audit log: the URL and the error lose it."""
    url = f"nats://alice:{SECRET}@10.0.0.2:4222,nats://bob:{SECRET}@10.0.0.3:4222"
    facts = EndpointFacts(url=url, reachable=False, error=f"OSError: {url} refused")
    assert SECRET not in facts.model_dump_json()
    assert facts.url == "nats://alice:***@10.0.0.2:4222,nats://bob:***@10.0.0.3:4222"


def test_a_config_error_names_the_url_without_its_password(tmp_path: Path) -> None:
    from sailor.agent.agent_config import AgentConfig
    from sailor.cli.errors import describe
    from sailor.cli.main import app

    bad = f"nats://alice:{SECRET}@10.0.0.2"  # no port
    node = {"node_id": "n1", "gpu_type": "cpu", "gpus": 1, "zone": "z"}
    with pytest.raises(ValidationError) as err:
        AgentConfig.model_validate({"node": node, "nats_urls": [bad, bad]})
    line, code = describe(err.value)
    assert code == 2 and "nats_urls" in line and SECRET not in line, line
    assert "alice:***@10.0.0.2" in line, line
    with pytest.raises(ValidationError) as err:
        AgentConfig.model_validate({"node": node, "nats_urls": [bad + ":4222"] * 2})
    line, _ = describe(err.value)
    assert "listed twice" in line and SECRET not in line, line
    path = tmp_path / "agent.yaml"
    path.write_text(f"node: {{node_id: n1, gpu_type: cpu, gpus: 1, zone: z}}\nnats_urls: [{bad}]\n")
    res = CliRunner().invoke(app, ["config", "check", str(path), "--no-files"])
    assert res.exit_code == 1 and "nats_urls" in res.output, res.output
    assert SECRET not in res.output and "alice:***@" in res.output, res.output


async def test_an_unreachable_server_is_reported_without_its_password() -> None:
    """``connect_nats``'s error (logged by the daemons' retries) and ``sailor check``'s
    facts and lines name the server tried; before, with its password."""
    from sailor.agent.check_gather import reach_servers
    from sailor.agent.check_verdicts import judge
    from sailor.coordination import UnavailableError, connect_nats
    from sailor.schemas.node_check import NodeFacts

    url = f"nats://alice:{SECRET}@127.0.0.1:1"  # nothing listens on port 1
    t0 = time.monotonic()
    with pytest.raises(UnavailableError) as err:
        await connect_nats([url], "t", timeout=0.5)
    assert SECRET not in str(err.value) and "alice:***@127.0.0.1:1" in str(err.value)
    nats, _ = await reach_servers([url], ["127.0.0.1:1"], None, "n1", timeout_s=0.5)
    assert not nats.reachable and nats.url == "nats://alice:***@127.0.0.1:1", nats
    report = judge(NodeFacts(node_kind="cpu", gpu_type="cpu", gpus=1, nats=nats), "n1")
    assert SECRET not in report.model_dump_json()
    assert time.monotonic() - t0 < 10
