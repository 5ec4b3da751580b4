"""Framework memory overhead of a training process on this host (CPU, gloo).

What a worker process holds beyond model state and activations: gloo's communicator
buffers and threads, autograd's engine threads, the optimizer machinery, allocator arenas.
Measured with two gloo ranks on loopback, each doing everything a worker does before and
around training except holding a model:

1. import torch, torch.distributed and the worker module (the baseline is taken *after*
   this, as :mod:`sailor.profiler.rss_worker` takes it for a real worker);
2. reset the kernel's peak-RSS counter; ``init_process_group`` (gloo), one ``new_group``;
3. one send/recv pair and one all-reduce of a small tensor;
4. one forward/backward of a 1x1 linear layer and one AdamW step (autograd engine and
   optimizer start-up, with negligible tensors).

The overhead is the larger of the two ranks' peak-RSS growth. It becomes the
:class:`~sailor.schemas.profile.DeviceOverhead` of the ``cpu`` GPU type, with this
description as its ``source``. On CUDA, context and NCCL buffers are what matter; this
measurement does not cover them (nothing is written for CUDA).
"""

from __future__ import annotations

import sys

from sailor.profiler.procs import run_ranks

__all__ = ["OVERHEAD_SOURCE", "measure_cpu_overhead"]

OVERHEAD_SOURCE = (
    "peak RSS growth of a gloo rank (2 ranks on loopback) from after imports through "
    "init_process_group, new_group, one send/recv, one all-reduce, and one fwd/bwd + AdamW "
    "step of a 1x1 linear (sailor.profiler.overhead)"
)


def measure_cpu_overhead(threads: int = 1, deadline_s: float = 120.0) -> int:
    """Bytes of process memory a CPU training rank adds beyond its tensors (max of 2 ranks)."""
    res = run_ranks("sailor.profiler.overhead", 2, {"threads": threads}, deadline_s=deadline_s)
    return max(int(r["growth_bytes"]) for r in res)


def _rank_main(argv: list[str] | None = None) -> int:
    import torch
    import torch.distributed as dist

    import sailor.megatron_patch.worker  # noqa: F401 - same imports as a worker's baseline
    from sailor.megatron_patch.engine import TrainConfig, make_optimizer
    from sailor.profiler.memory import peak_rss_bytes, reset_peak_rss, rss_bytes
    from sailor.profiler.procs import init_gloo, rank_args, write_result

    args, cfg = rank_args(argv)
    torch.set_num_threads(int(cfg["threads"]))
    base = rss_bytes()
    reset_peak_rss()
    init_gloo(args)
    dist.new_group(list(range(args.world_size)))
    t = torch.ones(16)
    if args.rank == 0:
        dist.send(t, dst=1)
    else:
        dist.recv(t, src=0)
    dist.all_reduce(t)
    lin = torch.nn.Linear(1, 1)
    opt = make_optimizer(lin.parameters(), TrainConfig())
    lin(torch.ones(1, 1)).sum().backward()
    opt.step()
    dist.barrier()
    growth = peak_rss_bytes() - base
    write_result(args, {"rank": args.rank, "growth_bytes": growth, "baseline_bytes": base})
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(_rank_main())
