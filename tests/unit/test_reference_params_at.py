"""``train_reference(..., params_at=k)``: the weights after k steps of a longer run equal a run
of k steps (the chaos verdict trains one pair of references for losses and weights)."""

from __future__ import annotations

from sailor.megatron_patch.engine import TrainConfig
from sailor.megatron_patch.model import tiny_model
from sailor.megatron_patch.reference import train_reference


def test_params_at_equal_a_shorter_run() -> None:
    spec = tiny_model("tiny-gpt", 4)
    long = train_reference(spec, 4, 4, TrainConfig(seed=0), params_at=2)
    short = train_reference(spec, 4, 2, TrainConfig(seed=0))
    assert long.losses[:2] == short.losses
    assert set(long.params_at) == set(short.params)
    for k, p in short.params.items():
        assert (long.params_at[k] == p).all(), k
    assert any(not (long.params[k] == p).all() for k, p in short.params.items())
