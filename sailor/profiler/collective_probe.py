"""All-reduce latency: how long one all-reduce of a tiny tensor takes among ``n`` ranks.

The link probe (:mod:`network_probe`) times ping-pong, which is what a pipeline receiver
waits for. A collective is different: every rank arrives, and each of its steps is one
send and one receive between ranks that are all awake. On a shared 2-core host the
ping-pong one-way time was 1.7-2 ms at load 6-9, while a whole all-reduce of one scalar
among 2-4 ranks took a fraction of that; charging the ring's ``2(n-1)`` steps at the p2p
latency overestimated the training's loss and tied-embedding all-reduces several times.

Procedure: ``n`` gloo processes on loopback (:func:`~sailor.profiler.procs.run_ranks`);
each repetition is a barrier, then one timed ``all_reduce`` of an 8-byte tensor (the size of
``megatron_patch``'s loss all-reduce; the bandwidth of larger ones comes from the link
curve). A few untimed warm-ups first. Each rank keeps the median or mean of its times; the
latency is the largest over ranks (the collective ends for everyone when the last rank
leaves it). The result is a :class:`~sailor.schemas.network.CollectiveLatency` per ``n``,
stored in ``NetworkProfile.collectives``.
"""

from __future__ import annotations

import sys

from sailor.profiler.procs import run_ranks
from sailor.profiler.timing import Stats
from sailor.schemas.network import CollectiveLatency, Endpoint

__all__ = ["ALLREDUCE_BYTES", "collective_latencies", "run_allreduce_probe"]

ALLREDUCE_BYTES = 8
"""Bytes all-reduced per repetition: one float64 (megatron_patch's loss all-reduce)."""

_WARMUP = 5


def run_allreduce_probe(
    ranks: int, reps: int = 60, threads: int = 1, deadline_s: float = 300.0
) -> list[Stats]:
    """Per-rank statistics of one tiny all-reduce among ``ranks`` fresh gloo processes."""
    if ranks < 2:
        raise ValueError(f"ranks={ranks}: an all-reduce needs at least 2")
    cfg = {"reps": reps, "threads": threads}
    res = run_ranks("sailor.profiler.collective_probe", ranks, cfg, deadline_s=deadline_s)
    return [Stats.from_dict(r["time"]) for r in res]


def collective_latencies(
    endpoint: Endpoint,
    ranks: tuple[int, ...] = (2, 3, 4),
    statistic: str = "median",
    reps: int = 60,
    threads: int = 1,
    load: str = "",
) -> list[CollectiveLatency]:
    """Measure the all-reduce latency for each rank count in ``ranks``."""
    out: list[CollectiveLatency] = []
    for n in ranks:
        per_rank = run_allreduce_probe(n, reps, threads)
        lat = max(s.central(statistic) for s in per_rank)
        out.append(
            CollectiveLatency(
                endpoint=endpoint,
                ranks=n,
                latency_s=lat,
                source=(
                    f"gloo all_reduce of {ALLREDUCE_BYTES} B among {n} processes on loopback, "
                    f"{reps} reps after a barrier each, {statistic} per rank, slowest rank "
                    f"(sailor.profiler.collective_probe){load}"
                ),
            )
        )
    return out


def _rank_main(argv: list[str] | None = None) -> int:
    import time

    import torch
    import torch.distributed as dist

    from sailor.profiler.procs import init_gloo, rank_args, write_result

    args, cfg = rank_args(argv)
    torch.set_num_threads(int(cfg["threads"]))
    init_gloo(args, timeout_s=120.0)
    buf = torch.zeros(ALLREDUCE_BYTES // 8, dtype=torch.float64)
    times: list[float] = []
    for i in range(int(cfg["reps"]) + _WARMUP):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(buf)
        if i >= _WARMUP:
            times.append(time.perf_counter() - t0)
    dist.barrier()
    write_result(args, {"rank": args.rank, "time": Stats.of(times).to_dict()})
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(_rank_main())
