"""One rank of ``sailor check``'s collective probe (``python -m sailor.agent.check_rank``).

Started by :func:`sailor.agent.check_gather.probe_collectives` through the profiler's
``run_ranks``, one rank per GPU of this node (NCCL; gloo on the CPU in tests). Each rank:

1. all-reduces a small tensor holding ``rank + 1`` and checks the sum is exactly
   ``world (world + 1) / 2`` (a wrong sum is a broken transport, not a slow one);
2. times a large all-reduce (``bytes`` from the config; one untimed warm-up, then the median
   of three, the device synchronised around each) for the bus bandwidth
   ``2 (world - 1) / world * bytes / time``, NCCL's own definition;
3. sends its rank to the next rank and receives from the previous one, both posted together
   with ``batch_isend_irecv`` (NCCL matches point-to-point calls in issue order on one
   stream: a lone blocking send to a peer that also sends first would deadlock), and checks
   what arrived.

It writes ``{"all_reduce_ok", "p2p_ok", "bus_gbps"}`` and leaves the group. Must never hold
the GPUs past its own exit.
"""

from __future__ import annotations

import statistics
import time

from sailor.profiler.procs import join_group, rank_args, write_result

__all__ = ["main"]


def main(argv: list[str] | None = None) -> None:
    args, cfg = rank_args(argv)
    import torch
    import torch.distributed as dist

    from sailor.comm import api as comm

    dev = join_group(args, cfg["device"], args.rank, timeout_s=60.0)
    rank, world = args.rank, args.world_size

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    try:
        x = torch.full((8,), float(rank + 1), device=dev)
        comm.all_reduce(x)
        all_reduce_ok = bool((x == world * (world + 1) / 2).all().item())

        nbytes = int(cfg["bytes"])
        big = torch.ones(nbytes // 4, dtype=torch.float32, device=dev)
        comm.all_reduce(big)  # warm-up: NCCL builds its rings on the first call
        times = []
        for _ in range(3):
            sync()
            t0 = time.perf_counter()
            comm.all_reduce(big)
            sync()
            times.append(time.perf_counter() - t0)
        t = statistics.median(times)
        bus = 2 * (world - 1) / world * nbytes / t / 1e9 if world > 1 and t > 0 else None

        p2p_ok = True
        if world > 1:
            send = torch.full((1024,), float(rank), device=dev)
            recv = torch.full((1024,), -1.0, device=dev)
            ops = [
                comm.P2POp("send", send, (rank + 1) % world),
                comm.P2POp("recv", recv, (rank - 1) % world),
            ]
            comm.wait_all(comm.batch_isend_irecv(ops))
            sync()
            p2p_ok = bool((recv == float((rank - 1) % world)).all().item())
        write_result(args, {"all_reduce_ok": all_reduce_ok, "p2p_ok": p2p_ok, "bus_gbps": bus})
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
