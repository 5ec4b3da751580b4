"""Throughput of Sailor's training engine vs plain single-process torch, on this CPU.

Same model, same global batch, same data: the baseline is ``reference.train_reference``
in this process (1 intra-op thread, like each worker); the engine runs 1, 2 and 4 ranks
through real worker processes on gloo. Prints the setup, the machine and, per layout:
samples/s (median over the measured steps, first step excluded as warm-up), the ratio to
the baseline, time from process start to the end of the first step, group setup time and
the gradient-sync share of the step (the heterogeneous machinery's overhead).

Never asserts a timing. Run: ``.venv/bin/python benchmarks/engine_throughput.py``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
from pathlib import Path

import torch

from sailor.megatron_patch.engine import TrainConfig
from sailor.megatron_patch.launch import launch_local
from sailor.megatron_patch.reference import train_reference
from sailor.schemas.model import ModelSpec
from sailor.schemas.plan import Pipeline, Plan, ReplicaGroup, Stage

GBS = 16


def _spec() -> ModelSpec:
    return ModelSpec(
        name="bench-gpt",
        num_layers=4,
        hidden_size=128,
        num_heads=4,
        ffn_hidden_size=512,
        seq_length=64,
        vocab_size=512,
        global_batch_size=GBS,
        precision="fp32",
    )


def _stage(a: int, b: int, tp: int = 1) -> Stage:
    rg = ReplicaGroup(gpu_type="cpu", zone="local", tp=tp, gpus_per_node=4)
    return Stage(first_layer=a, last_layer=b, replica=rg)


def _layouts() -> dict[str, Plan]:
    last = _spec().num_all_layers - 1

    def plan(*pipes: Pipeline) -> Plan:
        return Plan(model="bench-gpt", global_batch_size=GBS, pipelines=pipes)

    return {
        "1 rank (1 pipeline, 1 stage)": plan(
            Pipeline(stages=(_stage(0, last),), microbatch_size=4, num_microbatches=4)
        ),
        "2 ranks (2 pipelines, data parallel)": plan(
            Pipeline(stages=(_stage(0, last),), microbatch_size=4, num_microbatches=2),
            Pipeline(stages=(_stage(0, last),), microbatch_size=4, num_microbatches=2),
        ),
        "4 ranks (2-stage uneven pipeline + TP=2 pipeline, mbs 2 vs 4)": plan(
            Pipeline(stages=(_stage(0, 2), _stage(3, last)), microbatch_size=2, num_microbatches=4),
            Pipeline(stages=(_stage(0, last, tp=2),), microbatch_size=4, num_microbatches=2),
        ),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    spec = _spec()
    print("== engine throughput ==")
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__}, python {platform.python_version()}"
    )
    print(
        f"model: {spec.num_layers} blocks, hidden {spec.hidden_size}, ffn "
        f"{spec.ffn_hidden_size}, seq {spec.seq_length}, vocab {spec.vocab_size}, "
        f"{spec.total_params / 1e6:.2f} M params; global batch {GBS}; fp32; "
        f"{args.steps} steps, first excluded"
    )

    torch.set_num_threads(1)
    ref = train_reference(spec, GBS, args.steps, TrainConfig(), microbatch_size=4)
    base = GBS / statistics.median(ref.step_s[1:])
    print(f"\nbaseline single-process torch (1 thread): {base:8.1f} samples/s")

    with tempfile.TemporaryDirectory() as tmp:
        model_path = Path(tmp) / "model.json"
        model_path.write_text(spec.model_dump_json())
        hdr = (
            f"{'layout':66s} {'samples/s':>9s} {'ratio':>6s} {'1st step':>9s} "
            f"{'groups':>7s} {'sync %':>7s} {'loss ok':>7s}"
        )
        print("\n" + hdr)
        for name, plan in _layouts().items():
            work = Path(tmp) / name.split()[0]
            run = launch_local(plan, args.steps, work, model=str(model_path), deadline_s=600)
            if not run.ok:
                print(f"{name:66s} FAILED {run.returncodes} {[e for e in run.errors if e]}")
                continue
            world = len(plan.ranks())
            steps = [s for r in range(world) for s in run.steps(r)[1:]]
            sps = statistics.median(s["samples_per_s"] for s in steps)
            sync = statistics.median(s["sync_s"] / s["step_s"] for s in steps)
            first = max(run.steps(r)[0]["since_start_s"] for r in range(world))
            ready = [e for r in range(world) for e in run.progress[r] if e["event"] == "ready"]
            groups = max(e["group_setup_s"] for e in ready)
            losses = [s["loss"] for s in run.steps(0)]
            same = all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(losses, ref.losses, strict=True))
            print(
                f"{name:66s} {sps:9.1f} {sps / base:6.2f} {first:8.1f}s {groups:6.2f}s "
                f"{100 * sync:6.1f}% {same!s:>7s}"
            )
    print(
        "\nratio: engine samples/s / baseline; 1st step: seconds from process start to the "
        "end of iteration 1 (slowest rank; includes importing torch and rendezvous); "
        "groups: process-group setup incl. rendezvous; sync %: weighted gradient sync share "
        "of the step (median over ranks and steps). With 2 cores, 4 ranks oversubscribe."
    )


if __name__ == "__main__":
    main()
