"""All-reduce cost: the fixed time of a tiny all-reduce among ``n`` ranks, and the bus
bandwidth of large ones, measured where the ranks are (one node, or one rank per node).

The link probe (:mod:`network_probe`) times ping-pong, which is what a pipeline receiver
waits for. A collective is different: every rank arrives, and each of its steps is one
send and one receive between ranks that are all awake. On a shared 2-core host the
ping-pong one-way time was 1.7-2 ms at load 6-9, while a whole all-reduce of one scalar
among 2-4 ranks took a fraction of that; charging the ring's ``2(n-1)`` steps at the p2p
latency overestimated the training's loss and tied-embedding all-reduces several times.

Procedure: ``n`` processes (:func:`~sailor.profiler.procs.run_ranks`): gloo on the CPU, or
NCCL with one GPU per rank (``device="cuda"``, the GPU synchronised before and after each
timed call); each repetition is a barrier, then one timed ``all_reduce``. A few untimed
warm-ups first. Each rank keeps the median or mean of its times at each size; the figure of
a size is the largest over ranks (the collective ends for everyone when the last rank leaves
it). The ranks exchange their times at the end, so a rank on another node reports them too.

**Sizes**: 8 B (``megatron_patch``'s loss all-reduce) and a sweep (:func:`sweep_sizes`):
1 KiB to 256 MiB on GPUs, where NCCL is latency-bound below a few MiB and reaches its bus
bandwidth only at tens of MiB (the 256 KiB and 4 MiB of the first version measured its
latency twice); 64 KiB to 4 MiB on the CPU, where gloo is slow enough that 4 MiB is well
past its latency, and larger messages would only make the probe slow.

**Fit** (:func:`fit_allreduce`): ``t(B) = α + 2(n−1)/n · B / bus`` by ordinary least squares
over the sweep, in seconds: the residuals of large messages are the largest, so they set
the bandwidth, and the small ones the intercept. The record keeps the 8-byte time as the
latency (what a tiny all-reduce costs: NCCL's small-message protocol is not on the large
messages' line) and the fitted bus bandwidth.

**Where** (``scope`` of :class:`~sailor.schemas.network.CollectiveLatency`): ``intra_node``
for ranks on this host (NVLink/PCIe between its GPUs, or loopback); ``inter_node`` for one
rank per node (``rank``/``master``, as the link probe's two-node mode). The simulator prices a
data-parallel ring that spans nodes only with an inter-node measurement (or the links).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sailor.comm.codec import PeerObjectError
from sailor.profiler.procs import check_devices, run_ranks
from sailor.profiler.timing import Stats

if TYPE_CHECKING:  # imported where used: a rank process starts without the schemas
    from sailor.schemas.network import CollectiveLatency, CollectiveScope, Endpoint

__all__ = [
    "ALLREDUCE_BYTES",
    "AllReduceFit",
    "bus_gbps",
    "collective_latencies",
    "fit_allreduce",
    "gather_times",
    "gathered_times",
    "run_allreduce_probe",
    "sweep_sizes",
]

ALLREDUCE_BYTES = 8
"""Bytes all-reduced per repetition: one float64 (megatron_patch's loss all-reduce)."""

_WARMUP = 5

_REP_BYTES = 1 << 30
"""Bytes all-reduced per size at most (but at least 5 repetitions): 256 MiB gets 5."""

_MIN_REPS = 5


def sweep_sizes(device: str) -> tuple[int, ...]:
    """Message sizes of the bandwidth sweep: 1 KiB..256 MiB (x4) on cuda, 64 KiB..4 MiB on cpu."""
    if device == "cuda":
        return tuple(1 << k for k in range(10, 29, 2))
    return tuple(1 << k for k in range(16, 23, 2))


@dataclass(frozen=True)
class AllReduceFit:
    """``t(B) = latency_s + 2(n−1)/n · B / (bus_gbps · 1e9)`` fitted over a size sweep."""

    latency_s: float
    bus_gbps: float | None
    """None: the times do not grow with the size (no bandwidth term to fit)."""


def fit_allreduce(ranks: int, points: list[tuple[int, float]]) -> AllReduceFit:
    """Least-squares ``latency + bytes moved / bus`` over (bytes, seconds) ``points`` of an
    all-reduce among ``ranks`` ranks; the bytes a ring moves per rank are ``2(n−1)/n · B``.
    A negative intercept (noise at the small sizes) is clamped to 0 and the slope refitted
    through the origin."""
    if ranks < 2:
        raise ValueError(f"ranks={ranks}: an all-reduce needs at least 2")
    if len({b for b, _ in points}) < 2:
        raise ValueError(f"points={points}: need at least two sizes")
    xs = [2 * (ranks - 1) / ranks * b for b, _ in points]
    ys = [t for _, t in points]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    slope = sxy / sxx
    latency = my - slope * mx
    if latency < 0:
        latency = 0.0
        slope = sum(x * y for x, y in zip(xs, ys, strict=True)) / sum(x * x for x in xs)
    if slope <= 0:
        return AllReduceFit(latency_s=max(0.0, my), bus_gbps=None)
    return AllReduceFit(latency_s=latency, bus_gbps=1.0 / slope / 1e9)


def run_allreduce_probe(
    ranks: int,
    reps: int = 60,
    threads: int = 1,
    deadline_s: float = 300.0,
    sizes: tuple[int, ...] = (),
    device: str = "cpu",
    rank: int | None = None,
    master: str | None = None,
    gpu: int = 0,
    join_timeout_s: float | None = None,
) -> dict[int, list[Stats]]:
    """Per-size, per-rank statistics of all-reduces among ``ranks`` fresh processes (gloo on
    cpu, NCCL with one GPU each on cuda): :data:`ALLREDUCE_BYTES` and each of ``sizes``.

    Default: every rank here, on loopback. ``rank`` with ``master`` (``host:port`` where rank
    0 listens): only that rank runs here (on GPU ``gpu`` with cuda), one rank per node; every
    side gets every rank's statistics. ``join_timeout_s``: how long the other nodes' ranks
    have to join once this one is ready (``run_ranks``: ``PeerNotJoinedError``)."""
    if ranks < 2:
        raise ValueError(f"ranks={ranks}: an all-reduce needs at least 2")
    if any(b < 8 for b in sizes):
        raise ValueError(f"sizes={sizes}: sizes are bytes, at least 8")
    if rank is not None and (not 0 <= rank < ranks or not master):
        raise ValueError(f"rank={rank}, master={master!r}: a side is a rank < {ranks}, with master")
    check_devices(device, [gpu] if rank is not None else range(ranks))
    all_sizes = sorted({ALLREDUCE_BYTES, *sizes})
    cfg = {
        "reps": reps,
        "threads": threads,
        "sizes": all_sizes,
        "device": device,
        "gpu": gpu if rank is not None else None,
    }
    res = run_ranks(
        "sailor.profiler.collective_probe",
        ranks,
        cfg,
        deadline_s=deadline_s,
        master=master,
        ranks=None if rank is None else [rank],
        join_timeout_s=join_timeout_s,
    )
    every = res[0]["all"]
    return {b: [Stats.from_dict(r[str(b)]) for r in every] for b in all_sizes}


def bus_gbps(ranks: int, latency_s: float, points: list[tuple[int, float]]) -> float | None:
    """Bus bandwidth (GB/s) from (bytes, seconds) all-reduce points above the latency: the
    least-squares slope through the origin of time − latency against ``2(n−1)/n · bytes``;
    None when no point lies above the latency. (The first version's fit; the probe now fits
    latency and bandwidth together over a sweep, :func:`fit_allreduce`.)"""
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
    rank: int | None = None,
    master: str | None = None,
    gpu: int = 0,
    join_timeout_s: float | None = None,
) -> list[CollectiveLatency]:
    """Measure the all-reduce latency (and, with ``sizes``, the bus bandwidth fitted over
    them) for each rank count in ``ranks``: on this host (``intra_node``), or with ``rank``
    and ``master`` one rank per node (``inter_node``; rank 0 listens at ``master``)."""
    from sailor.schemas.network import CollectiveLatency

    out: list[CollectiveLatency] = []
    backend = "gloo" if device == "cpu" else "NCCL"
    scope: CollectiveScope = "intra_node" if rank is None else "inter_node"
    where = (
        "processes on loopback" if rank is None else f"nodes, one rank each (rank 0 at {master})"
    )
    for n in ranks:
        per_size = run_allreduce_probe(
            n,
            reps,
            threads,
            sizes=sizes,
            device=device,
            rank=rank,
            master=master,
            gpu=gpu,
            join_timeout_s=join_timeout_s,
        )
        central = {b: max(s.central(statistic) for s in st) for b, st in per_size.items()}
        lat = central[ALLREDUCE_BYTES]
        bus = None
        big = [b for b in central if b > ALLREDUCE_BYTES]
        fitted = ""
        if big:
            fit = fit_allreduce(n, sorted(central.items()))
            bus = fit.bus_gbps
            fitted = f", least-squares latency {fit.latency_s * 1e6:.1f} us over the sweep"
        out.append(
            CollectiveLatency(
                endpoint=endpoint,
                ranks=n,
                latency_s=lat,
                bus_gbps=bus,
                max_bytes=max(big) if bus is not None else 0,
                scope=scope,
                source=(
                    f"{backend} all_reduce of {', '.join(str(b) for b in sorted(central))} B among "
                    f"{n} {where}, up to {reps} reps after a barrier each, {statistic} per rank, "
                    f"slowest rank{fitted} (sailor.profiler.collective_probe){load}"
                ),
            )
        )
    return out


_STATS_KEYS = {"median_s": float, "stdev_s": float, "n": int, "mean_s": float}
"""A size's statistics as a rank sends them (``Stats.to_dict``): each key, its type."""


def gathered_times(got: list[object], sizes: list[int]) -> list[dict[str, dict[str, float]]]:
    """Each rank's times of :func:`_rank_main`'s gather (rank ``r``'s at index ``r``),
    checked: for each of ``sizes`` (its key ``str(size)``, no other) a ``Stats.to_dict``:
    finite times >= 0 and a count >= 1. :class:`PeerObjectError` names the first rank whose
    object is not one, the field and the value: a rank on another node reports every rank's
    times, and a malformed one would reach the record (or fail its parsing, charged to the
    receiver) as it is. Pure."""
    out: list[dict[str, dict[str, float]]] = []
    keys = {str(b) for b in sizes}
    for r, g in enumerate(got):
        if type(g) is not dict or set(g) != keys:
            shown = sorted(map(str, g))[:8] if type(g) is dict else str(g)[:200]
            raise PeerObjectError(
                f"rank {r} sent times {shown}: a dict of the sizes "
                f"{[str(b) for b in sizes]} expected",
                rank=r,
            )
        for size, stats in g.items():
            if type(stats) is not dict or set(stats) != set(_STATS_KEYS):
                raise PeerObjectError(
                    f"rank {r} sent times[{size!r}]={str(stats)[:200]}: a dict of "
                    f"{sorted(_STATS_KEYS)} expected",
                    rank=r,
                )
            for key, kind in _STATS_KEYS.items():
                v = stats[key]
                ok = isinstance(v, float | int) and type(v) is kind
                ok = ok and math.isfinite(v) and v >= (1 if kind is int else 0)
                if not ok:
                    raise PeerObjectError(
                        f"rank {r} sent times[{size!r}][{key!r}]={str(v)[:80]}: "
                        f"{'an int >= 1' if kind is int else 'a finite float >= 0'} expected",
                        rank=r,
                    )
        out.append(g)
    return out


def gather_times(
    mine: dict[str, dict[str, float]], sizes: list[int]
) -> list[dict[str, dict[str, float]]]:
    """Every rank's times (``mine`` this rank's), by rank, checked (:func:`gathered_times`).
    Collective: one object all-gather over the world, every rank calls it."""
    import torch.distributed as dist

    from sailor.comm import api as comm

    every: list[object] = [None] * dist.get_world_size()
    comm.all_gather_object(every, mine)
    return gathered_times(every, sizes)


def _rank_main(argv: list[str] | None = None) -> int:
    import time

    import torch
    import torch.distributed as dist

    from sailor.comm import api as comm
    from sailor.profiler.procs import join_group, rank_args, write_result

    args, cfg = rank_args(argv)
    torch.set_num_threads(int(cfg["threads"]))
    gpu = cfg.get("gpu")
    index = args.rank if gpu is None else int(gpu)  # one node: rank r on GPU r
    dev = join_group(args, str(cfg.get("device", "cpu")), index, timeout_s=120.0)
    cuda = dev.type == "cuda"
    out: dict[str, dict[str, float]] = {}
    sizes = [int(b) for b in cfg.get("sizes", [ALLREDUCE_BYTES])]
    for nbytes in sizes:
        buf = torch.zeros(max(1, int(nbytes) // 8), dtype=torch.float64, device=dev)
        times: list[float] = []
        reps = max(_MIN_REPS, min(int(cfg["reps"]), _REP_BYTES // max(1, int(nbytes))))
        for i in range(reps + _WARMUP):
            comm.barrier()
            if cuda:
                torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            comm.all_reduce(buf)
            if cuda:
                torch.cuda.synchronize(dev)  # NCCL returns before the reduction is done
            if i >= _WARMUP:
                times.append(time.perf_counter() - t0)
        out[str(nbytes)] = Stats.of(times).to_dict()
        del buf
        if cuda:
            torch.cuda.empty_cache()  # 256 MiB buffers: give each back before the next
    # a rank on another node reports every rank's times
    write_result(args, {"rank": args.rank, "times": out, "all": gather_times(out, sizes)})
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(_rank_main())
