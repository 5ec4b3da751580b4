"""Pieces of the in-place worker without processes: the directive parser and the
abortable waits of ``sailor.comm.abort``."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from sailor.comm import abort
from sailor.megatron_patch.in_place import parse_directive


def _d(gen: object, argv: object) -> str:
    return json.dumps({"relayout": {"generation": gen, "argv": argv}})


def test_parse_directive() -> None:
    assert parse_directive(_d(3, ["--rank", "1"]), 2) == (3, ["--rank", "1"])
    assert parse_directive(_d(2, ["--rank", "1"]), 2) is None  # not newer
    assert parse_directive(_d(0, []), -1) == (0, [])
    for bad in ("", "{", "[]", '{"stop_at_step": 3}', _d(True, []), _d(3, "x"), _d(3, [1])):
        assert parse_directive(bad, -1) is None, bad


class _Never:
    """A work that never completes (a peer that is alive but will never answer)."""

    def __init__(self) -> None:
        self.waited = threading.Event()

    def is_completed(self) -> bool:
        return False

    def wait(self) -> bool:
        self.waited.wait()
        return True


class _Done:
    def is_completed(self) -> bool:
        return True

    def wait(self) -> bool:
        return True


@pytest.fixture
def polling() -> Iterator[None]:
    abort.set_polling(True)
    yield
    abort.set_polling(False)
    abort.clear_abort()


def test_abort_leaves_a_blocked_wait_promptly(polling: None) -> None:
    """A gloo work waited on the helper thread, and what the host polls on NCCL where it
    waits for the device (``host_sync``'s event: ``poll_until``), leave on an abort."""
    work = _Never()
    threading.Timer(0.1, abort.request_abort).start()
    t = time.monotonic()
    with pytest.raises(abort.CommAbortedError):
        abort.wait_threaded(work)
    assert time.monotonic() - t < 0.5
    assert abort.abandoned()  # the blocked work stays referenced
    work.waited.set()  # let the helper thread go
    abort.clear_abort()
    threading.Timer(0.1, abort.request_abort).start()
    t = time.monotonic()
    with pytest.raises(abort.CommAbortedError):
        abort.poll_until(work.is_completed)
    assert time.monotonic() - t < 0.5


class _Counting(_Done):
    """A completed work that counts how often the host asked whether it completed."""

    def __init__(self) -> None:
        self.asked = 0

    def is_completed(self) -> bool:
        self.asked += 1
        return True


def test_completed_works_pass_and_no_polling_blocks_plainly(polling: None) -> None:
    assert abort.wait(_Done()) is True and abort.wait_threaded(_Done()) is True
    assert abort.wait(None) is None
    # an NCCL work's wait is stream-ordered: the host never polls it (a poll made every
    # collective a host-device synchronization)
    counted = _Counting()
    assert abort.wait(counted) is True and counted.asked == 0
    abort.request_abort()
    with pytest.raises(abort.CommAbortedError):
        abort.wait(_Done())
    with pytest.raises(abort.CommAbortedError):
        abort.poll_until(lambda: True)
    abort.set_polling(False)
    assert abort.wait(_Done()) is True  # without polling: a plain wait, as before
    abort.host_sync(torch.device("cpu"))  # nothing to wait for off CUDA


def _two_stage_plan() -> tuple[object, object]:
    """tiny-gpt and the worker test's two-stage plan (``PP2``)."""
    from sailor.megatron_patch.model import tiny_model
    from tests.integration.test_in_place_worker import GBS, PP2

    return tiny_model("tiny-gpt", GBS), PP2


def test_a_rank_that_moved_devices_sends_from_its_new_one() -> None:
    """Two held workers swap ranks, so each sits on another GPU than the one its held
    shards live on (old GPU: ``cpu`` here, new GPU: ``meta``). NCCL sends only tensors on
    the rank's own device: every send of the exchange must be on the new one (the strict
    backend checks NCCL's rules; before, it refused ``send tensor on cpu``)."""
    import torch

    from sailor.comm.api import use_backend
    from sailor.comm.strict import StrictBackend
    from sailor.megatron_patch.engine import TrainConfig, Trainer
    from sailor.megatron_patch.groups import ProcessGroups
    from sailor.megatron_patch.in_place import exchange
    from sailor.megatron_patch.relayout import schedule
    from sailor.megatron_patch.roles import role_of
    from sailor.megatron_patch.tp_layers import TPContext

    spec, plan = _two_stage_plan()

    def trainer(rank: int, device: torch.device) -> Trainer:
        groups = ProcessGroups(tp=TPContext())
        return Trainer(plan, spec, role_of(plan, rank), groups, TrainConfig(), device)  # type: ignore[arg-type]

    held = trainer(1, torch.device("cpu"))  # this process was rank 1 on its old GPU ...
    new = torch.device("meta")
    new0 = trainer(0, new)  # ... and is rank 0 now, on another one
    backend = StrictBackend(0, new, 2)
    with use_backend(backend):
        exchange(new0, held, schedule(plan, {0: 1, 1: 0}, plan), 0, new)  # type: ignore[arg-type]


def test_release_frees_the_held_trainer() -> None:
    """After the new stage is filled the old trainer is dropped (its weights and moments
    would stay on the GPU for the whole generation), and its gradients before the new
    stage is built."""
    import weakref

    import torch

    from sailor.megatron_patch.engine import TrainConfig, Trainer
    from sailor.megatron_patch.groups import ProcessGroups
    from sailor.megatron_patch.in_place import Held
    from sailor.megatron_patch.in_place_steps import drop_old_grads, release
    from sailor.megatron_patch.roles import role_of
    from sailor.megatron_patch.tp_layers import TPContext

    spec, plan = _two_stage_plan()
    groups = ProcessGroups(tp=TPContext())
    tr = Trainer(plan, spec, role_of(plan, 0), groups, TrainConfig(), torch.device("cpu"))  # type: ignore[arg-type]
    for p in tr.stage.parameters():
        p.grad = torch.zeros_like(p)
    held = Held(tr, 0, 3, 12, False, 1)
    drop_old_grads(held)
    assert all(p.grad is None for p in tr.stage.parameters())
    ref = weakref.ref(tr)
    del tr
    release(held)  # by reference counting: a gc.collect() would add ~0.2 s of downtime
    assert held.trainer is None and ref() is None
    release(held)  # nothing left: a no-op
    release(None)


def test_kept_layers_are_taken_over_not_copied() -> None:
    """A kept layer's weights and moments are the held trainer's own tensors in the new
    stage (no second copy of them while both stages exist on the GPU)."""
    import torch

    from sailor.comm.api import use_backend
    from sailor.comm.strict import StrictBackend
    from sailor.megatron_patch.engine import TrainConfig, Trainer
    from sailor.megatron_patch.groups import ProcessGroups
    from sailor.megatron_patch.in_place import exchange
    from sailor.megatron_patch.relayout import schedule
    from sailor.megatron_patch.roles import role_of
    from sailor.megatron_patch.tp_layers import TPContext

    spec, plan = _two_stage_plan()
    cpu = torch.device("cpu")

    def trainer() -> Trainer:
        groups = ProcessGroups(tp=TPContext())
        return Trainer(plan, spec, role_of(plan, 0), groups, TrainConfig(), cpu)  # type: ignore[arg-type]

    held, new = trainer(), trainer()
    for p in held.stage.parameters():
        held.optimizer.state[p] = {
            "step": torch.tensor(3.0),
            "exp_avg": torch.full_like(p, 0.5),
            "exp_avg_sq": torch.full_like(p, 0.25),
        }
    with use_backend(StrictBackend(0, cpu, 2)):
        st = exchange(new, held, schedule(plan, {0: 0, 1: 1}, plan), 3, cpu)  # type: ignore[arg-type]
    assert st.kept_keys > 0 and st.received_keys == 0
    old = dict(held.stage.keyed_parameters())
    for key, p in new.stage.keyed_parameters():
        assert p.data_ptr() == old[key].data_ptr(), key
        s_new, s_old = new.optimizer.state[p], held.optimizer.state[old[key]]
        for m in ("exp_avg", "exp_avg_sq"):
            assert s_new[m].data_ptr() == s_old[m].data_ptr(), (key, m)
        assert float(s_new["step"]) == 3.0


_LEAVE = """
import os, sys, tempfile
import torch, torch.distributed as dist
from sailor.megatron_patch.in_place import Held
from sailor.megatron_patch.in_place_steps import leave_process, leave_world

def refuse(*a, **k):
    raise RuntimeError("destroy_process_group called: under NCCL it waits for every member")

d = tempfile.mkdtemp()
dist.init_process_group("gloo", store=dist.FileStore(os.path.join(d, "a"), 1), rank=0, world_size=1)
dist.destroy_process_group = refuse
leave_world(Held(None, 0, 3, 12, False, 1))
assert not dist.is_initialized()
dist.init_process_group("gloo", store=dist.FileStore(os.path.join(d, "b"), 1), rank=0, world_size=1)
t = torch.ones(1)
dist.all_reduce(t)
print("new world", float(t), flush=True)
leave_process(7)
print("returned", flush=True)
"""


def test_a_held_world_is_aborted_not_finalized() -> None:
    """A holder leaves its idle world by aborting it: torch's ``destroy_process_group``
    finalizes NCCL communicators and waits for every member to do the same, so a holder
    leaving while a peer is still being released (or was killed without leaving) would hang
    under NCCL (gloo's destroy is local: the test forbids the call). The next world starts;
    a held process told to exit aborts its world too and ends with ``os._exit``."""
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-c", _LEAVE], capture_output=True, text=True, timeout=120, check=False
    )
    assert "new world 1.0" in r.stdout, r.stderr[-2000:]
    assert "returned" not in r.stdout
    assert r.returncode == 7, r.stderr[-2000:]
