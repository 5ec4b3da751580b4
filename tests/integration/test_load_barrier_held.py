"""A peer's failure reaches a rank held in a collective, through its barrier's heartbeat.

Two gloo processes. Rank 1 fails after the world formed and writes its failure on the store
(``LoadBarrier.fail``, as the worker's handler does), then stays alive with its sockets
open: a peer that failed but has not exited — what every NCCL peer of a failed rank looks
like, where the collective waits for the process groups' timeout. Rank 0 is in an
all-reduce rank 1 never joins. Its barrier's heartbeat thread reads the failure at its next
beat and ends it (``record_peer_failure``, then ``exit_status``): exit status 1, rank 1's
error as its first cause (``origin="peer"``), seconds before the groups' timeout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from sailor.localnet import free_port

ROOT = Path(__file__).resolve().parents[2]
GROUP_TIMEOUT_S = 60.0
LIVENESS_S = 1.0  # a beat every 0.2 s

_RANK = """
import os, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
from sailor.megatron_patch.boundary import Status
from sailor.megatron_patch.load_barrier import LoadBarrier, record_peer_failure

rank, port, error_file, timeout_s, liveness_s = (
    int(sys.argv[1]), sys.argv[2], sys.argv[3], float(sys.argv[4]), float(sys.argv[5])
)
dist.init_process_group(
    "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
    timeout=timedelta(seconds=timeout_s),
)
status = Status(rank, error_file)
barrier = LoadBarrier(
    dist.distributed_c10d._get_default_store(), rank, 2, "w", liveness_s=liveness_s,
    on_peer_failure=record_peer_failure(status), exit_status=1,
).start()
store = dist.distributed_c10d._get_default_store()
if rank == 1:
    store.wait(["entering"])
    time.sleep(0.5)  # rank 0 is in the all-reduce by then
    print("failing", time.monotonic(), flush=True)
    barrier.fail(RuntimeError("injected: rank 1 failed building its optimizer"))
    time.sleep(timeout_s)  # alive, sockets open: it never joins the all-reduce
    os._exit(0)
store.set("entering", "1")
dist.all_reduce(torch.zeros(1))
print("the all-reduce returned", flush=True)
os._exit(0)
"""


def test_a_peer_failure_ends_a_rank_held_in_a_collective_with_its_error(tmp_path: Path) -> None:
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                _RANK,
                str(r),
                str(port),
                str(tmp_path / f"error-{r}.json"),
                str(GROUP_TIMEOUT_S),
                str(LIVENESS_S),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    try:
        out, err = procs[0].communicate(timeout=GROUP_TIMEOUT_S / 2)
        ended = time.monotonic()
    finally:
        for p in procs:
            p.kill()
        out1, _ = procs[1].communicate()
    assert procs[0].returncode == 1, (out, err[-3000:])
    assert "the all-reduce returned" not in out
    failed = float(next(x for x in out1.splitlines() if x.startswith("failing")).split()[-1])
    # a beat (0.2 s) after rank 1's failure, with room for this loaded machine; not at the
    # groups' timeout (60 s)
    assert ended - failed < 10.0, ended - failed
    record = json.loads((tmp_path / "error-0.json").read_text())
    assert record["origin"] == "peer" and record["error_type"] == "PeerFailedError", record
    assert record["message"].startswith("rank 1 ("), record
    assert "RuntimeError: injected: rank 1 failed building its optimizer" in record["message"]


# Three gloo processes built as a worker builds its barrier (``worker_barrier``, with its
# status) and ending as its top-level handler does (``rank_main.main``). Rank 2 fails before
# its process groups; ranks 0 and 1 are in ``new_group``, whose gloo rendezvous blocks in a
# store ``get`` for rank 2's address on the main thread's store client, for the groups'
# whole timeout.
_IN_NEW_GROUP = """
import json, os, sys, time
from datetime import timedelta
from types import SimpleNamespace
import torch.distributed as dist
from sailor.megatron_patch.boundary import Status
from sailor.megatron_patch.errors import failure_record, write_error_file_within
from sailor.megatron_patch.load_barrier import worker_barrier

rank, port, error_file, timeout_s, liveness_s = (
    int(sys.argv[1]), sys.argv[2], sys.argv[3], float(sys.argv[4]), float(sys.argv[5])
)
dist.init_process_group(
    "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3,
    timeout=timedelta(seconds=timeout_s),
)
status = Status(rank, error_file)
args = SimpleNamespace(
    rank=rank, world_size=3, master=f"127.0.0.1:{port}", error_file=error_file,
    load_timeout_s=timeout_s, load_liveness_s=liveness_s,
)
barrier = worker_barrier(dist.distributed_c10d._get_default_store(), "p", args, status)
status.load_barrier = barrier
try:
    if rank == 2:
        time.sleep(1.0)  # the others are in new_group by then
        print("failing", time.monotonic(), flush=True)
        raise RuntimeError("injected: rank 2 failed before its groups")
    dist.new_group([0, 1, 2], timeout=timedelta(seconds=timeout_s))
    barrier.formed(timeout_s)
    print("the groups were built", flush=True)
    os._exit(0)
except BaseException as exc:  # rank_main.main's handler
    exc = barrier.claim_end(exc)
    record = failure_record(exc, rank, status.failed_step, False, last_step=status.step)
    print(json.dumps({"event": "failed", **record}), file=sys.stderr, flush=True)
    write_error_file_within(error_file, record, 10.0)
    barrier.fail(exc)
    os._exit(1)
"""


def test_a_peer_failure_ends_ranks_whose_main_thread_is_in_a_store_wait(tmp_path: Path) -> None:
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                _IN_NEW_GROUP,
                str(r),
                str(port),
                str(tmp_path / f"error-{r}.json"),
                str(GROUP_TIMEOUT_S),
                str(LIVENESS_S),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(3)
    ]
    ended: dict[int, float] = {}
    outs: dict[int, tuple[str, str]] = {}
    try:
        for r in (2, 0, 1):
            outs[r] = procs[r].communicate(timeout=GROUP_TIMEOUT_S / 2)
            ended[r] = time.monotonic()
    finally:
        for p in procs:
            p.kill()
            p.communicate()
    failed = float(next(x for x in outs[2][0].splitlines() if x.startswith("failing")).split()[-1])
    for r in (0, 1):
        assert procs[r].returncode == 1, (r, outs[r][0], outs[r][1][-3000:])
        # a beat (0.2 s), rank 0's wait for the others to count out, and room for this
        # loaded machine; not at the end of the store wait (the groups' timeout, 60 s)
        assert ended[r] - failed < 15.0, (r, ended[r] - failed)
        record = json.loads((tmp_path / f"error-{r}.json").read_text())
        assert record["error_type"] == "PeerFailedError" and record["origin"] == "peer", record
        assert "RuntimeError: injected: rank 2 failed before its groups" in record["message"]
