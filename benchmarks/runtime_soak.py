"""Soak: 10,000 reconfigurations through ``decide`` and the ``Executor``; is memory flat?

In process, no servers: the controller's own decide → apply loop (``decide``, the real
``Executor`` with its command fan-out tasks, the real ``AuditLog`` on a temporary
directory, the ``DataParallelPlanner`` in a thread as the executor runs it) against
stand-ins for etcd (guarded writes accepted, commits kept as the last few, as retention
would) and for the agents (each command applied to a simulated node's status at once and
acked). Four nodes run the job; a fifth joins (a quiesce → checkpoint → commit → teardown →
launch → load → verify cycle) and then leaves while placed (an abort → teardown → relaunch
from the last commit): each is one reconfiguration, alternately.

Printed every ``--every`` reconfigurations: the process's resident set (``/proc/self/statm``),
the Python heap as ``tracemalloc`` counts it (when ``--tracemalloc``: slower), the number of
objects the garbage collector tracks, and the command ids the executor remembers. With
``--baseline`` the same run is repeated first with pruning off (``KEEP_GENERATIONS`` set to
a billion: the executor as it was, remembering every command of the term), for comparison in
the same process. Prints; asserts nothing (timings are the machine's, not a claim).

Run: ``.venv/bin/python benchmarks/runtime_soak.py [--reconfigs 10000] [--baseline]``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import platform
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

import sailor.controller.command_sends as sends_mod
from sailor.controller.audit import AuditLog
from sailor.controller.decide import decide
from sailor.controller.decision_types import DecideConfig, Observed
from sailor.controller.executor import Executor
from sailor.controller.planning import DataParallelPlanner
from sailor.coordination import Keys, SystemClock, TaskSet
from sailor.schemas.commands import CommandAdapter
from sailor.schemas.hardware import NodeSpec
from sailor.schemas.runtime import AgentStatus, CommandAck, CommitRecord, DesiredState, Phase

_PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss_mib() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * _PAGE / 2**20


class _Store:
    """Guarded writes always succeed; the last commits are kept (checkpoint retention)."""

    def __init__(self) -> None:
        self.commits: list[CommitRecord] = []
        self.writes = 0

    async def put_guarded(self, key: str, value: bytes, guard: str, epoch: int) -> int:
        self.writes += 1
        if "/ckpt/" in key:
            self.commits = [*self.commits[-2:], CommitRecord.model_validate_json(value)]
        return self.writes

    async def delete_guarded(self, key: str, guard: str, epoch: int) -> None:
        self.writes += 1


class _Agents:
    """Each command applied at once to the node's simulated status, then acked."""

    def __init__(self) -> None:
        self.status: dict[str, AgentStatus] = {}

    def _set(self, node: str, **kw: Any) -> None:
        old = self.status.get(node) or AgentStatus(node_id=node, state="idle", time=0.0)
        self.status[node] = old.model_copy(update=kw)

    async def request(self, node_id: str, data: bytes, timeout: float) -> bytes:
        cmd = CommandAdapter.validate_json(data)
        if cmd.kind == "launch":
            start = max(cmd.load_step, 0)
            self._set(
                node_id,
                generation=cmd.generation,
                plan_id=cmd.plan_id,
                state="running",
                start_step=start,
                step=start + 1,
                saved_step=-1,
            )
        elif cmd.kind == "stop":
            self._set(node_id, step=cmd.at_step)
        elif cmd.kind == "checkpoint":
            self._set(node_id, saved_step=cmd.step)
        elif cmd.kind == "abort":
            self._set(node_id, state="idle")
        ack = CommandAck(command_id=cmd.command_id, node_id=node_id, accepted=True)
        return ack.model_dump_json().encode()

    async def close(self) -> None:
        return None


class _Lead:
    epoch = 1
    held = True
    fresh = True  # the lease answered its last refresh: sends go out


def _node(i: int) -> NodeSpec:
    return NodeSpec(node_id=f"n{i}", gpu_type="cpu", gpus=1, zone="local-a", address="127.0.0.1")


async def soak(reconfigs: int, every: int, trace: bool, tmp: Path) -> list[dict[str, float]]:
    store, agents = _Store(), _Agents()
    tasks = TaskSet("soak")
    audit = AuditLog(tmp / "audit.jsonl", max_bytes=16 << 20, backups=1)
    woke = asyncio.Event()
    ex = Executor(
        store,  # type: ignore[arg-type]
        agents,  # type: ignore[arg-type]
        Keys(job="soak"),
        audit,
        _Lead(),  # type: ignore[arg-type]
        DataParallelPlanner("tiny-gpt", 4, global_batch_size=120),
        SystemClock(),
        tasks,
        lambda urgent: woke.set(),
        command_timeout_s=5.0,
        resend_s=0.0,
    )
    cfg = DecideConfig(checkpoint_dir=str(tmp / "ckpt"), stop_ahead_steps=2)
    nodes = {f"n{i}": _node(i) for i in range(4)}
    for n in nodes:  # a real agent writes its status as soon as it starts
        agents.status[n] = AgentStatus(node_id=n, state="idle", time=0.0)
    desired = DesiredState(epoch=1)
    done, passes, t0 = 0, 0, time.perf_counter()
    rows: list[dict[str, float]] = []
    was_running = False
    try:
        while done < reconfigs:
            for st in agents.status.values():  # training goes on between passes
                if st.state == "running" and desired.phase is Phase.RUNNING:
                    agents.status[st.node_id] = st.model_copy(update={"step": st.step + 1})
            ready = ex.replans.adopt(desired)
            if ready is not None:
                await ex.write_desired(*ready)
                desired = ready[0]
            status = {n: s for n, s in agents.status.items() if n in nodes}
            obs = Observed(
                now=time.time(),
                nodes=dict(nodes),
                status=status,
                commits=tuple(store.commits),
                acked=ex.sends.acked_view,
            )
            desired = await ex.apply(decide(desired, obs, cfg), desired)
            await audit.durable()
            passes += 1
            running = desired.phase is Phase.RUNNING
            if running and not was_running and desired.generation > 1:
                done += 1
                if done % every == 0 or done == reconfigs:
                    rows.append(_measure(done, passes, t0, ex, trace))
                    rows[-1]["generation"] = desired.generation
                    _print(rows[-1])
            if running:
                # the next reconfiguration: n4 joins, or (placed) leaves without notice
                if "n4" in nodes:
                    del nodes["n4"]
                    agents.status.pop("n4", None)
                else:
                    nodes["n4"] = _node(4)
                    agents.status["n4"] = AgentStatus(node_id="n4", state="idle", time=0.0)
            was_running = running
            if ex.sends.inflight or ex.replans.running is not None:
                woke.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(woke.wait(), 5.0)
    finally:
        await tasks.close()
        audit.close()
    return rows


def _measure(done: int, passes: int, t0: float, ex: Executor, trace: bool) -> dict[str, float]:
    gc.collect()
    return {
        "reconfigs": done,
        "passes": passes,
        "elapsed_s": time.perf_counter() - t0,
        "rss_mib": _rss_mib(),
        "heap_mib": tracemalloc.get_traced_memory()[0] / 2**20 if trace else float("nan"),
        "gc_objects": len(gc.get_objects()),
        "remembered_ids": ex.sends.remembered,
    }


def _print(r: dict[str, float]) -> None:
    print(
        f"  {int(r['reconfigs']):>6} {int(r['passes']):>8} {r['elapsed_s']:>9.1f}"
        f" {r['rss_mib']:>8.1f} {r['heap_mib']:>9.2f} {int(r['gc_objects']):>10}"
        f" {int(r['remembered_ids']):>10} {int(r.get('generation', -1)):>6}",
        flush=True,
    )


def _header(title: str) -> None:
    print(f"\n{title}")
    print("  reconf   passes  elapsed_s  rss_MiB  heap_MiB gc_objects remembered    gen")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reconfigs", type=int, default=10_000)
    ap.add_argument("--every", type=int, default=1_000)
    ap.add_argument("--tracemalloc", action="store_true", help="also trace the Python heap")
    ap.add_argument("--baseline", action="store_true", help="first run with pruning off")
    ap.add_argument("--json", type=Path, help="write the rows here")
    args = ap.parse_args()
    print("runtime soak: decide + Executor in process, stand-ins for etcd and the agents")
    print(
        f"machine: {platform.machine()} {platform.processor() or ''} cpus={os.cpu_count()}"
        f" load={os.getloadavg()[0]:.1f} python={platform.python_version()}"
        f" {platform.platform()}"
    )
    print(
        "measured: RSS from /proc/self/statm; heap = tracemalloc traced bytes"
        " (nan when off); gc_objects = len(gc.get_objects()) after gc.collect();"
        " remembered = acked + sent-at command ids the executor holds"
    )
    if args.tracemalloc:
        tracemalloc.start()
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="sailor-soak-", dir="/dev/shm") as d:
        if args.baseline:
            keep = sends_mod.KEEP_GENERATIONS
            sends_mod.KEEP_GENERATIONS = 10**9
            _header("baseline: pruning off (every command id of the term kept)")
            out["baseline"] = asyncio.run(
                soak(args.reconfigs, args.every, args.tracemalloc, Path(d))
            )
            sends_mod.KEEP_GENERATIONS = keep
            gc.collect()
        _header(f"pruned by generation (KEEP_GENERATIONS={sends_mod.KEEP_GENERATIONS})")
        out["pruned"] = asyncio.run(soak(args.reconfigs, args.every, args.tracemalloc, Path(d)))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
