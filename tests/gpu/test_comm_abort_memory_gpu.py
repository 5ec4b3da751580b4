"""Device memory a broken NCCL world leaves allocated (``sailor.comm.abort.keep_alive``).

A rank whose peer died leaves its world without waiting (``abandon_world``): its works and
process groups are kept referenced for the process's life, since dropping one still blocked
on a dead peer can hang in its destructor. An NCCL work keeps its tensors inside torch (its
outputs: a gradient bucket); if they stay allocated, every broken generation of an in-place
worker pins device memory the planner does not price. Measured here on two GPUs: the
survivor's ``torch.cuda.memory_allocated`` before the bucket, after the broken world is
left and the bucket dropped, and after the next world (one rank) ran a collective. Not
confirmed on hardware when written (the CPU machine skips it): if it fails, the message
gives the bytes pinned per broken world, for the planner's memory margin.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

BUCKET_BYTES = 256 << 20
"""The bucket in flight when the peer dies: a gradient bucket of a 7B stage's order
(``megatron_patch.grad_sync`` buckets hundreds of MiB)."""


def _drained(device: object, timeout_s: float) -> bool:
    """The device's queued work done within ``timeout_s`` (an event polled, not a
    synchronize: a kernel stuck on a dead peer would hold that for ever)."""
    import torch

    ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
    ev.record(torch.cuda.current_stream(device))
    end = time.monotonic() + timeout_s
    while not ev.query():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


def _rank(rank: int, ports: tuple[int, int], out: str) -> None:
    import torch
    import torch.distributed as dist

    from sailor.comm import abort
    from sailor.comm import api as comm

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    url = f"tcp://127.0.0.1:{ports[0]}"
    dist.init_process_group("nccl", init_method=url, rank=rank, world_size=2, device_id=dev)
    abort.set_polling(True)
    x = torch.ones(1, device=dev)
    comm.all_reduce(x)
    abort.host_sync(dev)
    if rank == 1:
        os._exit(0)  # dies without leaving: rank 0's next collective has no peer
    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_allocated(dev)
    bucket = torch.ones(BUCKET_BYTES // 4, device=dev)
    threading.Timer(3.0, abort.request_abort).start()  # what SIGUSR1 does
    try:
        comm.all_reduce(bucket)
        abort.host_sync(dev)
        broke = ""
    except Exception as exc:  # the abort, or NCCL's own error for the dead peer
        broke = type(exc).__name__
    abort.abandon_world()  # broken: its groups kept alive
    abort.clear_abort()
    del bucket
    drained = _drained(dev, 30.0)
    left = torch.cuda.memory_allocated(dev)
    # the next generation: a world of its own, a collective (a relayout's smallest)
    url = f"tcp://127.0.0.1:{ports[1]}"
    dist.init_process_group("nccl", init_method=url, rank=0, world_size=1, device_id=dev)
    y = torch.ones(1 << 10, device=dev)
    comm.all_reduce(y)
    abort.host_sync(dev)
    del y
    after = torch.cuda.memory_allocated(dev)
    Path(out).write_text(
        json.dumps(
            {
                "base": base,
                "left": left,
                "after": after,
                "broke": broke,
                "drained": drained,
                "kept": len(abort._graveyard),
            }
        )
    )
    os._exit(0)  # abandoned works: never destroyed (sailor.comm.abort)


def test_a_broken_nccl_world_pins_no_bucket(gpus: Callable[[int], None], tmp_path: Path) -> None:
    gpus(2)
    from sailor.localnet import free_port

    ports = (free_port(), free_port())
    out = tmp_path / "rank0.json"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, ports, str(out))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(180)
        assert p.exitcode == 0, f"rank exited {p.exitcode}"
    got = json.loads(out.read_text())
    assert got["broke"], got  # the world did break under the bucket's all-reduce
    pinned = got["after"] - got["base"]
    assert pinned < BUCKET_BYTES // 2, (
        f"{pinned / 2**20:.0f} MiB stay allocated after the broken world (bucket "
        f"{BUCKET_BYTES >> 20} MiB, {got['kept']} objects kept alive, drained "
        f"{got['drained']}): each broken generation pins about that much; {got}"
    )
