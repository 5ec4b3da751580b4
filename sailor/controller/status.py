"""The operator's side of a job's etcd state: read it for ``sailor status``, and write the
requests the leader acts on (``sailor node readmit``, ``sailor checkpoint clear-bad``). No
leadership needed.

A request is never applied here: the operator's write only asks, and the leader applies it
in a pass, as it writes every desired state (``decide``), then deletes the key. The desired
state itself has one writer, the leader, under its epoch guard (``DesiredState``); a write
from here would race its next pass and be overwritten.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import ValidationError

from sailor.controller.bad_marks import marked, unknown_steps
from sailor.controller.decide import not_admitted
from sailor.controller.decision_types import Observed
from sailor.controller.job_precision import job_precision
from sailor.coordination import Keys, connect_etcd
from sailor.coordination.security import SecurityConfig
from sailor.schemas.hardware import NodeSpec
from sailor.schemas.online_calibration import CalibrationPointer
from sailor.schemas.precision import Precision
from sailor.schemas.runtime import (
    AgentStatus,
    ClearBadRequest,
    CommitRecord,
    DesiredState,
    NodeHealth,
    NoticeRecord,
    ReadmitRequest,
)
from sailor.schemas.training import TrainingConfig

__all__ = ["read_status", "request_clear_bad", "request_readmit"]


async def read_status(
    endpoint: str | Sequence[str],
    job: str,
    security: SecurityConfig | None = None,
    now: float | None = None,
    training: TrainingConfig | None = None,
) -> dict[str, Any]:
    """A JSON-able snapshot: leader, phase, plan, nodes with health, last checkpoint. A node
    the controller excludes (its workers kept failing: ``DesiredState.node_health``) shows
    until when, as of ``now`` (default: this host's clock). ``training``: the controller's
    training config, whose forced precision the leader admits nodes by (as
    ``job_precision.job_precision`` reads it); without it, the recorded one."""
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
    # the job's records (most nodes failed alike, a hang; an agreed error's): no launch
    job_recs = [d.job_health, *(r for _, r in sorted(d.agreed_health.items()))] if d else []
    held = max(job_recs, key=lambda r: r.excluded_until, default=None)
    job_out = None
    if held is not None and held.excluded_until > now:
        job_out = {"until": held.excluded_until, "failures": held.failures, "cause": held.cause}
    specs: dict[str, NodeSpec] = {}
    for kv in nodes:
        with contextlib.suppress(ValidationError):
            spec = NodeSpec.model_validate_json(kv.value)
            specs[spec.node_id] = spec
    precision = job_precision(d, training) if d is not None else None
    refused = _not_admitted(d, specs, st, nt, now, precision)
    rows = []
    for n in specs.values():
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
                "nccl": n.runtime.nccl_version if n.runtime is not None else "",
                "admitted": "no" if n.node_id in refused else "",
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
        "job_excluded": job_out,
        "not_admitted": refused,
        "plan_failed": d.plan_failed if d else "",
        "job_precision": d.job_precision if d else None,
        "admission_precision": precision,
        "last_checkpoint": last,
        "bad_checkpoints": list(d.bad_checkpoints) if d else [],
        "suspect_checkpoint": d.suspect_checkpoint.step if d else -1,
        "calibration_version": _calibration_version(calib.value) if calib else None,
        "nodes": rows,
    }


def _not_admitted(
    d: DesiredState | None,
    nodes: dict[str, NodeSpec],
    status: dict[str, AgentStatus],
    notices: dict[str, NoticeRecord],
    now: float,
    precision: Precision | None = None,
) -> dict[str, str]:
    """The nodes the leader leaves out for their runtime or the job's precision, and why, by
    the leader's own rule (``decide.not_admitted``) over the same records."""
    o = Observed(now=now, nodes=nodes, status=status, notices=notices)
    return not_admitted(d or DesiredState(epoch=0), o, precision=precision)


def _calibration_version(raw: bytes) -> int | None:
    """The current online-calibration version (``calibration/current``), None if unreadable."""
    try:
        return CalibrationPointer.model_validate_json(raw).version
    except ValidationError:
        return None


async def _desired(store: Any, keys: Keys) -> DesiredState | None:
    """The job's desired state as etcd holds it; None if there is none, or it is unreadable."""
    kv = await store.get(keys.desired)
    if kv is None:
        return None
    with contextlib.suppress(ValidationError):
        return DesiredState.model_validate_json(kv.value)
    return None


async def _ask(
    store: Any,
    keys: Keys,
    key: str,
    body: bytes,
    wait_s: float,
    applied: Callable[[DesiredState | None], bool],
) -> bool:
    """Write a request at ``key`` and wait up to ``wait_s`` for a leader to delete it (it
    has applied it). Not deleted in time, it is withdrawn, so a leader that starts later
    does not act on a request that reported failure. A leader may have read it just before
    and apply it all the same: the desired state is read again after the withdrawal, and
    ``applied`` says whether it holds what the request asked for."""
    await store.put(key, body)
    end = time.monotonic() + wait_s
    while time.monotonic() < end:
        if await store.get(key) is None:
            return True
        await asyncio.sleep(0.2)
    await store.delete(key)
    return applied(await _desired(store, keys))


def _request_id() -> str:
    return f"{time.time_ns():020d}-{uuid.uuid4().hex[:8]}"  # ids sort by time


async def request_readmit(
    endpoint: str | Sequence[str],
    job: str,
    nodes: Sequence[str],
    everything: bool,
    who: str,
    security: SecurityConfig | None = None,
    wait_s: float = 10.0,
) -> tuple[str, bool, tuple[str, ...]]:
    """Ask the leader to forget the failure records of ``nodes`` (``everything``: every
    node's and the job's). Returns the request id, whether a leader applied it (it deletes
    the key once the desired state no longer holds the records; or, the request withdrawn
    after ``wait_s``, the desired state holds them no more), and the named nodes the
    desired state held no record of (nothing to forget: no request is written when that is
    all of them)."""
    keys = Keys(job=job)
    store = await connect_etcd(endpoint, security=security)
    try:
        unknown: tuple[str, ...] = ()
        if not everything:
            d = await _desired(store, keys)
            held = set(d.node_health) if d is not None else set()
            unknown = tuple(n for n in nodes if n not in held)
            if len(unknown) == len(nodes):
                return "", False, unknown
        rid = _request_id()
        names = tuple(n for n in nodes if n not in unknown)
        req = ReadmitRequest(nodes=names, all=everything, who=who, time=time.time())

        def forgotten(d: DesiredState | None) -> bool:
            if d is None:
                return False
            if everything:
                return not d.node_health and d.job_health == NodeHealth() and not d.agreed_health
            return not set(names) & set(d.node_health)

        body = req.model_dump_json().encode()
        done = await _ask(store, keys, keys.readmit(rid), body, wait_s, forgotten)
        return rid, done, unknown
    finally:
        await store.close()


async def request_clear_bad(
    endpoint: str | Sequence[str],
    job: str,
    steps: Sequence[int],
    everything: bool,
    who: str,
    security: SecurityConfig | None = None,
    wait_s: float = 10.0,
) -> tuple[str, bool, tuple[int, ...]]:
    """Ask the leader to clear the bad (and suspect) marks of committed ``steps``
    (``everything``: every mark). Returns the request id, whether a leader applied it (as
    :func:`request_readmit`: the key deleted, or after the withdrawal the desired state
    marks none of them), and the named steps the desired state marks neither bad nor
    suspect (nothing to clear: no request is written when that is all of them, nor with
    ``everything`` when no step is marked)."""
    keys = Keys(job=job)
    store = await connect_etcd(endpoint, security=security)
    try:
        d = await _desired(store, keys)
        asked = tuple(sorted(set(steps)))
        unknown = asked if d is None else unknown_steps(d, asked)
        if (everything and (d is None or not marked(d))) or (
            not everything and len(unknown) == len(asked)
        ):
            return "", False, unknown
        rid = _request_id()
        named = tuple(s for s in asked if s not in unknown)
        req = ClearBadRequest(steps=named, all=everything, who=who, time=time.time())

        def cleared(d: DesiredState | None) -> bool:
            if d is None:
                return False
            return not marked(d) if everything else not set(named) & set(marked(d))

        body = req.model_dump_json().encode()
        done = await _ask(store, keys, keys.clear_bad(rid), body, wait_s, cleared)
        return rid, done, unknown
    finally:
        await store.close()
