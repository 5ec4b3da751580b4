"""``sailor status`` shows the controller's periodic checkpoint (real etcd, the command line):
the save in flight (step, asked when, deadline) and the newest periodic commit (step, age),
in the text and in ``--json``. Before, neither showed: only the last commit's step."""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from sailor.cli.main import app
from sailor.coordination import Keys, connect_etcd
from sailor.schemas.runtime import CommitRecord, DesiredState, PeriodicCheckpoint, Phase
from tests.integration.cluster_kit import Cluster

pytestmark = pytest.mark.usefixtures("no_task_leak")


async def _cli(*args: str) -> Any:
    return await asyncio.to_thread(CliRunner().invoke, app, list(args))


async def test_status_shows_the_periodic_checkpoint(cluster: Cluster) -> None:
    keys = Keys(job=cluster.job)
    now = time.time()
    root = str(cluster.tmp / "ckpt")
    flying = PeriodicCheckpoint(step=154, requested=now - 30, deadline=now + 90, directory=root)
    d = DesiredState(epoch=1, generation=3, phase=Phase.RUNNING, periodic=flying)
    records = [
        CommitRecord(step=100, directory=root, time=now - 900, periodic=True),
        CommitRecord(step=120, directory=root, time=now - 400, periodic=True),
        CommitRecord(step=130, directory=root, time=now - 200),  # a reconfiguration's
    ]
    store = await connect_etcd(cluster.etcd, security=cluster.security("c1"))
    try:
        await store.put(keys.desired, d.model_dump_json().encode())
        for rec in records:
            await store.put(keys.checkpoint(rec.step), rec.model_dump_json().encode())
    finally:
        await store.close()
    cfg = cluster.tmp / "controller.yaml"
    cfg.write_text(yaml.safe_dump(json.loads(cluster.ctl_config("c1").model_dump_json())))

    res = await _cli("status", "--config", str(cfg), "--json")
    assert res.exit_code == 0, res.output
    p = json.loads(res.output)["periodic"]
    assert p["in_flight"]["step"] == 154 and p["in_flight"]["requested"] == now - 30
    assert p["in_flight"]["deadline"] == now + 90 and 0 < p["in_flight"]["deadline_in_s"] <= 90
    assert 30 <= p["in_flight"]["asked_s_ago"] < 60
    assert p["last_commit"]["step"] == 120 and 400 <= p["last_commit"]["age_s"] < 430

    res = await _cli("status", "--config", str(cfg))
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert re.search(
        r"periodic checkpoint: step 154 in flight, asked \d+ s ago, abandoned in "
        r"\d+ s unless durable; last committed: step 120, 4\d\d s ago",
        text,
    ), text
