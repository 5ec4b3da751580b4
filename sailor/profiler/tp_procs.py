"""Layer measurements at TP degree > 1: the TP ranks run as real processes.

On CPU the ranks are gloo processes on this host; on CUDA each rank owns one GPU
(``cuda:rank``) and joins an NCCL group, so the block's all-reduces run over NVLink/PCIe as in
training, and every layer is timed with CUDA events (:mod:`in_situ`).

A TP-``t`` block is measured the way it trains: ``t`` processes, each holding its shard of
the block (:class:`~sailor.megatron_patch.tp_layers.TPContext` over a real process group),
all running the same forwards and backwards, so the block's all-reduces (one in forward
after the row-parallel matmuls, one in backward of the column-parallel input) are part of
the measured time, as is the contention of ``t`` ranks on one host. The embedding and the
head are split by vocabulary over the TP ranks (``megatron_patch.vocab_parallel``): their
all-reduces (the embedding's sum, the loss's max, sum and target logit) are measured the same
way.

Every rank must run the same number of repetitions (a block's all-reduce pairs them), so
the adaptive "repeat until ``min_time_s``" rule is replaced by a fixed count. The result per
field is the **slowest rank** (largest median): a TP group moves at the pace of its slowest
member. :func:`~sailor.profiler.layers.profile_layers` starts the ranks afresh for each
microbatch size, so a rank that fails (out of GPU memory at the largest) loses that one.

Run as a module by :func:`~sailor.profiler.procs.run_ranks`; never imports the planner.
"""

from __future__ import annotations

import sys
from dataclasses import asdict
from typing import Any

from sailor.profiler.layer_measurement import LayerMeasurement
from sailor.profiler.procs import rank_device, run_ranks
from sailor.profiler.timing import RepeatSettings, Stats
from sailor.schemas.model import ModelSpec

__all__ = ["combine_ranks", "measure_tp"]

_MIN_FIXED_REPS = 10


def measure_tp(
    spec: ModelSpec,
    tp: int,
    mbs_list: list[int],
    settings: RepeatSettings,
    threads: int = 1,
    measure_memory: bool = True,
    deadline_s: float = 1800.0,
    in_situ: bool = True,
    device: str = "cpu",
    blocks: dict[int, int] | None = None,
) -> list[LayerMeasurement]:
    """Measure every layer at every microbatch size in ``mbs_list`` with ``tp`` ranks (gloo
    processes on CPU; on CUDA one NCCL process per GPU). ``blocks``: per mbs, the window the
    memory bound allows (:mod:`memory_bound`; absent: the whole model)."""
    if tp < 2:
        raise ValueError(f"tp={tp}: measure_tp is for TP > 1; tp=1 runs in-process")
    if device == "cuda":
        import torch

        gpus = torch.cuda.device_count()
        if gpus < tp:
            raise ValueError(
                f"--tp {tp} on cuda: one rank per GPU, but this host has {gpus} GPU(s); "
                "measure TP degrees up to the GPUs of one node"
            )
    else:
        rank_device(device, 0, 0)
    reps = max(settings.min_reps, _MIN_FIXED_REPS)
    fixed = RepeatSettings(warmup=settings.warmup, min_reps=reps, max_reps=reps, min_time_s=0.0)
    config = {
        "spec": spec.model_dump(mode="json"),
        "mbs": list(mbs_list),
        "settings": asdict(fixed),
        "threads": threads,
        "measure_memory": measure_memory,
        "in_situ": in_situ,
        "device": device,
        "blocks": {str(b): n for b, n in (blocks or {}).items()},
    }
    results = run_ranks("sailor.profiler.tp_procs", tp, config, deadline_s=deadline_s)
    per_rank = [[LayerMeasurement.from_dict(d) for d in r["measurements"]] for r in results]
    return [combine_ranks(list(items)) for items in zip(*per_rank, strict=True)]


def _slowest(stats: list[Stats]) -> Stats:
    return max(stats, key=lambda s: s.median_s)


def combine_ranks(items: list[LayerMeasurement]) -> LayerMeasurement:
    """One measurement from the TP ranks' measurements of the same layer: the slowest rank."""
    first = items[0]
    for m in items[1:]:
        if (m.kind, m.tp, m.mbs, m.layer) != (first.kind, first.tp, first.mbs, first.layer):
            raise ValueError(f"cannot combine {m.kind}/{m.tp}/{m.mbs} with {first.kind}")
    return LayerMeasurement(
        kind=first.kind,
        tp=first.tp,
        mbs=first.mbs,
        fwd=_slowest([m.fwd for m in items]),
        bwd=_slowest([m.bwd for m in items]),
        update=_slowest([m.update for m in items]),
        params=max(m.params for m in items),
        saved_bytes=max(m.saved_bytes for m in items),
        output_bytes=first.output_bytes,
        input_bytes=first.input_bytes,
        peak_growth_bytes=max(m.peak_growth_bytes for m in items),
        layer=first.layer,
    )


def _rank_main(argv: list[str] | None = None) -> int:
    import gc

    import torch
    import torch.distributed as dist

    from sailor.comm import api as comm
    from sailor.megatron_patch.tp_layers import TPContext
    from sailor.profiler.layer_bench import measure_kinds
    from sailor.profiler.procs import join_group, rank_args, write_result

    args, cfg = rank_args(argv)
    torch.set_num_threads(int(cfg["threads"]))
    spec = ModelSpec.model_validate(cfg["spec"])
    settings = RepeatSettings(**cfg["settings"])
    dev = join_group(args, str(cfg.get("device", "cpu")), args.rank)
    group = dist.new_group(list(range(args.world_size)), backend=dist.get_backend())
    ctx = TPContext(size=args.world_size, rank=args.rank, group=group)
    out: list[dict[str, Any]] = []
    for mbs in cfg["mbs"]:
        comm.barrier()
        ms = measure_kinds(
            spec,
            int(mbs),
            dev,
            settings,
            tp=ctx,
            in_situ=bool(cfg.get("in_situ", True)),
            measure_memory=bool(cfg["measure_memory"]),
            blocks=cfg.get("blocks", {}).get(str(mbs)),
        )
        out.extend(m.to_dict() for m in ms)
        del ms
        gc.collect()  # free this mbs's model before the next is built (layers._release)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    comm.barrier()
    write_result(args, {"rank": args.rank, "measurements": out})
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(_rank_main())
