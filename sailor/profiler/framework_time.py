"""Framework time outside the layers: what one training iteration costs beyond its layers.

The layer profile times each layer's forward, backward and optimizer update. A training
iteration of ``megatron_patch`` also zeroes gradients, walks the 1F1B schedule, reads and
builds each microbatch from the data set, scales and reports the loss, steps one optimizer
over all parameters and ends with an all-reduce. On a large GPU model that is noise; on a
small model on a CPU it is a large part of the step. It is measured here, on the real
engine (:class:`~sailor.megatron_patch.engine.Trainer`), never on the plans it will
predict:

* **the engine with trivial layers.** The ``nano`` GPT of :mod:`overhead` (~1,000
  parameters, layers of a few tens of µs), one stage, one rank (a gloo group of one), at
  microbatch size 1 with ``m = 1`` and ``m = M`` microbatches; the two trainers step in
  turns, so a change of load on a shared host hits both alike. With ``T(m)`` the central
  step time and the nano model's own in-place layer profile (:mod:`in_situ`: fwd ``F``,
  bwd ``B``, update ``U`` summed over its layers, at mbs 1) and its data time per sample
  ``d_nano``:

  - per microbatch: ``microbatch_s = (T(M) − T(1)) / (M − 1) − F − B − d_nano``;
  - per iteration: ``iteration_s = T(1) − (T(M) − T(1)) / (M − 1) − U``.

* **the data pipeline per sample**, ``sample_s``: the engine's data set
  (:class:`~sailor.megatron_patch.data.SyntheticTokens`) at the profiled model's vocabulary
  and sequence length, a batch of :data:`DATA_BATCH` samples read repeatedly, per sample.

Negative residuals (noise: the nano layers are timed apart from the steps) are clamped to
zero. Both engine figures are fixed costs: the nano model has too few parameters for any
per-parameter work to show. The simulator adds ``microbatch_s`` to every stage's forward,
``sample_s × mbs`` to a stage that reads data (first and last), and ``iteration_s`` to every
stage's end of iteration (docs/simulator-model.md). The figures go into
``ProfileDB.framework`` as a :class:`~sailor.schemas.profile.FrameworkTime` of the device.

CPU only (the nano trainer runs on gloo); nothing is written for CUDA.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

from sailor.profiler.timing import RepeatSettings, Stats
from sailor.schemas import ModelSpec, Pipeline, Plan, ReplicaGroup, Stage
from sailor.schemas.profile import FrameworkTime

__all__ = [
    "DATA_BATCH",
    "FRAMEWORK_SOURCE",
    "FrameworkRun",
    "framework_from",
    "measure_framework_time",
]

DATA_BATCH = 8
"""Samples per timed data read (the tiny models' global batch)."""

FRAMEWORK_SOURCE = (
    "real megatron_patch Trainer on the nano GPT (1 rank, 1 stage, mbs 1, m=1 and m={m} "
    "stepping in turns, {steps} steps each, {stat}) minus the nano model's in-place layer "
    "profile; data per sample from SyntheticTokens at the model's sequence length "
    "(sailor.profiler.framework_time)"
)


@dataclass(frozen=True)
class FrameworkRun:
    """Raw figures of one measurement, seconds (central values of the statistic used)."""

    step_one_s: float
    """Step time with one microbatch."""
    step_many_s: float
    """Step time with ``microbatches`` microbatches."""
    microbatches: int
    nano_fwd_bwd_s: float
    """The nano model's layers, forward + backward at mbs 1, summed."""
    nano_update_s: float
    """The nano model's per-layer optimizer updates, summed."""
    nano_sample_s: float
    """Data time of one nano sample."""
    sample_s: float
    """Data time of one sample of the profiled model."""


def framework_from(run: FrameworkRun, gpu_type: str, source: str) -> FrameworkTime:
    """The :class:`FrameworkTime` of one measurement (formulas in the module docstring)."""
    if run.microbatches < 2:
        raise ValueError(f"microbatches={run.microbatches}: need >= 2 to separate the terms")
    per_mb = (run.step_many_s - run.step_one_s) / (run.microbatches - 1)
    return FrameworkTime(
        gpu_type=gpu_type,
        iteration_s=max(0.0, run.step_one_s - per_mb - run.nano_update_s),
        microbatch_s=max(0.0, per_mb - run.nano_fwd_bwd_s - run.nano_sample_s),
        sample_s=max(0.0, run.sample_s),
        source=source,
    )


def measure_framework_time(
    spec: ModelSpec,
    gpu_type: str = "cpu",
    threads: int = 1,
    statistic: str = "median",
    microbatches: int = 8,
    steps: int = 40,
    deadline_s: float = 300.0,
) -> tuple[FrameworkTime, FrameworkRun]:
    """Measure the framework time of the CPU engine in a fresh one-rank process."""
    from sailor.profiler.procs import run_ranks

    cfg = {
        "model": spec.model_dump(mode="json"),
        "threads": threads,
        "statistic": statistic,
        "microbatches": microbatches,
        "steps": steps,
    }
    res = run_ranks("sailor.profiler.framework_time", 1, cfg, deadline_s=deadline_s)[0]
    run = FrameworkRun(**res["run"])
    source = FRAMEWORK_SOURCE.format(m=microbatches, steps=steps, stat=statistic)
    return framework_from(run, gpu_type, source), run


def _nano_plan(m: int) -> Plan:
    from sailor.profiler.overhead import NANO_MODEL

    rg = ReplicaGroup(gpu_type="cpu", zone="local")
    last = NANO_MODEL.num_all_layers - 1
    return Plan(
        plan_id=f"framework-probe-m{m}",
        model=NANO_MODEL.name,
        global_batch_size=m,
        pipelines=(
            Pipeline(
                stages=(Stage(first_layer=0, last_layer=last, replica=rg),),
                microbatch_size=1,
                num_microbatches=m,
            ),
        ),
    )


def _data_per_sample(vocab: int, seq: int, statistic: str, reps: int = 30) -> float:
    from sailor.megatron_patch.data import SyntheticTokens

    data = SyntheticTokens(vocab, seq, 0)
    times: list[float] = []
    for i in range(reps + 3):
        t0 = time.perf_counter()
        data.batch(range(i * DATA_BATCH, (i + 1) * DATA_BATCH))
        if i >= 3:
            times.append((time.perf_counter() - t0) / DATA_BATCH)
    return Stats.of(times).central(statistic)


def _rank_main(argv: list[str] | None = None) -> int:
    import torch

    from sailor.megatron_patch.engine import TrainConfig, Trainer
    from sailor.megatron_patch.groups import build_process_groups
    from sailor.megatron_patch.roles import role_of
    from sailor.profiler.in_situ import measure_model
    from sailor.profiler.overhead import NANO_MODEL
    from sailor.profiler.procs import init_gloo, rank_args, write_result

    args, cfg = rank_args(argv)
    torch.set_num_threads(int(cfg["threads"]))
    init_gloo(args, timeout_s=120.0)
    stat = str(cfg["statistic"])
    m = int(cfg["microbatches"])
    steps = int(cfg["steps"])
    target = ModelSpec.model_validate(cfg["model"])
    dev = torch.device("cpu")
    trainers = []
    for k in (1, m):
        plan = _nano_plan(k)
        spec = NANO_MODEL.model_copy(update={"global_batch_size": k})
        role = role_of(plan, 0)
        groups = build_process_groups(plan, role, spec.tie_embeddings, 120.0)
        trainers.append(Trainer(plan, spec, role, groups, TrainConfig(), dev))
    for _ in range(5):
        for tr in trainers:
            tr.train_step()
    one: list[float] = []
    many: list[float] = []
    for _ in range(steps):
        one.append(trainers[0].train_step().step_s)
        many.append(trainers[1].train_step().step_s)
    layers = measure_model(NANO_MODEL, 1, dev, RepeatSettings(min_reps=20, max_reps=200))
    run = FrameworkRun(
        step_one_s=Stats.of(one).central(stat),
        step_many_s=Stats.of(many).central(stat),
        microbatches=m,
        nano_fwd_bwd_s=sum(x.fwd.central(stat) + x.bwd.central(stat) for x in layers),
        nano_update_s=sum(x.update.central(stat) for x in layers),
        nano_sample_s=_data_per_sample(NANO_MODEL.vocab_size, NANO_MODEL.seq_length, stat),
        sample_s=_data_per_sample(target.vocab_size, target.seq_length, stat),
    )
    write_result(args, {"run": run.__dict__})
    import torch.distributed as dist

    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(_rank_main())
