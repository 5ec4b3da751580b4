"""The real worker speaks the agent's protocol and resumes under another layout exactly.

Two ranks of ``python -m sailor.training_process`` (tiny-gpt, CPU, gloo) in layout A (two
data-parallel replicas) are told through their control files to stop and save at step 3; two
ranks in layout B (one pipeline of two stages) resume from that checkpoint, reach step 5, hold there
until a save is asked for, save and stop. The losses of both runs must equal an
uninterrupted single-process reference at every step (fp32 rounding).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from sailor.checkpoint import LocalStorage, committed_steps, read_manifest
from sailor.megatron_patch.engine import TrainConfig
from sailor.megatron_patch.launch import free_port
from sailor.megatron_patch.model import tiny_model
from sailor.megatron_patch.reference import train_reference
from sailor.schemas import Pipeline, Plan, ReplicaGroup, Stage

GBS = 4
# Same bound as tests/integration/test_checkpoint_resume.py (measured gaps <= 2.4e-7).
LOSS_ATOL = 2e-6


def _replica() -> ReplicaGroup:
    return ReplicaGroup(gpu_type="cpu", zone="z", tp=1, gpus_per_node=1)


PLAN_A = Plan(
    plan_id="A",
    model="tiny-gpt",
    global_batch_size=GBS,
    pipelines=tuple(
        Pipeline(
            stages=(Stage(first_layer=0, last_layer=5, replica=_replica()),),
            microbatch_size=1,
            num_microbatches=2,
        )
        for _ in range(2)
    ),
)
PLAN_B = Plan(
    plan_id="B",
    model="tiny-gpt",
    global_batch_size=GBS,
    pipelines=(
        Pipeline(
            stages=(
                Stage(first_layer=0, last_layer=2, replica=_replica()),
                Stage(first_layer=3, last_layer=5, replica=_replica()),
            ),
            microbatch_size=2,
            num_microbatches=2,
        ),
    ),
)


class _Ranks:
    def __init__(self, tmp: Path, name: str, plan: Plan, ckpt: Path, load_step: int) -> None:
        self.dir = tmp / name
        self.dir.mkdir()
        (self.dir / "plan.json").write_text(plan.model_dump_json())
        self.control = self.dir / "control.json"
        self.control.write_text("{}")
        master = f"127.0.0.1:{free_port()}"
        self.procs = [
            subprocess.Popen(
                [
                    *(
                        sys.executable,
                        "-m",
                        "sailor.training_process",
                        "--plan",
                        str(self.dir / "plan.json"),
                    ),
                    *("--rank", str(r), "--world-size", str(plan.num_gpus), "--master", master),
                    *("--control", str(self.control), "--ckpt-dir", str(ckpt)),
                    *("--load-step", str(load_step), "--timeout-s", "60"),
                    *("--error-file", str(self.dir / "error-{rank}.json")),
                ],
                stdout=(self.dir / f"out-{r}.jsonl").open("w"),
                stderr=(self.dir / f"err-{r}.txt").open("w"),
            )
            for r in range(plan.num_gpus)
        ]

    def lines(self, rank: int) -> list[dict[str, object]]:
        text = (self.dir / f"out-{rank}.jsonl").read_text()
        return [json.loads(x) for x in text.splitlines() if x.startswith("{")]

    def control_write(self, obj: dict[str, object]) -> None:
        tmp = self.dir / "control.tmp"
        tmp.write_text(json.dumps(obj))
        tmp.replace(self.control)

    def wait_event(self, event: str, step: int, timeout: float = 90.0) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if all(
                any(x.get("event") == event and x.get("step") == step for x in self.lines(r))
                for r in range(len(self.procs))
            ):
                return
            if any(p.poll() not in (None, 0) for p in self.procs):
                break
            time.sleep(0.05)
        errs = [(self.dir / f"err-{r}.txt").read_text()[-1500:] for r in range(len(self.procs))]
        raise AssertionError(f"no {event} {step} on every rank: {errs}")

    def join(self) -> None:
        for p in self.procs:
            assert p.wait(timeout=60) == 0

    def losses(self) -> dict[int, float]:
        return {
            int(x["step"]): float(x["loss"])  # type: ignore[arg-type]
            for x in self.lines(0)
            if x.get("event") == "step"
        }


def test_stop_save_resume_under_another_layout(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    a = _Ranks(tmp_path, "a", PLAN_A, ckpt, -1)
    a.control_write({"stop_at_step": 3, "save_step": 3, "save_dir": str(ckpt)})
    a.wait_event("stopped", 3)
    a.join()
    assert [x["step"] for x in a.lines(0) if x.get("event") == "saved"] == [3]
    assert committed_steps(LocalStorage(str(ckpt))) == [3]
    assert read_manifest(LocalStorage(str(ckpt)), 3).consumed_samples == 3 * GBS

    b = _Ranks(tmp_path, "b", PLAN_B, ckpt, 3)
    b.control_write({"stop_at_step": 5})
    b.wait_event("step", 5)
    time.sleep(0.3)  # holding at the stop step: no further step, no exit
    assert all(p.poll() is None for p in b.procs)
    b.control_write({"stop_at_step": 5, "save_step": 5, "save_dir": str(ckpt)})
    b.wait_event("stopped", 5)
    b.join()
    assert committed_steps(LocalStorage(str(ckpt))) == [3, 5]

    ref = train_reference(tiny_model("tiny-gpt", GBS), GBS, 5, TrainConfig(seed=0)).losses
    got = {**a.losses(), **b.losses()}
    assert sorted(got) == [1, 2, 3, 4, 5]
    for step, loss in got.items():
        assert abs(loss - ref[step - 1]) <= LOSS_ATOL, (step, loss, ref[step - 1])
