"""``sailor status`` prints what a hostile agent wrote without letting it drive the terminal
(real etcd with RBAC, the command line).

An agent may write only its own node's record and status, but what it writes there (its
GPU type, its worker's failure cause) is printed on the operator's terminal. Before, an
escape sequence in it reached the terminal as is (OSC 52 sets the clipboard, ESC [2J clears
the screen) and rich read ``[...]`` in a table cell as markup: ``[/]`` ended the command with
a ``MarkupError``, ``[link=...]`` printed a disguised hyperlink.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from sailor.cli.main import app
from sailor.coordination import Keys, connect_etcd
from sailor.schemas.hardware import NodeSpec
from sailor.schemas.runtime import AgentStatus, DesiredState, NodeHealth
from tests.integration.cluster_kit import Cluster

pytestmark = pytest.mark.usefixtures("no_task_leak")

CLIPBOARD = "\x1b]52;c;cm0gLXJmIH4=\x1b\\"  # OSC 52: set the clipboard
HOSTILE_GPU = f"A100{CLIPBOARD}\x1b[2J[/][link=https://evil.example]x[/link]"
CAUSE = "worker\x1b[2Jdied\r[bold]rank 3[/]"


async def _cli(*args: str) -> Any:
    return await asyncio.to_thread(CliRunner().invoke, app, list(args))


async def test_status_shows_an_agents_hostile_text_inert(cluster: Cluster) -> None:
    keys = Keys(job=cluster.job)
    agent = await connect_etcd(cluster.etcd, security=cluster.security("n1"))
    try:  # what RBAC lets node n1 write: its own record and status
        lease = await agent.lease(30)
        spec = NodeSpec(node_id="n1", gpu_type=HOSTILE_GPU, gpus=1, zone="z-a-1")
        await agent.put(keys.node("n1"), spec.model_dump_json().encode(), lease=lease)
        st = AgentStatus(node_id="n1", state="failed", failure=CAUSE)
        await agent.put(keys.status("n1"), st.model_dump_json().encode(), lease=lease)
        # the leader keeps a failing node's cause (cut from the agent's failure) and excludes it
        health = NodeHealth(failures=3, exclusions=1, excluded_until=time.time() + 600, cause=CAUSE)
        desired = DesiredState(epoch=1, node_health={"n1": health})
        ctl = await connect_etcd(cluster.etcd, security=cluster.security("c1"))
        try:
            await ctl.put(keys.desired, desired.model_dump_json().encode())
        finally:
            await ctl.close()
        cfg = cluster.tmp / "controller.yaml"
        cfg.write_text(yaml.safe_dump(json.loads(cluster.ctl_config("c1").model_dump_json())))

        res = await _cli("status", "--config", str(cfg))
        assert res.exit_code == 0, res.output
        assert "\x1b" not in res.output and "\r" not in res.output
        assert "evil.example" in res.output  # shown as text, never as a hyperlink
        flat = "".join(res.output.split())  # the table may wrap the cell
        assert "A100\\x1b]52;c;" in flat and "[/][link=https://evil.example]x[/link]" in flat
        assert "worker\\x1b[2Jdied\\x0d[bold]rank3[/]" in flat  # the exclusion's cause

        res = await _cli("status", "--config", str(cfg), "--json")  # JSON escapes them
        assert res.exit_code == 0, res.output
        (row,) = json.loads(res.output)["nodes"]
        assert row["gpu"] == HOSTILE_GPU
        await lease.revoke()
    finally:
        await agent.close()


async def test_audit_prints_a_hostile_subject_inert(cluster: Cluster) -> None:
    """n1 publishes on an event subject whose last token it chose (its NATS permission is
    ``sailor.<job>.events.n1.>``); the leader audits the subject of every event, rejected ones
    too, and ``sailor audit`` prints it. Before, the escape sequence reached the terminal."""
    from sailor.controller.audit import read_records
    from sailor.coordination import connect_nats
    from sailor.schemas.events import Heartbeat

    cluster.start_controller("c1")
    log = cluster.tmp / "audit-c1.jsonl"
    keys = Keys(job=cluster.job)
    subject = f"{keys.source_event_subjects('n1')[:-1]}x{CLIPBOARD}"
    event = Heartbeat(event_id="hostile-1", node_id="n1", time=time.time())  # n1: no agent
    nc = await connect_nats(cluster.nats_url, "hostile", security=cluster.security("n1"))
    try:
        js = nc.jetstream()
        deadline = time.monotonic() + 30
        while True:  # until the leader has made the stream
            try:
                await js.publish(subject, event.model_dump_json().encode(), timeout=1)
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.3)
        while not (
            log.exists() and any(CLIPBOARD in str(r.get("subject")) for r in read_records([log]))
        ):
            assert time.monotonic() < deadline, "the leader never audited the event"
            await asyncio.sleep(0.2)
    finally:
        await nc.close()
    await cluster.close()

    res = await _cli("audit", str(log))
    assert "\x1b" not in res.output, res.output
    assert "events.n1.x\\x1b]52;c;cm0gLXJmIH4=\\x1b\\" in res.output
