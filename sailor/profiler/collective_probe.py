"""All-reduce latency: how long one all-reduce of a tiny tensor takes among ``n`` ranks.

The link probe (:mod:`network_probe`) times ping-pong, which is what a pipeline receiver
waits for. A collective is different: every rank arrives, and each of its steps is one
send and one receive between ranks that are all awake. On a shared 2-core host the
ping-pong one-way time was 1.7-2 ms at load 6-9, while a whole all-reduce of one scalar
among 2-4 ranks took a fraction of that; charging the ring's ``2(n-1)`` steps at the p2p
latency overestimated the training's loss and tied-embedding all-reduces several times.

Procedure: ``n`` processes on loopback (:func:`~sailor.profiler.procs.run_ranks`): gloo on
the CPU, or NCCL with one GPU per rank (``device="cuda"``, the GPU synchronised before and
after each timed call); each repetition is a barrier, then one timed ``all_reduce`` of an
8-byte tensor (the size of
``megatron_patch``'s loss all-reduce). A few untimed warm-ups first. Each rank keeps the
median or mean of its times; the latency is the largest over ranks (the collective ends for
everyone when the last rank leaves it).

**Bandwidth** (``sizes``, e.g. 256 KiB and 4 MiB: gradients): the same, at each size; the
backend's bus bandwidth is the least-squares slope through the origin of ``t(B) − latency``
against the bytes a ring moves per rank, ``2(n−1)/n · B``. gloo's all-reduce on a shared
host runs well below what a ring over the point-to-point curve would (4 MB among 2 ranks
here: ~3.3 ms against ~1.6 ms), so the simulator prices the bytes at the measured bandwidth
when it has one. The result is a :class:`~sailor.schemas.network.CollectiveLatency` per
``n``, stored in ``NetworkProfile.collectives``.
"""

from __future__ import annotations

import sys

from sailor.profiler.procs import check_devices, run_ranks
from sailor.profiler.timing import Stats
from sailor.schemas.network import CollectiveLatency, Endpoint

__all__ = ["ALLREDUCE_BYTES", "bus_gbps", "collective_latencies", "run_allreduce_probe"]

ALLREDUCE_BYTES = 8
"""Bytes all-reduced per repetition: one float64 (megatron_patch's loss all-reduce)."""

_WARMUP = 5


def run_allreduce_probe(
    ranks: int,
    reps: int = 60,
    threads: int = 1,
    deadline_s: float = 300.0,
    sizes: tuple[int, ...] = (),
    device: str = "cpu",
) -> dict[int, list[Stats]]:
    """Per-size, per-rank statistics of all-reduces among ``ranks`` fresh processes (gloo on
    cpu, NCCL with one GPU each on cuda): :data:`ALLREDUCE_BYTES` and each of ``sizes``."""
    if ranks < 2:
        raise ValueError(f"ranks={ranks}: an all-reduce needs at least 2")
    if any(b < 8 for b in sizes):
        raise ValueError(f"sizes={sizes}: sizes are bytes, at least 8")
    check_devices(device, range(ranks))
    all_sizes = sorted({ALLREDUCE_BYTES, *sizes})
    cfg = {"reps": reps, "threads": threads, "sizes": all_sizes, "device": device}
    res = run_ranks("sailor.profiler.collective_probe", ranks, cfg, deadline_s=deadline_s)
    return {b: [Stats.from_dict(r["times"][str(b)]) for r in res] for b in all_sizes}


def bus_gbps(ranks: int, latency_s: float, points: list[tuple[int, float]]) -> float | None:
    """Bus bandwidth (GB/s) from (bytes, seconds) all-reduce points above the latency: the
    least-squares slope through the origin of time − latency against ``2(n−1)/n · bytes``;
    None when no point lies above the latency."""
    xs = [2 * (ranks - 1) / ranks * b for b, _ in points]
    ys = [t - latency_s for _, t in points]
    sxy = sum(x * y for x, y in zip(xs, ys, strict=True))
    sxx = sum(x * x for x in xs)
    if sxx <= 0 or sxy <= 0:
        return None
    return sxx / sxy / 1e9


def collective_latencies(
    endpoint: Endpoint,
    ranks: tuple[int, ...] = (2, 3, 4),
    statistic: str = "median",
    reps: int = 60,
    threads: int = 1,
    load: str = "",
    sizes: tuple[int, ...] = (),
    device: str = "cpu",
) -> list[CollectiveLatency]:
    """Measure the all-reduce latency (and, with ``sizes``, bus bandwidth) for each rank
    count in ``ranks``."""
    out: list[CollectiveLatency] = []
    backend = "gloo" if device == "cpu" else "NCCL"
    for n in ranks:
        per_size = run_allreduce_probe(n, reps, threads, sizes=sizes, device=device)
        central = {b: max(s.central(statistic) for s in st) for b, st in per_size.items()}
        lat = central[ALLREDUCE_BYTES]
        big = [(b, t) for b, t in central.items() if b > ALLREDUCE_BYTES]
        bus = bus_gbps(n, lat, big) if big else None
        out.append(
            CollectiveLatency(
                endpoint=endpoint,
                ranks=n,
                latency_s=lat,
                bus_gbps=bus,
                max_bytes=max(b for b, _ in big) if bus is not None else 0,
                source=(
                    f"{backend} all_reduce of {', '.join(str(b) for b in sorted(central))} B among "
                    f"{n} processes on loopback, {reps} reps after a barrier each, {statistic} "
                    f"per rank, slowest rank (sailor.profiler.collective_probe){load}"
                ),
            )
        )
    return out


def _rank_main(argv: list[str] | None = None) -> int:
    import time

    import torch
    import torch.distributed as dist

    from sailor.profiler.procs import join_group, rank_args, write_result

    args, cfg = rank_args(argv)
    torch.set_num_threads(int(cfg["threads"]))
    dev = join_group(args, str(cfg.get("device", "cpu")), args.rank, timeout_s=120.0)
    cuda = dev.type == "cuda"
    out: dict[str, dict[str, float]] = {}
    for nbytes in cfg.get("sizes", [ALLREDUCE_BYTES]):
        buf = torch.zeros(max(1, int(nbytes) // 8), dtype=torch.float64, device=dev)
        times: list[float] = []
        for i in range(int(cfg["reps"]) + _WARMUP):
            dist.barrier()
            if cuda:
                torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            dist.all_reduce(buf)
            if cuda:
                torch.cuda.synchronize(dev)  # NCCL returns before the reduction is done
            if i >= _WARMUP:
                times.append(time.perf_counter() - t0)
        out[str(nbytes)] = Stats.of(times).to_dict()
    dist.barrier()
    write_result(args, {"rank": args.rank, "times": out})
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(_rank_main())
