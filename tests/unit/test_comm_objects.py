"""Object collectives with polling on: the same results as torch's, and abortable.

Three real gloo ranks. The backend's ``broadcast_object_list`` and ``all_gather_object``
are made of tensor collectives (:mod:`sailor.comm.objects`, with polling on or off: torch's
own unpickle a peer's bytes, ``test_comm_objects_hostile``); they must give the same
objects either way, on the world and on a
sub-group with a source other than rank 0, and a rank whose peer never comes must leave
on an abort request (the worker's ``SIGUSR1``) within a fraction of a second, where
torch's own wait would sit until the group's timeout.
"""

from __future__ import annotations

import json
import os
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from sailor.comm import abort
from sailor.comm import api as comm
from tests.spawn import spawn

_OBJS = [{"step": 7, "dir": "/ckpt/a"}, None, ("x" * 5000, 3.5), [1, [2, {"k": b"\x00\xff"}]]]


def _rank(rank: int, store: str, out: str) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=3,
        timeout=timedelta(seconds=120),
    )
    sub = dist.new_group([1, 2])
    got: dict[str, object] = {}
    for polled in (False, True):  # blocking waits, then polled ones
        abort.set_polling(polled)
        objs = list(_OBJS) if rank == 0 else [None] * len(_OBJS)
        comm.broadcast_object_list(objs, src=0)
        gathered: list[object] = [None] * 3
        comm.all_gather_object(gathered, {"rank": rank, "pad": "y" * (100 * rank)})
        pair: list[object] = [f"from {rank}"] if rank == 2 else [None]
        sub_gathered: list[object] = [None] * 2
        if rank in (1, 2):
            comm.broadcast_object_list(pair, src=2, group=sub)
            comm.all_gather_object(sub_gathered, rank * 10, group=sub)
        got[str(polled)] = repr((objs, gathered, pair, sub_gathered))
    # rank 1 waits for an object rank 0 never sends; an abort request must end the wait
    dist.barrier()
    left = None
    if rank == 1:
        threading.Timer(0.3, abort.request_abort).start()
        t0 = time.monotonic()
        try:
            comm.broadcast_object_list([None], src=0)
        except abort.CommAbortedError:
            left = time.monotonic() - t0
    got["left_after_s"] = left
    Path(out, f"r{rank}.json").write_text(json.dumps(got))
    deadline = time.monotonic() + 60  # alive (silent) until rank 1 is done waiting
    while rank != 1 and not Path(out, "r1.json").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    os._exit(0)  # a work blocked on the helper thread stays alive: no orderly teardown


def test_object_collectives_match_torch_and_leave_on_abort(tmp_path: Path) -> None:
    spawn(_rank, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=3)
    got = [json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(3)]
    for r in got:
        assert r["True"] == r["False"], r
    assert repr(_OBJS) in got[2]["True"]  # the broadcast reached rank 2
    assert got[1]["left_after_s"] is not None and got[1]["left_after_s"] < 2.0, got[1]
