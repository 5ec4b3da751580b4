"""The planner's worker process: the same plans as in a thread, and only what changed sent."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import time
import weakref
from pathlib import Path

import pytest

import sailor.controller.planning.process as pw
from sailor.controller.config import ControllerConfig
from sailor.controller.planning import ProcessPlanner, StaleWorkerStateError, planner_from_config
from sailor.schemas.hardware import NodeSpec


def _config(tmp_path: Path) -> ControllerConfig:
    return ControllerConfig(
        job="pw",
        identity="ctl-pw",
        nats_url="nats://127.0.0.1:1",
        etcd_endpoint="127.0.0.1:2",
        audit_log=tmp_path / "audit.jsonl",
        checkpoint_dir=str(tmp_path / "ckpt"),
        planner="sailor",
        model="OPT-350",
        global_batch_size=64,
        planner_process=True,
    )


def _node(i: int) -> NodeSpec:
    return NodeSpec(
        node_id=f"n{i:03d}",
        gpu_type=("A100-40", "V100-16")[i % 2],
        gpus=4,
        zone="us-central1-a",
        spot=True,
        address=f"10.0.0.{i + 1}",
    )


def test_worker_plans_like_the_thread_and_resends_in_full_when_out_of_step(
    tmp_path: Path,
) -> None:
    cfg = _config(tmp_path)
    local = planner_from_config(cfg)
    remote = ProcessPlanner(cfg)
    try:
        nodes = tuple(_node(i) for i in range(8))
        prev_local = prev_remote = None
        changes = [lambda ns: ns, lambda ns: ns[:-1], lambda ns: (*ns, _node(20))]
        for change in changes:
            nodes = change(nodes)
            a = local.plan(nodes, prev_local)
            b = remote.plan(nodes, prev_remote)
            assert b == a  # plan (through its JSON), placement and reason
            prev_local, prev_remote = a.plan, b.plan
        # after the first call only the new node's spec and no plan crossed the pipe
        call = remote._call((*nodes, _node(21)), prev_remote, full=False)
        assert [n.node_id for n in call.specs] == ["n021"]
        assert call.previous is None and call.previous_id == prev_remote.plan_id
        remote._forget()
        # the mirror claims a plan the worker never held: refused, then sent in full
        remote._nodes = {n.node_id: n for n in nodes}
        remote._plans = {"p-unknown"}
        remote._reset = False
        stale = prev_remote.model_copy(update={"plan_id": "p-unknown"})
        again = remote.plan(nodes, stale)
        assert again == local.plan(nodes, stale)
        # no automatic collection in the worker: it collects between calls
        assert remote._pool is not None and remote._pool.submit(gc.isenabled).result() is False
    finally:
        remote.close()


def test_worker_refuses_what_it_does_not_hold(tmp_path: Path) -> None:
    pw._planner = planner_from_config(_config(tmp_path))
    try:
        nodes = tuple(_node(i) for i in range(4))
        full = pw._Call(tuple(n.node_id for n in nodes), nodes, None, None, reset=True)
        plan_json, placement, _ = pw._plan(full)
        assert set(placement) <= {n.node_id for n in nodes} and plan_json
        with pytest.raises(StaleWorkerStateError, match="n099"):
            pw._plan(pw._Call(("n000", "n099"), (), None, None, reset=False))
        with pytest.raises(StaleWorkerStateError, match="p-none"):
            pw._plan(pw._Call(("n000",), (), "p-none", None, reset=False))
    finally:
        pw._planner, pw._nodes, pw._plans = None, {}, {}


class _Node:
    def __init__(self) -> None:
        self.other: _Node = self


def test_worker_collection_frees_new_cycles_and_now_and_then_frozen_ones() -> None:
    collections = pw._collections
    try:
        pw._collections = 0
        old = _Node()
        old_ref = weakref.ref(old)
        pw._collect()  # old (still referenced) is frozen
        assert gc.get_freeze_count() > 0
        young = _Node()
        young_ref = weakref.ref(young)
        del young, old
        pw._collect()
        assert young_ref() is None  # a cycle made since the last collection: freed
        for _ in range(pw._FULL_EVERY - 3):
            pw._collect()
        assert old_ref() is not None  # frozen: not scanned ...
        pw._collect()
        assert old_ref() is None  # ... until every _FULL_EVERY-th collection
    finally:
        pw._collections = collections
        gc.unfreeze()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (terminated, not yet reaped) counts as gone
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    return False


async def test_a_cancelled_call_kills_the_search_and_the_next_call_runs_at_once(
    tmp_path: Path,
) -> None:
    """A timed-out replan must not leave its search holding the pool's one worker."""
    remote = ProcessPlanner(_config(tmp_path))
    try:
        await remote.warm_up()
        assert remote._pool is not None
        pids = list(remote._pool._processes)  # type: ignore[attr-defined]
        # the worker is busy (a search that will not end soon); the call queues behind it
        remote._pool.submit(time.sleep, 600)
        nodes = tuple(_node(i) for i in range(4))
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(remote.aplan(nodes, None), 0.5)
        deadline = time.monotonic() + 10
        while any(map(_alive, pids)):
            assert time.monotonic() < deadline, f"worker {pids} still running its search"
            await asyncio.sleep(0.05)
        # a fresh worker answers the next call (not queued behind the old search)
        res = await asyncio.wait_for(remote.aplan(nodes, None), 120)
        assert res.plan.num_gpus > 0
    finally:
        remote.close()
