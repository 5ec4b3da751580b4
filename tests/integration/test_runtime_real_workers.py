"""The runtime with real training workers: join → replan → resume, preemption → resume.

Real nats-server and etcd, one controller planning with ``sailor.planner`` and two agents
(``cpu`` nodes) launching ``python -m sailor.training_process`` (tiny-gpt, gloo). n1 trains
alone; n2 joins, the controller replans for two nodes, the workers stop at an agreed step, save a
layer-keyed checkpoint, and the new layout resumes from it; then n1 gets a preemption notice
with a 30 s deadline: the checkpoint must be committed inside it and training resumes on n2
alone. Every loss every generation reported — in particular at every committed step — must
equal an uninterrupted single-process reference run (fp32, tight tolerance), and
``sailor audit`` must pass. Workers are paced (``--min-step-s``) so that their busy loops
leave the two shared cores to the control plane.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from sailor.agent.worker_argv import DEFAULT_WORKER_ARGV
from sailor.checkpoint import LocalStorage, committed_steps
from sailor.checkpoint.format import step_dir
from sailor.controller.audit import read_records
from sailor.controller.launch import UNLOADABLE_PREFIX
from sailor.controller.status import request_clear_bad
from sailor.localservers import LocalServers
from sailor.megatron_patch.engine import TrainConfig
from sailor.megatron_patch.model import tiny_model
from sailor.megatron_patch.reference import ReferenceRun, train_reference
from sailor.schemas.runtime import Phase
from tests.integration.cluster_kit import Cluster
from tests.integration.conftest import free_port

pytestmark = pytest.mark.usefixtures("no_task_leak")

GBS = 4
# fp32 rounding of different reduction orders (tests/integration/test_checkpoint_resume.py
# measured <= 2.4e-7 across layouts).
LOSS_ATOL = 2e-6
WORKER = (*DEFAULT_WORKER_ARGV, "--min-step-s", "0.1", "--timeout-s", "60")


class RealCluster(Cluster):
    def __init__(self, tmp: Path, servers: LocalServers) -> None:
        super().__init__(tmp, servers)
        self.worker = WORKER
        self.base_port = free_port()
        self.ctl_update = {
            "planner": "sailor",
            "model": "tiny-gpt",
            "global_batch_size": GBS,
            "base_port": self.base_port,
        }

    def losses(self) -> dict[tuple[int, int], float]:
        """(generation, step) -> loss, from every rank-0 progress file of every agent."""
        out: dict[tuple[int, int], float] = {}
        for f in sorted(self.tmp.glob("agents/*/gen-*/progress-0.jsonl")):
            gen = int(f.parent.name.split("-")[1])
            for line in f.read_text().splitlines():
                rec = json.loads(line)
                if rec.get("event") == "step":
                    out[(gen, int(rec["step"]))] = float(rec["loss"])
        return out


def _reference(steps: int) -> ReferenceRun:
    """The uninterrupted single-process run, on one torch thread. torch's default (one per
    core) spins at a barrier each op waiting for the other thread: on the 2 shared cores, 30
    tiny-gpt steps took 4.6-8.1 CPU-s on two threads and 1.2-1.4 on one (the same losses,
    bit for bit; the workers train on one thread too)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train_reference(tiny_model("tiny-gpt", GBS), GBS, steps, TrainConfig(seed=0))
    finally:
        torch.set_num_threads(before)


@pytest.fixture
async def real(tmp_path: Path, servers: LocalServers) -> AsyncIterator[RealCluster]:
    async with RealCluster(tmp_path, servers) as c:
        yield c


async def test_join_then_preemption_with_real_workers(real: RealCluster) -> None:
    loop = asyncio.get_running_loop()
    real.start_controller("c1")
    real.start_agent("n1", gpu="cpu", watch_file=True)
    ctl = await real.wait_phase(Phase.RUNNING, 60)
    await real.wait_step(ctl, ["n1"], 2, 30)

    real.start_agent("n2", gpu="cpu")
    ctl = await real.wait_phase(Phase.RUNNING, 90, after_gen=ctl.desired.generation)
    d = ctl.desired
    assert sorted(d.placement) == ["n1", "n2"] and d.load_step > 0
    assert d.plan is not None and d.plan.num_gpus == 2
    await real.wait_step(ctl, ["n1", "n2"], d.load_step + 2, 30)

    # a torn save below the recorded commit (a crashed earlier attempt): the notice's save
    # prunes below the newest recorded commit (keep_checkpoints=1) once it commits
    torn = real.tmp / "ckpt" / step_dir(d.load_step - 1)
    torn.mkdir(parents=True)
    (torn / "part-x-00000.json").write_text("{}")
    # a commit the controller does not know, above every prune point (made after the etcd
    # snapshot a cluster is restored from, or another job's): the notice's committer,
    # told only the saves the controller gave up on (drop_steps: none), leaves it
    orphan = real.tmp / "ckpt" / step_dir(1_000_000)
    shutil.copytree(real.tmp / "ckpt" / step_dir(d.load_step), orphan)
    t_notice = loop.time()
    (real.tmp / "preempt-n1").write_text(json.dumps({"in_s": 30}))
    ctl = await real.wait_phase(Phase.RUNNING, 60, after_gen=d.generation)
    d2 = ctl.desired
    assert list(d2.placement) == ["n2"] and d2.load_step > d.load_step
    recs = read_records(sorted(real.tmp.glob("audit-*.jsonl")))
    commits = {int(r["step"]): float(r["time"]) for r in recs if r["kind"] == "commit"}
    assert d.load_step in commits and d2.load_step in commits
    # the checkpoint of the preemption was committed inside the notice's deadline
    assert d2.load_step == max(commits)
    assert loop.time() - t_notice < 30
    # the committer (rank 0 of the real worker) pruned it, and kept both recorded commits
    assert not torn.exists() and orphan.is_dir()
    kept = committed_steps(LocalStorage(real.tmp / "ckpt"))
    assert kept == [d.load_step, d2.load_step, 1_000_000], kept
    await real.wait_step(ctl, ["n2"], d2.load_step + 2, 30)
    # online calibration's input: the real worker times its microbatches apart from the rest
    timings = real.agents["n2"][0].status().timings
    assert timings and timings[0].rank in d2.placement["n2"], timings
    for t in timings:
        assert t.fwd_s > 0 and t.bwd_s > 0 and t.microbatches >= 1
        assert t.microbatches * (t.fwd_s + t.bwd_s) <= t.step_s, t
    plans = [r for r in recs if r["kind"] == "plan"]
    assert plans and all("sailor planner" in r["reason"] for r in plans)

    losses = real.losses()
    last = max(s for _g, s in losses)
    # off the loop: the controllers and agents of this test share it (a leader's 1 s lease
    # expired while the reference trained on it, under load)
    ref = (await asyncio.to_thread(_reference, last)).losses
    for (gen, step), loss in sorted(losses.items()):
        assert abs(loss - ref[step - 1]) <= LOSS_ATOL, (gen, step, loss, ref[step - 1])
    seen = {s for _g, s in losses}
    assert set(commits) <= seen
    await real.audit()


async def test_an_unreadable_checkpoint_is_passed_over(real: RealCluster) -> None:
    """n1 trains, n2 joins: the new layout resumes from the commit of the join. Then a
    shard of that checkpoint goes missing (a bad disk, a mount gone) and a worker dies: the
    relaunch cannot read the checkpoint. The controller marks the step unreadable instead of
    loading the same step and failing forever; with no other recorded commit it holds the
    job in IDLE, saying what to do, rather than starting it from step 0 (before, it did).
    The file put back and the mark cleared (``sailor checkpoint clear-bad``), the job
    resumes from that step; the audit accepts both."""
    real.start_controller("c1")
    real.start_agent("n1", gpu="cpu")
    ctl = await real.wait_phase(Phase.RUNNING, 60)
    await real.wait_step(ctl, ["n1"], 2, 30)
    real.start_agent("n2", gpu="cpu")
    ctl = await real.wait_phase(Phase.RUNNING, 90, after_gen=ctl.desired.generation)
    d = ctl.desired
    assert d.load_step > 0 and sorted(d.placement) == ["n1", "n2"]
    await real.wait_step(ctl, ["n1", "n2"], d.load_step + 1, 30)
    shards = sorted((real.tmp / "ckpt" / step_dir(d.load_step)).glob("layer-*"))
    assert shards
    aside = shards[0].with_name("aside")
    shards[0].rename(aside)
    real.agents["n2"][0].supervisor.workers[0].proc.kill()
    c = await real.wait_phase(Phase.IDLE, 120, after_gen=d.generation)
    assert c.desired is not None
    assert c.desired.bad_checkpoints == (d.load_step,), c.desired.cause
    assert c.desired.cause.startswith(UNLOADABLE_PREFIX), c.desired.cause
    assert "sailor checkpoint clear-bad" in c.desired.cause
    held = c.desired.generation
    recs = read_records(sorted(real.tmp.glob("audit-*.jsonl")))
    fell_back = f"checkpoint {d.load_step} unreadable from "
    assert any(
        fell_back in str(r.get("cause", "")) and "falling back" in str(r.get("cause", ""))
        for r in recs
    )
    aside.rename(shards[0])
    answer = await request_clear_bad(
        real.etcd, real.job, [d.load_step], False, "ops@test", real.security("c1"), 20
    )
    assert answer.done == (str(d.load_step),), answer
    c = await real.wait_phase(Phase.RUNNING, 120, after_gen=held)
    assert c.desired is not None and c.desired.load_step == d.load_step, c.desired
    await real.wait_step(c, sorted(c.desired.placement), d.load_step + 1, 30)
    await real.audit()
