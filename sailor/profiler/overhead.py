"""Framework memory overhead of a training process on this host (CPU, gloo).

What a worker process holds beyond model state and activations: gloo's communicator
buffers and threads, autograd's engine threads, the optimizer machinery, the data pipeline,
allocator arenas. Measured by running the real worker on a model too small to matter:

* a 2-stage pipeline (2 ranks on loopback, the local launcher, 3 steps) of a "nano" GPT
  (2 blocks, hidden 8, vocabulary 8, sequence 4: ~1,000 parameters, a few KiB of state and
  activations);
* each rank runs through :mod:`sailor.profiler.rss_probe`, which takes the baseline RSS after
  importing the worker and reports the peak RSS growth of the run;
* the overhead is the larger of the two ranks' growth, minus the nano model's modelled state
  and activations (16 bytes per parameter for fp32 AdamW plus its saved activations; under
  0.1 % of the result).

It becomes the :class:`~sailor.schemas.profile.DeviceOverhead` of the ``cpu`` GPU type, with
:data:`OVERHEAD_SOURCE` as its ``source``. On CUDA, context and NCCL buffers are what matter;
this measurement does not cover them (nothing is written for CUDA).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from sailor.schemas import ModelSpec, Pipeline, Plan, ReplicaGroup, Stage

__all__ = ["NANO_MODEL", "OVERHEAD_SOURCE", "measure_cpu_overhead"]

NANO_MODEL = ModelSpec(
    name="nano-gpt",
    num_layers=2,
    hidden_size=8,
    num_heads=1,
    ffn_hidden_size=8,
    seq_length=4,
    vocab_size=8,
    tie_embeddings=False,
    global_batch_size=2,
    precision="fp32",
)
"""A model whose tensors are negligible: what the worker costs without a model."""

OVERHEAD_SOURCE = (
    "peak RSS growth of a real worker rank (sailor.profiler.rss_probe; baseline after "
    "imports) training a 2-stage pipeline of a ~1k-parameter model for 3 steps on 2 gloo "
    "ranks on loopback, larger of the 2 ranks (sailor.profiler.overhead)"
)

_STEPS = 3


def _nano_plan() -> Plan:
    rg = ReplicaGroup(gpu_type="cpu", zone="local")
    last = NANO_MODEL.num_all_layers - 1
    return Plan(
        plan_id="overhead-probe",
        model=NANO_MODEL.name,
        global_batch_size=NANO_MODEL.global_batch_size,
        pipelines=(
            Pipeline(
                stages=(
                    Stage(first_layer=0, last_layer=1, replica=rg),
                    Stage(first_layer=2, last_layer=last, replica=rg),
                ),
                microbatch_size=1,
                num_microbatches=2,
            ),
        ),
    )


def measure_cpu_overhead(threads: int = 1, deadline_s: float = 180.0) -> int:
    """Bytes of process memory a CPU training rank holds beyond its tensors."""
    from sailor.megatron_patch.launch import launch_local

    with tempfile.TemporaryDirectory(prefix="sailor-overhead-") as tmp:
        work = Path(tmp)
        model_file = work / "nano.json"
        model_file.write_text(NANO_MODEL.model_dump_json())
        plan = _nano_plan()
        run = launch_local(
            plan,
            _STEPS,
            work,
            model=str(model_file),
            extra_args=["--threads", str(threads), "--rss-out", str(work / "rss-{rank}.json")],
            module="sailor.profiler.rss_probe",
            deadline_s=deadline_s,
        )
        if not run.ok:
            raise RuntimeError(f"overhead probe failed: {run.errors} {run.stderr[0][-1500:]}")
        growth = max(
            int(json.loads((work / f"rss-{r}.json").read_text())["growth_bytes"])
            for r in range(len(plan.ranks()))
        )
    # what the simulator will count for the nano model itself (fp32 AdamW: 16 B/param)
    tensors = 16 * NANO_MODEL.total_params
    return max(0, growth - tensors)
