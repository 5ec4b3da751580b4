"""Downtime per reconfiguration with real servers and real CPU workers, split by phase.

Setup: a real nats-server and etcd, one controller (``sailor.planner``), two agents of one
``cpu`` "GPU" each on this machine, workers ``python -m sailor.training_process`` training tiny-gpt
(global batch 4, gloo). Scenario: n1 trains alone (cold start: IDLE → first step, the
baseline of a kill-and-restart measured in the same run); n2 joins (join → replan → resume);
n1 gets a preemption notice with a 30 s deadline (→ checkpoint → resume on n2).

For each reconfiguration: downtime = event received by the controller (or its first phase change,
if its watch saw the etcd change first) → RUNNING (the first
step of the new layout done on every node), and the time spent in each phase, read from
the controller's audit log. Anchors, quoted from issue 7 and not measured here: target ≤ 10 s;
torchrun's kill-and-restart takes 30 s or more; the original Sailor waits a 30 s grace period.
Prints (the quoted anchors labelled as such); asserts nothing.

Run: ``.venv/bin/python benchmarks/runtime_reconfig.py``
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from runtime_servers import free_port, servers

from sailor.agent.daemon import Agent, AgentConfig, WatcherConfig
from sailor.agent.supervisor import DEFAULT_WORKER_ARGV
from sailor.controller.audit import read_records
from sailor.controller.config import ControllerConfig
from sailor.controller.daemon import Controller
from sailor.controller.phases import PhaseDeadlines
from sailor.schemas.hardware import NodeSpec
from sailor.schemas.runtime import Phase

PHASES = ("quiesce", "checkpoint", "commit", "teardown", "launch", "load", "verify")
# Pace the workers (s per step) so their busy loops leave the 2 shared cores to the control
# plane; a tiny-gpt step itself takes a few ms here.
MIN_STEP_S = "0.05"
_CAUSES = ("node_joined", "preemption_notice")


async def _wait(ctl: Controller, phase: Phase, after_gen: int, timeout: float) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while loop.time() < end:
        d = ctl.desired
        if d is not None and d.phase is phase and d.generation > after_gen:
            return
        await asyncio.sleep(0.02)
    raise RuntimeError(f"{phase} not reached in {timeout}s")


def _agent(tmp: Path, nats: str, etcd: str, node: str) -> Agent:
    return Agent(
        AgentConfig(
            job="bench",
            node=NodeSpec(node_id=node, gpu_type="cpu", gpus=1, zone="z", address="127.0.0.1"),
            nats_url=nats,
            etcd_endpoint=etcd,
            lease_ttl_s=2,
            work_dir=tmp / "agents",
            worker_argv=(*DEFAULT_WORKER_ARGV, "--min-step-s", MIN_STEP_S),
            watchers=(WatcherConfig(kind="file", target=str(tmp / f"preempt-{node}")),),
            watch_poll_s=0.05,
        )
    )


async def _scenario(tmp: Path, nats: str, etcd: str) -> list[dict[str, Any]]:
    cfg = ControllerConfig(
        job="bench",
        nats_url=nats,
        etcd_endpoint=etcd,
        audit_log=tmp / "audit.jsonl",
        checkpoint_dir=str(tmp / "ckpt"),
        debounce_s=0.05,
        resync_s=0.5,
        poll_s=0.05,
        stop_ahead_steps=2,
        notice_margin_s=1.0,
        deadlines=PhaseDeadlines(quiesce=20, checkpoint=20, launch=10, load=60, verify=60),
        model="tiny-gpt",
        global_batch_size=4,
        base_port=free_port(),
    )
    ctl = Controller(cfg)
    tasks = [asyncio.create_task(ctl.run(), name="bench-ctl")]
    agents: list[Agent] = []
    try:
        a1 = _agent(tmp, nats, etcd, "n1")
        agents.append(a1)
        tasks.append(asyncio.create_task(a1.run(), name="bench-n1"))
        await _wait(ctl, Phase.RUNNING, -1, 120)
        gen = ctl.desired.generation if ctl.desired else 0
        await asyncio.sleep(1.0)
        a2 = _agent(tmp, nats, etcd, "n2")
        agents.append(a2)
        tasks.append(asyncio.create_task(a2.run(), name="bench-n2"))
        await _wait(ctl, Phase.RUNNING, gen, 120)
        gen = ctl.desired.generation if ctl.desired else 0
        await asyncio.sleep(1.0)
        (tmp / "preempt-n1").write_text(json.dumps({"in_s": 30}))
        await _wait(ctl, Phase.RUNNING, gen, 120)
        await asyncio.sleep(0.5)
    finally:
        for a in agents:
            a.stopping.set()
        ctl.stopping.set()
        ctl.wake()
        await asyncio.wait(tasks, timeout=30)
    return read_records([tmp / "audit.jsonl"])


def _split(recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per layout change: its cause, downtime and seconds per phase."""
    rows: list[dict[str, Any]] = []
    cur: dict[str, Any] | None = None
    last_t = 0.0
    last_phase = ""
    for r in recs:
        wakes = r["kind"] == "event" and r.get("event_kind") in _CAUSES
        # The controller may act on the etcd change (the node's registration, seen by its
        # watch) before it handles the event: a row starts at whichever comes first.
        leaves = r["kind"] == "phase" and r.get("phase") in ("launch", "quiesce", "teardown")
        if (wakes or leaves) and (cur is None or "running" in cur):
            cause = "first launch" if cur is None else r.get("event_kind") or r.get("cause")
            cur = {"cause": cause, "t0": r["time"], "phases": {}}
            last_t, last_phase = r["time"], "decide"
        if r["kind"] != "phase" or cur is None:
            continue
        cur["phases"][last_phase] = cur["phases"].get(last_phase, 0.0) + r["time"] - last_t
        last_t, last_phase = r["time"], r["phase"]
        if r["phase"] == "running":
            cur["running"] = r["time"]
            cur["downtime"] = r["time"] - cur["t0"]
            rows.append(cur)
    return rows


def main() -> None:
    print(f"machine: {platform.machine()} {platform.processor() or ''} cpus={os.cpu_count()}")
    print(f"python {platform.python_version()}; workers: tiny-gpt, gbs 4, gloo, cpu nodes")
    with tempfile.TemporaryDirectory(prefix="sailor-reconf-") as d:
        tmp = Path(d)
        with servers(tmp) as (nats, etcd):
            recs = asyncio.run(_scenario(tmp, nats, etcd))
    phases = [r for r in recs if r["kind"] == "phase"]
    first_launch = next(r for r in phases if r["phase"] == "launch")
    first_run = next(r for r in phases if r["phase"] == "running")
    cold = first_run["time"] - first_launch["time"]
    print(f"\nbaseline cold start (launch -> first step): {cold:.2f} s")
    print(
        f"\n{'cause':<18} {'downtime s':>10}  " + " ".join(f"{p:>10}" for p in ("decide", *PHASES))
    )
    for row in _split(recs):
        cells = " ".join(f"{row['phases'].get(p, 0.0):>10.2f}" for p in ("decide", *PHASES))
        print(f"{row['cause']:<18} {row['downtime']:>10.2f}  {cells}")
    # The anchors are not measured here (neither torchrun nor the original Sailor runs in this
    # benchmark); the cold start above is the kill-and-restart baseline measured in this run.
    print(
        "\ntarget <= 10 s; quoted, not measured in this run: torchrun kill-and-restart >= 30 s, "
        "original Sailor 30 s grace period (source: the project's issue 7, which states both)"
    )


if __name__ == "__main__":
    main()
