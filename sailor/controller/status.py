"""Read a job's state from etcd for ``sailor status`` (read-only, no leadership needed)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from sailor.coordination import Keys, connect_etcd
from sailor.coordination.security import SecurityConfig
from sailor.schemas.hardware import NodeSpec
from sailor.schemas.online_calibration import CalibrationPointer
from sailor.schemas.runtime import AgentStatus, CommitRecord, DesiredState, NoticeRecord

__all__ = ["read_status"]


async def read_status(
    endpoint: str | Sequence[str],
    job: str,
    security: SecurityConfig | None = None,
    now: float | None = None,
) -> dict[str, Any]:
    """A JSON-able snapshot: leader, phase, plan, nodes with health, last checkpoint. A node
    the controller excludes (its workers kept failing: ``DesiredState.node_health``) shows
    until when, as of ``now`` (default: this host's clock)."""
    keys = Keys(job=job)
    store = await connect_etcd(endpoint, security=security)
    try:
        leader = await store.get(keys.leader)
        desired_kv = await store.get(keys.desired)
        nodes = await store.get_prefix(keys.nodes)
        statuses = await store.get_prefix(keys.statuses)
        notices = await store.get_prefix(keys.notices)
        ckpts = await store.get_prefix(keys.checkpoints)
        calib = await store.get(keys.calibration)
    finally:
        await store.close()
    d = None
    if desired_kv is not None:
        with contextlib.suppress(ValidationError):
            d = DesiredState.model_validate_json(desired_kv.value)
    st: dict[str, AgentStatus] = {}
    for kv in statuses:
        with contextlib.suppress(ValidationError):
            s = AgentStatus.model_validate_json(kv.value)
            st[s.node_id] = s
    nt: dict[str, NoticeRecord] = {}
    for kv in notices:
        with contextlib.suppress(ValidationError):
            r = NoticeRecord.model_validate_json(kv.value)
            nt[r.node_id] = r
    now = time.time() if now is None else now
    health = d.node_health if d else {}
    out = {
        n: {"until": r.excluded_until, "failures": r.failures, "cause": r.cause}
        for n, r in sorted(health.items())
        if r.excluded_until > now
    }
    rows = []
    for kv in nodes:
        with contextlib.suppress(ValidationError):
            n = NodeSpec.model_validate_json(kv.value)
            s2 = st.get(n.node_id)
            rows.append(
                {
                    "node": n.node_id,
                    "gpu": n.gpu_type,
                    "gpus": n.gpus,
                    "zone": n.zone,
                    "spot": n.spot,
                    "state": s2.state if s2 else "?",
                    "step": s2.step if s2 else "",
                    "loss": f"{s2.loss:.4f}" if s2 and s2.loss is not None else "",
                    "notice": f"{nt[n.node_id].deadline:.0f}" if n.node_id in nt else "",
                    "excluded": f"{out[n.node_id]['until']:.0f}" if n.node_id in out else "",
                }
            )
    last = None
    if ckpts:
        with contextlib.suppress(ValidationError):
            last = CommitRecord.model_validate_json(ckpts[-1].value).step
    return {
        "leader": leader.value.decode() if leader else None,
        "epoch": leader.create_revision if leader else None,
        "phase": d.phase.value if d else None,
        "generation": d.generation if d else None,
        "plan_id": d.plan.plan_id if d and d.plan else None,
        "gpus_by_type_zone": d.plan.gpus_by_type_zone() if d and d.plan else {},
        "cause": d.cause if d else "",
        "excluded": out,
        "last_checkpoint": last,
        "calibration_version": _calibration_version(calib.value) if calib else None,
        "nodes": rows,
    }


def _calibration_version(raw: bytes) -> int | None:
    """The current online-calibration version (``calibration/current``), None if unreadable."""
    try:
        return CalibrationPointer.model_validate_json(raw).version
    except ValidationError:
        return None
