"""The worker side of in-place reconfiguration, against the restart path.

Real processes of ``python -m sailor.training_process`` (tiny-gpt, CPU, gloo), driven by a
small harness that writes control files and relayout directives exactly as the agent will
(``docs/runtime.md``; ``docs/training.md``, "In-place reconfiguration"). Each in-place
run is compared with the restart path: fresh processes resuming from the checkpoint of the
same step under the same plans. Losses and the saved state (weights, both AdamW moments)
must be equal bitwise: the state a relayout installs is the checkpoint's, bit for bit, and
the layouts (so the reduction orders) are the same on both paths.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from sailor.checkpoint import LocalStorage, load
from sailor.comm.nccl_replay import replay
from sailor.comm.strict import ENV_VAR, read_logs
from sailor.megatron_patch.launch import free_port
from sailor.schemas import Pipeline, Plan, ReplicaGroup, Stage

pytestmark = pytest.mark.slow

GBS = 4
LAYERS = 6  # tiny-gpt: embedding, 4 blocks, head


def _plan(pid: str, *pipes: tuple[tuple[tuple[int, int, int], ...], int, int]) -> Plan:
    return Plan(
        plan_id=pid,
        model="tiny-gpt",
        global_batch_size=GBS,
        pipelines=tuple(
            Pipeline(
                stages=tuple(
                    Stage(
                        first_layer=a,
                        last_layer=b,
                        replica=ReplicaGroup(gpu_type="cpu", zone="z", tp=tp, gpus_per_node=2),
                    )
                    for a, b, tp in stages
                ),
                microbatch_size=mbs,
                num_microbatches=nmb,
            )
            for stages, mbs, nmb in pipes
        ),
    )


ONE = _plan("one", (((0, 5, 1),), 1, 4))
PP2 = _plan("pp2", (((0, 2, 1), (3, 5, 1)), 1, 4))
DP2 = _plan("dp2", (((0, 5, 1),), 1, 2), (((0, 5, 1),), 1, 2))
# a TP-2 replica beside a TP-1 one: the fresh rank gets TP shards of every layer
DP_TP = _plan("dptp", (((0, 5, 1),), 1, 2), (((0, 5, 2),), 1, 2))
DP3 = _plan("dp3", (((0, 5, 1),), 1, 2), (((0, 5, 1),), 1, 1), (((0, 5, 1),), 1, 1))


class _Job:
    """Worker processes of one test and the files the agent would write for them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        # the workers' rendezvous and collective timeout: the tests wait for ranks to meet
        # within it (a loaded 2-core host took over 20 s), and one waits it out (it sets 20)
        self.timeout_s = 60.0

    def plan_file(self, plan: Plan) -> str:
        path = self.root / f"plan-{plan.plan_id}.json"
        # atomically: each argv() call writes it again, while a rank given an earlier argv
        # may be reading it (a truncated file read as '' failed a run)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(plan.model_dump_json())
        tmp.replace(path)
        return str(path)

    def argv(
        self,
        gen: str,
        plan: Plan,
        rank: int,
        master: str,
        ckpt: Path | None = None,
        load_step: int = -1,
        in_place: bool = True,
    ) -> list[str]:
        d = self.root / gen
        d.mkdir(exist_ok=True)
        out = [
            *("--plan", self.plan_file(plan), "--rank", str(rank)),
            *("--world-size", str(len(plan.ranks())), "--master", master),
            *("--control", str(d / f"control-{rank}.json"), "--timeout-s", str(self.timeout_s)),
            *(
                "--error-file",
                str(d / "error-{rank}.json"),
                "--progress",
                str(d / "p-{rank}.jsonl"),
            ),
            *("--poll-s", "0.02", "--pause-timeout-s", "120"),
        ]
        if ckpt is not None:
            out += ["--ckpt-dir", str(ckpt), "--load-step", str(load_step)]
        return [*out, "--in-place"] if in_place else out

    def control(self, gen: str, ranks: range | list[int], obj: dict[str, Any]) -> None:
        """Write the control file of each of ``ranks`` (one per worker process: a directive
        carries one rank's argv) atomically."""
        d = self.root / gen
        d.mkdir(exist_ok=True)
        for r in ranks:
            tmp = d / f"control-{r}.tmp"
            tmp.write_text(json.dumps(obj))
            tmp.replace(d / f"control-{r}.json")

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        log = self.root / f"proc-{name}"
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "sailor.training_process", *argv],
            stdout=(log.with_suffix(".out")).open("w"),
            stderr=(log.with_suffix(".err")).open("w"),
            env={**os.environ, **(env or {})},
        )

    def lines(self, gen: str, rank: int) -> list[dict[str, Any]]:
        path = self.root / gen / f"p-{rank}.jsonl"
        if not path.exists():
            return []
        return [json.loads(x) for x in path.read_text().splitlines() if x.startswith("{")]

    def wait_for(
        self, gen: str, ranks: range, pred: Any, what: str, timeout: float = 120.0
    ) -> list[dict[str, Any]]:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            found = [next((x for x in self.lines(gen, r) if pred(x)), None) for r in ranks]
            if all(f is not None for f in found):
                return [f for f in found if f is not None]
            if any(p.poll() not in (None, 0) for p in self.procs.values() if p is not None):
                break
            time.sleep(0.05)
        raise AssertionError(f"{gen}: no {what} on ranks {list(ranks)}: {self.tails()}")

    def tails(self) -> dict[str, str]:
        return {
            n: (self.root / f"proc-{n}.err").read_text()[-1200:]
            for n in self.procs
            if (self.root / f"proc-{n}.err").exists()
        }

    def held(self, gen: str, ranks: range, step: int, broken: bool = False) -> None:
        self.wait_for(
            gen,
            ranks,
            lambda x: x.get("event") == "held" and x["step"] == step and x["broken"] == broken,
            f"held at {step}",
        )

    def terminate(self, names: list[str]) -> None:
        for n in names:
            self.procs[n].send_signal(signal.SIGTERM)
        for n in names:
            assert self.procs[n].wait(timeout=60) == 0, (n, self.tails()[n])

    def join(self, names: list[str]) -> None:
        for n in names:
            assert self.procs[n].wait(timeout=120) == 0, (n, self.tails()[n])

    def losses(self, gen: str) -> dict[int, float]:
        return {x["step"]: x["loss"] for x in self.lines(gen, 0) if x.get("event") == "step"}

    def ready(self, gen: str, rank: int) -> dict[str, Any]:
        return next(x for x in self.lines(gen, rank) if x.get("event") == "ready")


def running_job(tmp_path: Path) -> Iterator[_Job]:
    """The test's processes; any still running at the end (a failed test) are killed (the
    body of this file's ``job`` fixture and of the GPU tests')."""
    j = _Job(tmp_path)
    yield j
    for p in j.procs.values():
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.fixture
def job(tmp_path: Path) -> Iterator[_Job]:
    yield from running_job(tmp_path)


def _directive(job: _Job, old_gen: str, old_rank: int, generation: int, argv: list[str]) -> None:
    job.control(old_gen, [old_rank], {"relayout": {"generation": generation, "argv": argv}})


def _stop_save(job: _Job, gen: str, ranks: range, step: int, ckpt: Path) -> None:
    job.control(gen, ranks, {"stop_at_step": step, "save_step": step, "save_dir": str(ckpt)})


def _held_pp2(job: _Job, ckpt: Path, env: dict[str, str] | None = None) -> str:
    """Two fresh ``--in-place`` ranks of PP2 (generation ``g0``, processes ``w0``, ``w1``)
    told to stop and save at step 2 into ``ckpt``, once both hold there: the set-up of each
    relayout test. Returns the world's master address."""
    m0 = f"127.0.0.1:{free_port()}"
    for r in range(2):
        job.start(f"w{r}", job.argv("g0", PP2, r, m0), env)
    _stop_save(job, "g0", range(2), 2, ckpt)
    job.held("g0", range(2), 2)
    return m0


def _state(root: Path, step: int) -> dict[str, tuple[torch.Tensor, ...]]:
    got = load(LocalStorage(str(root)), range(LAYERS), step=step).params
    return {k: (p.weight, p.exp_avg, p.exp_avg_sq) for k, p in got.items()}


def _assert_same_state(a: Path, b: Path, step: int) -> None:
    x, y = _state(a, step), _state(b, step)
    assert x.keys() == y.keys()
    for k in x:
        for u, v in zip(x[k], y[k], strict=True):
            assert torch.equal(u, v), (k, step, float((u - v).abs().max()))


def _restart(
    job: _Job, gen: str, plan: Plan, src: Path, step: int, stop: int, ckpt: Path
) -> dict[int, float]:
    """The restart path: fresh processes resume from ``src`` at ``step``, save at ``stop``."""
    master = f"127.0.0.1:{free_port()}"
    n = len(plan.ranks())
    _stop_save(job, gen, range(len(plan.ranks())), stop, ckpt)
    names = [f"{gen}-{r}" for r in range(n)]
    for r in range(n):
        job.start(names[r], job.argv(gen, plan, r, master, src, step, in_place=False))
    job.wait_for(gen, range(n), lambda x: x.get("event") == "stopped", "stopped")
    job.join(names)
    return job.losses(gen)


def test_stop_relayout_to_data_parallel_then_grow_with_a_fresh_rank(
    tmp_path: Path, job: _Job
) -> None:
    """(a) PP2 --stop/save at 2--> DP2 (both kept, in place) --stop/save at 4--> DP_TP, a
    third, fresh --in-place process joining as a TP shard; equal to the restart path."""
    ip, rs = tmp_path / "ckpt-ip", tmp_path / "ckpt-rs"
    env = {ENV_VAR: str(tmp_path / "strict")}  # every call checked under NCCL's rules
    m0 = _held_pp2(job, ip, env)

    m1 = f"127.0.0.1:{free_port()}"
    _stop_save(job, "g1", range(2), 4, ip)
    # a 1 KiB receive budget: every layer its own batch of the exchange (NCCL pairing
    # across batches is replayed below); the next relayout takes the default, one batch.
    # The held stages go to "host memory" first (the host is the device here: nothing
    # moves, but every send is staged and counted in its batch, as on a GPU)
    small = ["--exchange-bucket-mb", str(1 / 1024), "--relayout-offload", "always"]
    for r in range(2):
        _directive(job, "g0", r, 1, [*job.argv("g1", DP2, r, m1, ip, 2), *small])
    job.held("g1", range(2), 4)
    r0, r1 = job.ready("g1", 0), job.ready("g1", 1)
    assert r0["path"] == "in_place" and r0["checkpoint_keys"] == r1["checkpoint_keys"] == 0
    assert r0["kept_keys"] > 0 and r0["received_keys"] > 0 and r0["bytes_received"] > 0
    assert r0["batches"] > 1 and r1["batches"] > 1, (r0, r1)
    assert r0["memory"] == r1["memory"] == "offload" and r0["offloaded_bytes"] == 0
    # the receive buffers' peak is one layer's, not everything received
    assert 0 < r0["largest_batch_bytes"] < r0["bytes_received"] / 2, r0
    assert r0["start_step"] == 2 and r0["consumed_samples"] == 2 * GBS

    m2 = f"127.0.0.1:{free_port()}"
    _stop_save(job, "g2", range(3), 6, ip)
    job.start("fresh", job.argv("g2", DP_TP, 2, m2, ip, 4), env)
    for r in range(2):
        _directive(job, "g1", r, 2, job.argv("g2", DP_TP, r, m2, ip, 4))
    job.held("g2", range(3), 6)
    fresh = job.ready("g2", 2)
    assert fresh["memory"] == "keep"  # auto, off a GPU
    assert fresh["kept_keys"] == 0 and fresh["checkpoint_keys"] == 0
    assert fresh["batches"] == 1
    assert fresh["largest_batch_bytes"] == fresh["bytes_received"] > 0
    assert fresh["received_keys"] > 0 and fresh["start_step"] == 4
    print("in-place 2->3 (ranks 0, 1 held, 2 fresh):", _ready_times(job, "g2", range(3)))
    job.terminate(["w0", "w1", "fresh"])
    got = {**job.losses("g0"), **job.losses("g1"), **job.losses("g2")}
    assert sorted(got) == [1, 2, 3, 4, 5, 6]

    want = _restart(job, "r1", DP2, ip, 2, 4, rs)
    want |= _restart(job, "r2", DP_TP, rs, 4, 6, rs)
    assert {s: got[s] for s in want} == want
    _assert_same_state(ip, rs, 4)
    _assert_same_state(ip, rs, 6)
    print("restart 2->3 (fresh processes):", _ready_times(job, "r2", range(3)))
    # each world's calls, the exchanges included, replay under NCCL's semantics
    for m, n in ((m0, 2), (m1, 2), (m2, 3)):
        logs = read_logs(tmp_path / "strict" / f"world-{m.replace(':', '-')}")
        assert sorted(logs) == list(range(n))
        res = replay(logs)
        assert res.ok, res.message
    assert any(op.kind == "recv" for op in logs[2])


def _ready_times(job: _Job, gen: str, ranks: range) -> list[dict[str, float]]:
    return [
        {k: round(v, 3) for k, v in job.ready(gen, r).items() if k.endswith("_s")} for r in ranks
    ]


@pytest.mark.long  # CI: the demo test hands ranks to warm spares
def test_warm_spare_becomes_a_rank(tmp_path: Path, job: _Job) -> None:
    """(b) One rank holds at its stop step; a ``--warm`` spare (placeholder arguments)
    becomes rank 1 of a DP2 world and gets every layer from it; equal to the restart path."""
    ip, rs = tmp_path / "ckpt-ip", tmp_path / "ckpt-rs"
    warm_control = tmp_path / "warm-control.json"
    job.start(
        "spare",
        [
            *("--plan", "", "--rank", "-1", "--world-size", "1", "--master", ""),
            *("--control", str(warm_control), "--warm", "--poll-s", "0.02"),
        ],
    )
    job.start("w0", job.argv("g0", ONE, 0, f"127.0.0.1:{free_port()}"))
    _stop_save(job, "g0", range(1), 2, ip)
    job.held("g0", range(1), 2)
    out = tmp_path / "proc-spare.out"
    end = time.monotonic() + 60
    while '"event": "warm"' not in out.read_text() and time.monotonic() < end:
        time.sleep(0.05)
    assert '"event": "warm"' in out.read_text()

    m1 = f"127.0.0.1:{free_port()}"
    _stop_save(job, "g1", range(2), 4, ip)
    _directive(job, "g0", 0, 1, job.argv("g1", DP2, 0, m1, ip, 2))
    tmp = tmp_path / "warm.tmp"
    argv = job.argv("g1", DP2, 1, m1, ip, 2)
    tmp.write_text(json.dumps({"relayout": {"generation": 1, "argv": argv}}))
    tmp.replace(warm_control)
    job.held("g1", range(2), 4)
    spare = job.ready("g1", 1)
    assert spare["kept_keys"] == 0 and spare["received_keys"] > 0
    assert spare["checkpoint_keys"] == 0 and spare["start_step"] == 2
    assert job.ready("g1", 0)["kept_keys"] > 0 and job.ready("g1", 0)["received_keys"] == 0
    print("warm spare 1->2:", _ready_times(job, "g1", range(2)))
    job.terminate(["w0", "spare"])

    want = _restart(job, "r1", DP2, ip, 2, 4, rs)
    got = job.losses("g1")
    assert sorted(want) == [3, 4] and {s: got[s] for s in want} == want
    _assert_same_state(ip, rs, 4)


@pytest.mark.long  # CI: the demo test loses a node in place (real workers, exact losses)
def test_loss_without_notice_rolls_back_in_process(tmp_path: Path, job: _Job) -> None:
    """(c) Three DP ranks; rank 2 is killed with SIGKILL mid-training. The survivors hold
    broken within ~1 s (SIGUSR1 for any that does not, as the agent does); a directive
    with ``--load-step`` = the committed step rolls them back in process into DP2, which
    then trains exactly like the restart path from that checkpoint."""
    ip, rs = tmp_path / "ckpt-ip", tmp_path / "ckpt-rs"
    m0 = f"127.0.0.1:{free_port()}"
    for r in range(3):
        job.start(f"w{r}", [*job.argv("g0", DP3, r, m0), "--min-step-s", "0.3"])
    job.control("g0", range(3), {"save_step": 2, "save_dir": str(ip)})
    job.wait_for("g0", range(3), lambda x: x.get("event") == "saved", "saved")
    job.wait_for("g0", range(1), lambda x: x.get("event") == "step" and x["step"] >= 4, "step 4")
    job.procs["w2"].kill()
    job.procs["w2"].wait()
    killed = time.monotonic()
    del job.procs["w2"]
    broken = lambda x: x.get("event") == "held" and x["broken"]  # noqa: E731
    signalled = []
    for r in range(2):
        left = 1.0 - (time.monotonic() - killed)
        try:
            job.wait_for("g0", range(r, r + 1), broken, "held broken", timeout=max(left, 0.05))
        except AssertionError:
            job.procs[f"w{r}"].send_signal(signal.SIGUSR1)
            signalled.append(r)
    lines = job.wait_for("g0", range(2), broken, "held broken", timeout=5)
    held_after = time.monotonic() - killed
    print(f"held broken {held_after:.2f} s after the kill; SIGUSR1 to {signalled}:", lines)
    assert all(x["step"] >= 4 for x in lines)
    assert not (tmp_path / "g0" / "error-0.json").exists()

    m1 = f"127.0.0.1:{free_port()}"
    _stop_save(job, "g1", range(2), 4, ip)
    for r in range(2):
        _directive(job, "g0", r, 1, job.argv("g1", DP2, r, m1, ip, 2))
    job.held("g1", range(2), 4)
    for r in range(2):
        ready = job.ready("g1", r)
        assert ready["kept_keys"] == ready["received_keys"] == 0
        assert ready["checkpoint_keys"] > 0 and ready["start_step"] == 2
    job.terminate(["w0", "w1"])

    want = _restart(job, "r1", DP2, ip, 2, 4, rs)
    got = job.losses("g1")
    assert sorted(want) == [3, 4] and {s: got[s] for s in want} == want
    _assert_same_state(ip, rs, 4)


@pytest.mark.long  # CI: the runtime fallback test; make chaos: a failed relayout
def test_a_failure_inside_the_relayout_is_a_normal_failure(tmp_path: Path, job: _Job) -> None:
    """(d) Two held ranks are told to relayout; one is killed right away. The other must
    fail (error file, exit 1) within about its timeout, not hang."""
    job.timeout_s = 20.0  # waited out below
    ip = tmp_path / "ckpt-ip"
    _held_pp2(job, ip)
    m1 = f"127.0.0.1:{free_port()}"
    for r in range(2):
        _directive(job, "g0", r, 1, [*job.argv("g1", DP2, r, m1, ip, 2)[:-1], "--in-place"])
    job.procs["w1"].kill()
    t = time.monotonic()
    code = job.procs["w0"].wait(timeout=90)
    print(f"relayout failure: exit {code} after {time.monotonic() - t:.1f} s")
    assert code == 1
    record = json.loads((tmp_path / "g1" / "error-0.json").read_text())
    assert record["rank"] == 0 and record["retry"] is True


def test_a_relayout_on_other_data_is_refused_by_name(tmp_path: Path, job: _Job) -> None:
    """(e) Held ranks trained on synthetic data of seed 0 are told to relayout under seed 5
    (a directive whose configuration draws other samples): the data their state's
    consumed_samples index would change. Every rank refuses it before training, a
    configuration error naming ``data.seed`` with both values (the holders' data identity
    is part of the handshake); before, the relayout trained on over the new samples. The
    checkpoint of the step is not read at all here (every layer has a live holder), so only
    the handshake can see it."""
    ip = tmp_path / "ckpt-ip"
    _held_pp2(job, ip)
    m1 = f"127.0.0.1:{free_port()}"
    _stop_save(job, "g1", range(2), 4, ip)  # where the old code's relayout stopped and held
    for r in range(2):
        _directive(job, "g0", r, 1, [*job.argv("g1", DP2, r, m1, ip, 2), "--seed", "5"])
    for r in range(2):
        assert job.procs[f"w{r}"].wait(timeout=120) == 1, job.tails()
    for r in range(2):
        record = json.loads((tmp_path / "g1" / f"error-{r}.json").read_text())
        assert record["origin"] == "config" and record["retry"] is False, record
        assert "data.seed: trained with seed=0, this run has seed=5" in record["message"]
        assert "allow_data_change: true" in record["message"]
    assert job.losses("g1") == {}
