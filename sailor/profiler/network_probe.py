"""Point-to-point bandwidth between two ranks as a function of message size.

Two processes joined by ``torch.distributed`` with the backend training uses play
ping-pong: rank 0 sends a message of ``n`` bytes with ``dist.send``, rank 1 receives it with
``dist.recv`` and sends it back. One direction takes half the round trip, timed on rank 0
with the monotonic clock. Ping-pong rather than a stream of sends: it times a transfer from
start to complete delivery, which is what a pipeline stage waits for, and it needs no clock
shared by the two hosts.

* ``device="cpu"``: gloo, messages in host memory;
* ``device="cuda"``: NCCL, messages in GPU memory (rank ``r`` on GPU ``r`` on loopback, GPU
  ``gpu`` of its node between nodes); rank 0 synchronises the GPU before reading the clock,
  since NCCL's send and receive return before the transfer is done.

On loopback (:func:`run_probe` default) both ranks run here. Between two nodes each node runs
one rank (``rank=0`` on one, ``rank=1`` on the other, both given rank 0's ``host:port``):
that is the link the simulator needs for a pair of nodes, and it is what ``sailor profile
network --rank R --master HOST:PORT`` runs.

**Pairs** (``ProbeSettings.pairs`` = ``k``, ``sailor profile network --pairs K``). The simulator
prices a transfer between nodes on the *node's* curve: a stage's ``t`` TP ranks send their
slices at once, and a node's data-parallel rings share its NICs. One pair of processes
measures what one stream reaches, often one NIC: a node with a NIC per GPU (8 × 400 Gb/s on
an H100 node) reaches several times that. With ``k`` pairs, each node runs ``k`` ranks (GPUs
``gpu .. gpu+k-1``; side 0 holds ranks ``0..k-1``, side 1 ranks ``k..2k-1``, rank ``i`` paired
with ``k+i``); each message of ``n`` bytes is split into ``k`` slices of ``n/k`` that the pairs
exchange at once, after a barrier, and the one-way time of a repetition is the slowest pair's:
the bandwidth of the node pair, as the simulator reads it. ``k`` = 1 (the default) is the single
pair, without barriers.

Sizes double from ``min_bytes`` to ``max_bytes``. Repetitions per size are fixed in
advance from the size (both ranks must agree without talking): enough to move about
``bytes_per_size`` bytes, at least ``min_reps`` and at most ``max_reps``; one untimed
exchange per size warms the buffers. The median one-way time is kept, with its stdev.

Run as a module by :func:`~sailor.profiler.procs.run_ranks`; pure fitting is in
:mod:`curve_fit`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

from sailor.profiler.procs import check_devices, run_ranks
from sailor.profiler.timing import Stats

__all__ = ["ProbePoint", "ProbeSettings", "probe_sizes", "run_probe"]


@dataclass(frozen=True)
class ProbeSettings:
    """Message sizes and repetitions of one probe."""

    min_bytes: int = 64 << 10
    max_bytes: int = 256 << 20
    """Default 256 MiB (not 1 GiB) so a loopback run stays short on a small shared host."""
    bytes_per_size: int = 256 << 20
    min_reps: int = 3
    max_reps: int = 50
    threads: int = 1
    device: str = "cpu"
    """cpu (gloo, host memory) or cuda (NCCL, GPU memory)."""
    pairs: int = 1
    """Pairs of ranks that exchange slices of each message at once (one per NIC or GPU)."""

    def __post_init__(self) -> None:
        if self.pairs < 1:
            raise ValueError(f"pairs={self.pairs}: need at least one pair")
        if self.max_bytes < 4 * self.pairs:
            raise ValueError(
                f"max_bytes={self.max_bytes}, pairs={self.pairs}: each pair needs a float32 "
                f"of the message at least ({4 * self.pairs} bytes)"
            )
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device={self.device!r}: use 'cpu' or 'cuda'")
        if not 4 <= self.min_bytes <= self.max_bytes:
            raise ValueError(
                f"min_bytes={self.min_bytes}, max_bytes={self.max_bytes}: "
                "need 4 <= min_bytes <= max_bytes"
            )
        if not 1 <= self.min_reps <= self.max_reps:
            raise ValueError(f"min_reps={self.min_reps}, max_reps={self.max_reps}: invalid")


@dataclass(frozen=True)
class ProbePoint:
    """One message size and its one-way transfer time."""

    nbytes: int
    time: Stats

    @property
    def gbps(self) -> float:
        return self.nbytes / self.time.median_s / 1e9


def probe_sizes(s: ProbeSettings) -> list[tuple[int, int]]:
    """(message bytes, repetitions) for every size of the probe (powers of two; a multiple of
    4 bytes per pair, so each pair's slice is whole float32s)."""
    align = 4 * s.pairs
    out: list[tuple[int, int]] = []
    n = max(s.min_bytes, align)
    while n <= s.max_bytes:
        reps = min(s.max_reps, max(s.min_reps, s.bytes_per_size // n))
        out.append((n - n % align, reps))
        n *= 2
    last = s.max_bytes - s.max_bytes % align
    if out and out[-1][0] != last and last > 0:
        out.append((last, s.min_reps))
    return out


def pair_peer(rank: int, pairs: int) -> int:
    """The rank ``rank`` exchanges with: ``i`` (side 0) with ``pairs + i`` (side 1)."""
    return rank + pairs if rank < pairs else rank - pairs


def slowest_pair(per_pair: list[list[float]]) -> list[float]:
    """Each repetition's one-way time of the node pair: the slowest pair's (every pair's
    times, repetition by repetition; all pairs ran the same repetitions)."""
    if not per_pair or len({len(t) for t in per_pair}) != 1:
        raise ValueError(f"{[len(t) for t in per_pair]} repetitions per pair: need equal")
    return [max(ts) for ts in zip(*per_pair, strict=True)]


def run_probe(
    settings: ProbeSettings,
    deadline_s: float = 600.0,
    rank: int | None = None,
    master: str | None = None,
    gpu: int = 0,
    join_timeout_s: float | None = None,
) -> list[ProbePoint]:
    """Probe the link between two fresh sides of ``settings.pairs`` ranks each; one point
    per message size (the node-level bytes, and the slowest pair's time).

    Default: both sides here, on loopback. ``rank`` (side 0 or 1) with ``master``
    (``host:port`` where rank 0 listens): only that side runs here, on GPUs ``gpu ..
    gpu+pairs-1`` of this node with cuda; the other side runs on the peer node. Side 0
    returns the points, side 1 an empty list. ``join_timeout_s``: how long the other side
    has to join once this side is ready (``run_ranks``: ``PeerNotJoinedError``)."""
    if rank is not None and (rank not in (0, 1) or not master):
        raise ValueError(f"rank={rank}, master={master!r}: one side is rank 0 or 1, with master")
    k = settings.pairs
    local = range(gpu, gpu + k) if rank is not None else range(2 * k)
    check_devices(settings.device, local)
    cfg = {
        "sizes": probe_sizes(settings),
        "threads": settings.threads,
        "device": settings.device,
        "gpu": gpu if rank is not None else None,
        "pairs": k,
    }
    res = run_ranks(
        "sailor.profiler.network_probe",
        2 * k,
        cfg,
        deadline_s=deadline_s,
        master=master,
        ranks=None if rank is None else [rank * k + i for i in range(k)],
        join_timeout_s=join_timeout_s,
    )
    if rank == 1:
        return []
    senders = [r for r in res if int(r["rank"]) < k]
    points = []
    for i, p in enumerate(senders[0]["points"]):
        times = slowest_pair([[float(t) for t in r["points"][i]["times"]] for r in senders])
        points.append(ProbePoint(nbytes=int(p["nbytes"]), time=Stats.of(times)))
    return points


def _send(buf: torch.Tensor, peer: int) -> None:
    """One send, posted as a batch of one and waited (the project's p2p has no lone send)."""
    from sailor.comm import api as comm

    comm.wait_all(comm.batch_isend_irecv([comm.P2POp("send", buf, peer)]))


def _recv(buf: torch.Tensor, peer: int) -> None:
    from sailor.comm import api as comm

    comm.wait_all(comm.batch_isend_irecv([comm.P2POp("recv", buf, peer)]))


def _rank_main(argv: list[str] | None = None) -> int:
    import time

    import torch
    import torch.distributed as dist

    from sailor.comm import api as comm
    from sailor.profiler.procs import join_group, rank_args, write_result

    args, cfg = rank_args(argv)
    torch.set_num_threads(int(cfg["threads"]))
    k = int(cfg.get("pairs", 1))
    # loopback: every rank here, on GPU ``rank``; between nodes: the side's GPUs from ``gpu``
    index = args.rank if cfg.get("gpu") is None else int(cfg["gpu"]) + args.rank % k
    dev = join_group(args, str(cfg.get("device", "cpu")), index, timeout_s=300.0)
    cuda = dev.type == "cuda"
    peer = pair_peer(args.rank, k)
    sender = args.rank < k
    points = []
    for nbytes, reps in cfg["sizes"]:
        buf = torch.ones(int(nbytes) // 4 // k, dtype=torch.float32, device=dev)
        times: list[float] = []
        for i in range(int(reps) + 1):
            if k > 1:
                if cuda:
                    torch.cuda.synchronize(dev)
                comm.barrier()  # the pairs start together: their slices share the NICs
            if sender:
                if cuda:
                    torch.cuda.synchronize(dev)
                t0 = time.perf_counter()
                _send(buf, peer)
                _recv(buf, peer)
                if cuda:
                    torch.cuda.synchronize(dev)  # NCCL returns before the bytes are in
                if i > 0:  # the first exchange is the warm-up
                    times.append((time.perf_counter() - t0) / 2)
            else:
                _recv(buf, peer)
                _send(buf, peer)
        if sender:
            points.append(
                {"nbytes": int(nbytes), "time": Stats.of(times).to_dict(), "times": times}
            )
        del buf
    if cuda:
        torch.cuda.synchronize(dev)
    comm.barrier()
    write_result(args, {"rank": args.rank, "points": points})
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(_rank_main())
