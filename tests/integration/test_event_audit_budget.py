"""One node's flood of events cannot wash the run out of the audit log (real NATS with the
nodes' logins, the real controller).

Before, the leader wrote an audit record per event, whoever sent how many: n1 published
5,000 junk events on its own subjects in 0.04 s and the leader audited every one within a
second, so a compromised node rotated the whole audit log (5 x 64 MiB) out in minutes. Now
each source gets ``AUDIT_BURST`` records, refilled at ``AUDIT_RATE`` a second; the rest are
counted (``audit_budget_exceeded`` once, then ``events_unaudited``), and other nodes' events
are recorded as before.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest

from sailor.controller.audit import read_records
from sailor.controller.audit_budget import AUDIT_BURST, AUDIT_RATE
from sailor.coordination import Keys, connect_nats
from tests.integration.cluster_kit import Cluster

pytestmark = pytest.mark.usefixtures("no_task_leak")

FLOOD = 3 * AUDIT_BURST


def _junk(i: int, node: str) -> bytes:
    # well-formed, about a node that is not registered: refused, one record each
    ev = {"kind": "heartbeat", "event_id": f"{node}-junk-{i}", "node_id": node, "time": 1.0}
    return json.dumps(ev).encode()


async def test_a_flooding_node_is_counted_not_recorded_one_by_one(cluster: Cluster) -> None:
    keys = Keys(job=cluster.job)
    cluster.start_controller("c1")
    log = cluster.tmp / "audit-c1.jsonl"

    def records(kind: str, source: str) -> list[dict[str, Any]]:
        if not log.exists():
            return []
        return [
            r
            for r in read_records([log])
            if r["kind"] == kind
            and (r.get("source") == source or f".events.{source}." in str(r.get("subject")))
        ]

    n1 = await connect_nats(cluster.nats_url, "flood", security=cluster.security("n1"))
    n2 = await connect_nats(cluster.nats_url, "n2", security=cluster.security("n2"))
    try:
        js = n1.jetstream()
        end = time.monotonic() + 30
        while True:  # until the leader has made the stream
            try:
                await js.publish(keys.event_subject("x", "n1"), _junk(-1, "n1"), timeout=1)
                break
            except Exception:
                assert time.monotonic() < end, "no event stream"
                await asyncio.sleep(0.3)
        t0 = time.monotonic()
        for i in range(FLOOD):
            await n1.publish(keys.event_subject(f"k{i % 500}", "n1"), _junk(i, "n1"))
        await n1.flush()
        for i in range(5):  # another node's events meanwhile: each on record
            await n2.publish(keys.event_subject("heartbeat", "n2"), _junk(i, "n2"))
        await n2.flush()

        def accounted() -> int:
            rejected = len(records("event_rejected", "n1"))
            return rejected + sum(r["count"] for r in records("events_unaudited", "n1"))

        while accounted() < FLOOD + 1 or len(records("event_rejected", "n2")) < 5:
            assert time.monotonic() < end + 30, (accounted(), records("event_rejected", "n2"))
            await asyncio.sleep(0.3)
        elapsed = time.monotonic() - t0
    finally:
        await n1.close()
        await n2.close()
    rejected = len(records("event_rejected", "n1"))
    assert rejected <= AUDIT_BURST + AUDIT_RATE * elapsed + 1, (rejected, elapsed)
    assert accounted() == FLOOD + 1  # every event counted once: recorded or in a count
    assert len(records("audit_budget_exceeded", "n1")) == 1
    assert len(records("event_rejected", "n2")) == 5
    assert cluster.controllers["c1"][0].leadership is not None  # still leading
