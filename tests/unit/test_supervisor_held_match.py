"""Which held worker takes which rank of an in-place launch (``supervisor._match_held``):
on GPUs a worker stays on its GPU first (its CUDA context and held shards live there), then
keeps its rank (its layers), then takes any; on a CPU kind, its rank, then any."""

from __future__ import annotations

from sailor.agent.supervisor import _gpu_of, _match_held
from sailor.agent.worker_view import WorkerView
from tests.unit.test_megatron_patch_devices import _plan, _rg


def _held(rank: int, gpu: int) -> WorkerView:
    return WorkerView(rank=rank, proc=None, gpu=gpu)  # type: ignore[arg-type]


def test_a_held_worker_stays_on_its_gpu_before_keeping_its_rank() -> None:
    # new plan: rank 0 on GPU 1, rank 1 on GPU 0 (the replica groups swapped GPUs)
    plan = _plan((_rg(first=1), _rg(first=0)))
    gpu_of = {r: _gpu_of(plan, r) for r in range(2)}
    assert gpu_of == {0: 1, 1: 0}
    a, b = _held(0, gpu=0), _held(1, gpu=1)
    got = _match_held([a, b], [0, 1], gpu_of)
    assert got == {0: b, 1: a}  # each stays on its GPU and takes the other's rank


def test_same_gpu_and_rank_first_then_rank_then_any() -> None:
    plan = _plan((_rg(first=0), _rg(first=1)), (_rg(first=2), _rg(first=3)))
    gpu_of = {r: _gpu_of(plan, r) for r in range(4)}
    w0, w1, w7 = _held(0, 0), _held(1, 3), _held(7, 9)
    got = _match_held([w0, w1, w7], [0, 1, 2, 3], gpu_of)
    # w0: its GPU and rank; w1 is on rank 3's GPU; w7 matches nothing: the first rank left
    assert got == {0: w0, 3: w1, 1: w7}


def test_a_cpu_kind_keeps_ranks_then_fills_in_rank_order() -> None:
    plan = _plan((_rg("cpu", first=0), _rg("cpu", first=0)))
    gpu_of = {r: _gpu_of(plan, r) for r in range(2)}
    assert gpu_of == {0: -1, 1: -1}
    w1, w5 = _held(1, -1), _held(5, -1)
    # rank 1 keeps its worker, though rank 0 comes first (before: rank 0 took it)
    assert _match_held([w1, w5], [0, 1], gpu_of) == {1: w1, 0: w5}
    assert _match_held([], [0, 1], gpu_of) == {}


def test_local_gpu_names_a_rank_outside_the_plan() -> None:
    import pytest

    plan = _plan((_rg(first=1), _rg(tp=2, first=2)))
    assert [plan.local_gpu(r) for r in range(3)] == [1, 2, 3]
    with pytest.raises(ValueError, match="rank=3"):
        plan.local_gpu(3)
