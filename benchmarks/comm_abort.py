"""What abandoning a gloo world costs and how fast a blocked rank leaves.

Two measurements, each in fresh processes on loopback (gloo, one thread per process):

1. Overhead of the abortable wait (:mod:`sailor.comm.abort`): 2 ranks, all-reduce of 1 and
   of 262144 fp32 elements, N calls through ``sailor.comm.api`` (async + polled wait) beside
   the same calls as plain blocking ``torch.distributed`` calls, same processes.
2. Leaving a blocked wait: 3 ranks; rank 2 is killed with SIGKILL; rank 1 waits in an
   ``irecv`` from rank 2 (it fails on its own: "Connection closed by peer", a negative
   ``signal_to_leave_s``), rank 0 in an ``irecv`` from the live rank 1, which never fails
   on its own. Both get SIGUSR1 (as the agent sends it); printed: seconds from the signal
   to leaving the wait, to abandon the world, and to run an all-reduce in a new 2-rank
   world at a new port.

Prints its figures; asserts nothing about time.

    python benchmarks/comm_abort.py [--calls 2000]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

from sailor.localnet import free_port

_CHILD = "--child"


def _child(kind: str, rank: int, world: int, port: int, port2: int, calls: int) -> None:
    import torch
    import torch.distributed as dist

    from sailor.comm import abort
    from sailor.comm import api as comm

    torch.set_num_threads(1)
    abort.set_polling(True)
    old_world = [True]  # as the worker: only a rank still in the old world aborts

    def on_usr1(*_: object) -> None:
        if old_world[0]:
            abort.request_abort()

    signal.signal(signal.SIGUSR1, on_usr1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=30),
    )
    out: dict[str, object] = {"rank": rank}
    if kind == "overhead":
        for n in (1, 262144):
            x = torch.ones(n)
            fns = {
                "blocking": lambda x=x: dist.all_reduce(x),
                "polled": lambda x=x: comm.all_reduce(x),
            }
            spent = dict.fromkeys(fns, 0.0)
            for _ in range(4):  # interleaved blocks: the machine's load drifts
                for label, fn in fns.items():
                    for _ in range(20):
                        fn()
                    t = time.perf_counter()
                    for _ in range(calls // 4):
                        fn()
                    spent[label] += time.perf_counter() - t
            for label, s in spent.items():
                out[f"{label}_{n}_us"] = round(s / (calls // 4 * 4) * 1e6, 1)
        print(json.dumps(out), flush=True)
        dist.destroy_process_group()
        return
    comm.barrier()
    print(json.dumps({"ready": rank}), flush=True)
    if rank == 2:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    x = torch.zeros(4)
    try:
        comm.wait_all(comm.batch_isend_irecv([comm.P2POp("recv", x, rank + 1)]))
    except RuntimeError as exc:  # CommAbortedError, or the peer's closed connection
        out["left_at"] = time.time()
        out["left_by"] = type(exc).__name__
    old_world[0] = False
    t = time.perf_counter()
    abort.abandon_world()
    abort.clear_abort()
    out["abandon_s"] = time.perf_counter() - t
    t = time.perf_counter()
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port2}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=30),
    )
    y = torch.ones(1)
    comm.all_reduce(y)
    out["new_world_s"] = time.perf_counter() - t
    out["sum"] = float(y.item())
    print(json.dumps(out), flush=True)
    dist.destroy_process_group()
    os._exit(0)  # abandoned works stay blocked: no destructors (sailor.comm.abort)


def _spawn(kind: str, world: int, calls: int) -> list[subprocess.Popen[str]]:
    port, port2 = free_port(), free_port()
    return [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                _CHILD,
                kind,
                str(r),
                str(world),
                str(port),
                str(port2),
                str(calls),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == _CHILD:
        kind, *nums = sys.argv[2:]
        _child(kind, *(int(v) for v in nums))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    a = ap.parse_args()
    print(f"setup: gloo on loopback, 1 thread/process, {os.cpu_count()} cores, {a.calls} calls")
    procs = _spawn("overhead", 2, a.calls)
    for p in procs:
        out, _ = p.communicate(timeout=300)
        print("overhead (us per all_reduce):", out.strip())
    procs = _spawn("leave", 3, 0)
    for p in procs[:2]:
        assert p.stdout is not None
        while '"ready"' not in p.stdout.readline():
            pass
    time.sleep(1.5)  # rank 2 is dead by now; ranks 0 and 1 are blocked
    sent = time.time()
    for p in procs[:2]:
        p.send_signal(signal.SIGUSR1)
    for p in procs[:2]:
        out, _ = p.communicate(timeout=60)
        got = json.loads(out.strip().splitlines()[-1])
        got["signal_to_leave_s"] = round(got.pop("left_at") - sent, 4)
        print("leave:", json.dumps(got))
    procs[2].wait()


if __name__ == "__main__":
    main()
