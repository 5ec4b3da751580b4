"""``sailor checkpoint clear-bad`` through a real etcd (TLS, RBAC) to a leader: the command
writes its request with the controller config's identity, the leader applies it in a pass
(the desired state's one writer), records who asked and what went, and deletes it; steps
without a mark are named, and a request with nothing to clear is never written.

The leader here runs with no agents: an IDLE job whose desired state (written as a previous
leader left it) marks step 14 bad and step 20 suspect.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from sailor.cli.main import app
from sailor.controller.audit import read_records
from sailor.coordination import Keys, connect_etcd
from sailor.schemas.runtime import CommitRecord, DesiredState, SuspectCheckpoint
from tests.integration.cluster_kit import Cluster, until

pytestmark = pytest.mark.usefixtures("no_task_leak")


async def _cli(*args: str) -> Any:
    """The command line in a thread: it runs its own event loop (``asyncio.run``)."""
    return await asyncio.to_thread(CliRunner().invoke, app, list(args))


async def test_an_operator_clears_a_bad_mark_through_the_leader(cluster: Cluster) -> None:
    keys = Keys(job=cluster.job)
    suspect = SuspectCheckpoint(step=20, nodes=("n2",), generation=3)
    seeded = DesiredState(epoch=1, generation=3, bad_checkpoints=(14,), suspect_checkpoint=suspect)
    store = await connect_etcd(cluster.etcd, security=cluster.security("c1"))
    try:
        await store.put(keys.desired, seeded.model_dump_json().encode())
        for step in (9, 14, 20):
            rec = CommitRecord(step=step, directory=str(cluster.tmp / "ckpt"), generation=2)
            await store.put(keys.checkpoint(step), rec.model_dump_json().encode())
    finally:
        await store.close()
    cfg = cluster.tmp / "controller.yaml"
    cfg.write_text(yaml.safe_dump(json.loads(cluster.ctl_config("c1").model_dump_json())))
    ctl = cluster.start_controller("c1")
    await until(lambda: ctl.desired is not None, 20, "no leader")

    res = await _cli("checkpoint", "clear-bad", "14", "7", "--config", str(cfg), "--wait", "20")
    assert res.exit_code == 0, res.output
    assert "no bad or suspect mark on step 7" in res.output
    assert "cleared step 14 (request " in res.output
    assert ctl.desired is not None and ctl.desired.bad_checkpoints == ()
    assert ctl.desired.suspect_checkpoint == suspect  # not named: kept

    # nothing to clear: no request written, exit status 1
    res = await _cli("checkpoint", "clear-bad", "14", "--config", str(cfg), "--wait", "5")
    assert res.exit_code == 1 and "nothing to clear: step 14 not marked" in res.output

    res = await _cli("checkpoint", "clear-bad", "--all", "--config", str(cfg), "--wait", "20")
    assert res.exit_code == 0, res.output
    assert "cleared every bad and suspect mark" in res.output
    assert ctl.desired.suspect_checkpoint == SuspectCheckpoint()
    res = await _cli("checkpoint", "clear-bad", "--all", "--config", str(cfg), "--wait", "5")
    assert res.exit_code == 1 and "no step is marked bad or suspect" in res.output

    ctl.audit.sync()
    records = read_records([cluster.tmp / "audit-c1.jsonl"])
    first, second = [r for r in records if r["kind"] == "clear_bad"]
    assert first["steps"] == [14] and first["cleared"] == [14] and "@" in first["who"]
    assert first["reason"] == "cleared the marks of step 14"
    assert second["all"] and second["cleared"] == [20]
    causes = [r["cause"] for r in records if r["kind"] == "phase"]
    assert any(
        c.startswith("cleared the bad checkpoint marks of step 14 (operator request ")
        and first["request_id"] in c
        for c in causes
    ), causes
    store = await connect_etcd(cluster.etcd, security=cluster.security("c1"))
    try:
        assert await store.get_prefix(keys.clear_bads) == []
        kv = await store.get(keys.desired)
        assert kv is not None
        stored = DesiredState.model_validate_json(kv.value)
        assert stored.bad_checkpoints == () and stored.suspect_checkpoint == SuspectCheckpoint()
    finally:
        await store.close()
    await cluster.audit()


async def _seed(cluster: Cluster, bad: tuple[int, ...], records: dict[int, str]) -> None:
    """The desired state of an IDLE job (``bad`` marked) and its commit records."""
    keys = Keys(job=cluster.job)
    store = await connect_etcd(cluster.etcd, security=cluster.security("c1"))
    try:
        seeded = DesiredState(epoch=1, generation=3, bad_checkpoints=bad)
        await store.put(keys.desired, seeded.model_dump_json().encode())
        for step, where in records.items():
            rec = CommitRecord(step=step, directory=where, generation=2)
            await store.put(keys.checkpoint(step), rec.model_dump_json().encode())
    finally:
        await store.close()


async def _directories(cluster: Cluster) -> dict[int, str]:
    """step -> directory of the commit records in etcd."""
    keys = Keys(job=cluster.job)
    store = await connect_etcd(cluster.etcd, security=cluster.security("c1"))
    try:
        kvs = await store.get_prefix(keys.checkpoints)
        assert await store.get_prefix(keys.clear_bads) == []  # every request taken or none
    finally:
        await store.close()
    recs = [CommitRecord.model_validate_json(kv.value) for kv in kvs]
    return {c.step: c.directory for c in recs}


async def test_repoint_from_moves_only_the_records_of_that_directory(cluster: Cluster) -> None:
    """``clear-bad --all --repoint --from /old`` through the command line and a real leader:
    the records under /old (100 marked bad, 200 not) are re-pointed to checkpoint_dir and
    100's mark goes; the record under /other and its mark stay; the audit names where the
    records were (``repointed_from``), the command says it. A step named with ``--from``
    but recorded under a third directory is refused, nothing written; ``--from`` without
    ``--repoint`` too. Before, ``--repoint`` re-pointed every other directory's records and
    the audit named only the new one."""
    ck = str(cluster.tmp / "ckpt")
    await _seed(cluster, (100, 300), {100: "/old", 200: "/old", 300: "/other", 400: ck})
    cfg = cluster.tmp / "controller.yaml"
    cfg.write_text(yaml.safe_dump(json.loads(cluster.ctl_config("c1").model_dump_json())))
    ctl = cluster.start_controller("c1")
    await until(lambda: ctl.desired is not None, 20, "no leader")
    base = ("checkpoint", "clear-bad", "--config", str(cfg), "--wait", "20")

    res = await _cli(*base, "300", "--repoint", "--from", "/old")
    assert res.exit_code == 2, res.output
    out = " ".join(res.output.split())
    assert f"step 300 (/other): recorded under neither --from /old nor {ck}" in out, out
    assert "nothing was written" in out
    res = await _cli(*base, "--all", "--from", "/old")
    assert res.exit_code == 2 and "--from /old: names the records to re-point" in res.output
    res = await _cli(*base, "--all", "--repoint", "--from", ck)
    assert res.exit_code == 2 and "is the config's checkpoint_dir" in res.output
    assert await _directories(cluster) == {100: "/old", 200: "/old", 300: "/other", 400: ck}

    res = await _cli(*base, "--all", "--repoint", "--from", "/old")
    assert res.exit_code == 0, res.output
    out = " ".join(res.output.split())
    assert f"re-pointed the records of step 100, 200 from /old to {ck}" in out, out
    assert "cleared step 100 (request " in out and "every bad" not in out
    assert await _directories(cluster) == {100: ck, 200: ck, 300: "/other", 400: ck}
    assert ctl.desired is not None and ctl.desired.bad_checkpoints == (300,)

    res = await _cli(*base, "--all", "--repoint", "--from", "/old")
    assert res.exit_code == 1, res.output
    out = " ".join(res.output.split())
    assert "no step is recorded under --from /old" in out, out
    assert f"(records under another directory than {ck}: /other)" in out, out

    # no --from: every other directory's records, as before, the audit naming it
    res = await _cli(*base, "--all", "--repoint")
    assert res.exit_code == 0, res.output
    assert f"re-pointed the records of step 300 from /other to {ck}" in " ".join(res.output.split())
    assert await _directories(cluster) == {100: ck, 200: ck, 300: ck, 400: ck}

    ctl.audit.sync()
    records = read_records([cluster.tmp / "audit-c1.jsonl"])
    first, second = [r for r in records if r["kind"] == "clear_bad"]
    assert first["steps"] == [100, 200] and not first["all"] and first["cleared"] == [100]
    assert first["repointed"] == [100, 200] and first["repointed_from"] == ["/old", "/old"]
    assert first["directory"] == ck and "from /old to" in first["reason"]
    assert second["all"] and second["cleared"] == [300]
    assert second["repointed"] == [300] and second["repointed_from"] == ["/other"]
    await cluster.audit()
