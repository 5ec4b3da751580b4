"""A step whose tensors hold an inf or NaN is never committed, and the committed ones stay.

Before, the writer saved NaN weights like any others, and retention after that commit could
delete the last good checkpoints. Each test fails on the code before the check.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch

from sailor.checkpoint import (
    LocalStorage,
    NonFiniteCheckpointError,
    ParamState,
    TrainingGlobals,
    committed_steps,
    load,
    save_full,
)
from sailor.checkpoint.writer import commit, nonfinite_key, persist_layers
from tests.unit.test_checkpoint_local import _state


def _save(root: Path, step: int, state: dict[str, ParamState], keep: int | None = 1) -> None:
    save_full(
        LocalStorage(root),
        state,
        TrainingGlobals(step, step * 4, {}),
        model="toy",
        num_layers=4,
        save_id=f"id{step}",
        keep=keep,
    )


@pytest.mark.parametrize(("kind", "bad"), [("weight", math.nan), ("exp_avg_sq", math.inf)])
def test_a_non_finite_tensor_is_refused_by_name_and_the_last_checkpoint_stays(
    tmp_path: Path, kind: str, bad: float
) -> None:
    _save(tmp_path, 3, _state(seed=0))
    state = _state(seed=1)
    state["2.v"].tensor(kind)[1, 5] = bad
    # keep=1: a commit of step 4 would have deleted step 3
    with pytest.raises(NonFiniteCheckpointError, match=rf"step 4: tensor 2\.v\.{kind} ") as e:
        _save(tmp_path, 4, state)
    assert e.value.key == f"2.v.{kind}" and not e.value.retryable
    assert committed_steps(LocalStorage(tmp_path)) == [3]
    got = load(LocalStorage(tmp_path), range(4)).params
    want = _state(seed=0)
    assert all(torch.equal(got[k].weight, want[k].weight) for k in want)


def test_the_committer_raises_a_writers_refusal_at_once(tmp_path: Path) -> None:
    """Writer rank 1 finds a NaN: its part file says so, and the committer raises that
    (before, it waited for a part from every writer until its timeout)."""
    storage = LocalStorage(tmp_path)
    state = _state(seed=0)
    state["1.b"].weight[0] = math.nan
    by_layer = {1: {"b": state["1.b"], "w": state["1.w"]}}
    with pytest.raises(NonFiniteCheckpointError, match=r"tensor 1\.b\.weight"):
        persist_layers(storage, 5, "sid", by_layer, rank=1)
    t0 = time.monotonic()
    with pytest.raises(NonFiniteCheckpointError, match=r"step 5: tensor 1\.b\.weight"):
        commit(
            storage,
            step=5,
            save_id="sid",
            writer_ranks=[0, 1],
            globals_=TrainingGlobals(5, 20, {}),
            model="toy",
            num_layers=4,
            timeout_s=30.0,
        )
    assert time.monotonic() - t0 < 5.0
    assert committed_steps(storage) == []


def _one(t: torch.Tensor) -> ParamState:
    return ParamState(t, torch.zeros_like(t), torch.zeros_like(t), None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_the_check_finds_any_non_finite_value_and_names_the_first_tensor(
    dtype: torch.dtype, bad: float
) -> None:
    """In every float dtype, anywhere in a tensor (a vectorized body or its tail), the first
    tensor in file order; a float64 value beyond float32's range is finite, not flagged."""
    big = torch.full((3, 1001), 1e300 if dtype == torch.float64 else 1.0, dtype=dtype)
    by_layer = {2: {"a": _one(big.clone()), "b": _one(big.clone())}, 1: {"c": _one(big)}}
    assert nonfinite_key(by_layer) is None
    by_layer[2]["b"].exp_avg[2, 1000] = bad
    assert nonfinite_key(by_layer) == "2.b.exp_avg"
    by_layer[2]["b"].weight[0, 0] = bad
    assert nonfinite_key(by_layer) == "2.b.weight"
    by_layer[1]["c"].exp_avg_sq[1, 500] = bad
    assert nonfinite_key(by_layer) == "1.c.exp_avg_sq"
