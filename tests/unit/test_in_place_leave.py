"""Leaving a held world (``in_place_steps.leave_world``): bounded, and without leaks.

The device's queued work is waited for with a deadline, not ``torch.cuda.synchronize``
(which has none: a rank whose peer died with an NCCL op still queued hung there); a world
left cleanly frees its groups, where every generation's stayed referenced for the life of
the process (descriptors, threads, NCCL host objects).
"""

from __future__ import annotations

import ast
import subprocess
import sys
import time
from typing import Any

import pytest
import torch

from sailor.megatron_patch import in_place_steps
from sailor.megatron_patch.in_place import Held


class _Trainer:
    device = torch.device("cuda", 0)


class _Event:
    """A CUDA event stand-in: done after ``after`` queries (never when None)."""

    def __init__(self, after: int | None) -> None:
        self.after, self.queries, self.recorded = after, 0, False

    def record(self, stream: object) -> None:
        self.recorded = True

    def query(self) -> bool:
        self.queries += 1
        return self.after is not None and self.queries > self.after


def _fake_cuda(monkeypatch: pytest.MonkeyPatch, event: _Event) -> None:
    def synchronize(*_a: object) -> None:
        raise AssertionError("torch.cuda.synchronize has no timeout: a dead peer hangs it")

    monkeypatch.setattr(torch.cuda, "Event", lambda *a, **k: event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: object())
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)


def _held() -> Held:
    return Held(_Trainer(), 0, 3, 12, False, 1)  # type: ignore[arg-type]


def test_a_device_that_drains_is_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    event = _Event(after=3)
    _fake_cuda(monkeypatch, event)
    assert in_place_steps._quiet_device(_held(), timeout_s=5.0) is True
    assert event.recorded and event.queries == 4


def test_leaving_a_world_whose_queued_op_never_ends_aborts_it_after_the_deadline(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A peer died with an unmatched NCCL op queued here: the event never completes. The
    leave gives up after its deadline and aborts the world anyway (its groups kept alive:
    the op may still block), instead of hanging in ``torch.cuda.synchronize``."""
    event = _Event(after=None)
    _fake_cuda(monkeypatch, event)
    aborted: list[bool] = []
    monkeypatch.setattr(in_place_steps.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(
        in_place_steps.comm_abort, "abandon_world", lambda idle=False: aborted.append(idle)
    )
    monkeypatch.setattr(in_place_steps, "QUIET_TIMEOUT_S", 0.05, raising=False)
    t = time.monotonic()
    in_place_steps.leave_world(_held())
    assert time.monotonic() - t < 2.0
    assert aborted == [False]  # aborted, and not taken for an idle world
    assert "did not finish within 0.05 s" in capsys.readouterr().err


def test_the_poll_backs_off_and_keeps_its_deadline() -> None:
    now = [0.0]
    pauses: list[float] = []

    def sleep(s: float) -> None:
        pauses.append(s)
        now[0] += s

    assert not in_place_steps._drained(lambda: False, 1.0, lambda: now[0], sleep)
    assert 1.0 <= now[0] < 1.02 and pauses[0] == 1e-4 and max(pauses) == 0.01
    assert in_place_steps._drained(lambda: True, 0.0, lambda: now[0], sleep)


_CYCLES = """
import os, tempfile
import torch, torch.distributed as dist
from sailor.comm import abort
from sailor.megatron_patch.in_place import Held
from sailor.megatron_patch.in_place_steps import leave_world

d = tempfile.mkdtemp()
counts = []
for i in range(6):
    store = dist.FileStore(os.path.join(d, f"s{i}"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    g = dist.new_group([0])
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.all_reduce(t, group=g)
    del g, store
    leave_world(Held(None, 0, 3, 12, False, i))
    counts.append((len(os.listdir("/proc/self/fd")), len(abort._graveyard)))
print("counts", counts, flush=True)
os._exit(0)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts /proc/self/fd")
def test_clean_leaves_free_their_worlds() -> None:
    """Six generations, each a gloo world with a subgroup, each left cleanly: the process's
    descriptors and the graveyard stay flat (before: +8 descriptors and +2 groups each)."""
    r = subprocess.run(
        [sys.executable, "-c", _CYCLES], capture_output=True, text=True, timeout=120, check=False
    )
    line = [x for x in r.stdout.splitlines() if x.startswith("counts")]
    assert line, r.stderr[-2000:]
    counts: list[Any] = ast.literal_eval(line[0].removeprefix("counts "))
    fds, graves = zip(*counts, strict=True)
    assert set(graves) == {0}, counts
    assert fds[-1] <= fds[1], counts  # the first world may open what later ones reuse


_EXIT = """
import faulthandler, os, sys, tempfile
import torch.distributed as dist
from sailor.megatron_patch.errors import fault_path
from sailor.megatron_patch.in_place_steps import leave_process

d = tempfile.mkdtemp()
err = os.path.join(d, "error.json")
faulthandler.enable(file=fault_path(err).open("w"), all_threads=True)  # as main does
dist.init_process_group("gloo", store=dist.FileStore(os.path.join(d, "s"), 1), rank=0, world_size=1)
print("fault file", fault_path(err), flush=True)
leave_process(7, err)
"""


def test_a_held_rank_told_to_exit_leaves_no_empty_fault_file() -> None:
    """``leave_process`` ends a held rank with ``os._exit``, which skips ``main``'s cleanup:
    the empty ``faulthandler`` file was left beside the error file (read as a crash that
    said nothing). Now it is deleted first."""
    from pathlib import Path

    r = subprocess.run(
        [sys.executable, "-c", _EXIT], capture_output=True, text=True, timeout=120, check=False
    )
    assert r.returncode == 7, r.stderr[-2000:]
    (line,) = [x for x in r.stdout.splitlines() if x.startswith("fault file ")]
    fault = Path(line.removeprefix("fault file "))
    assert fault.parent.is_dir() and not fault.exists()
