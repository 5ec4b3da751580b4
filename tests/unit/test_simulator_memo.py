"""The simulator's memo of layer tables: identity-keyed inputs, bounded, shared results."""

from __future__ import annotations

import threading

import pytest

from sailor.schemas import Calibration
from sailor.simulator.lookup import forget_tables, layer_sizes, layer_table
from sailor.simulator.memo import IdentityMemo
from tests.unit.test_planner_search import make_env


def test_identity_keys_value_keys_and_eviction() -> None:
    memo = IdentityMemo(2)
    a, b = [1], [1]  # equal values, distinct objects
    calls: list[str] = []

    def make(tag: str) -> str:
        calls.append(tag)
        return tag

    assert memo.get((a,), ("k",), lambda: make("a")) == "a"
    assert memo.get((a,), ("k",), lambda: make("again")) == "a"  # a hit
    assert memo.get((b,), ("k",), lambda: make("b")) == "b"  # another object: a miss
    assert memo.get((a,), ("j",), lambda: make("aj")) == "aj"  # another key: a miss
    assert memo.get((a,), ("k",), lambda: make("a2")) == "a2"  # evicted (size 2, LRU)
    assert calls == ["a", "b", "aj", "a2"]
    assert (memo.hits, memo.misses) == (1, 4)
    with pytest.raises(ValueError, match="size=0"):
        IdentityMemo(0)


def test_many_threads_share_one_memo() -> None:
    memo = IdentityMemo(8)
    held = (object(),)
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for j in range(2000):
                assert memo.get(held, (j % 16,), lambda j=j: j % 16) == j % 16
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_layer_tables_are_shared_and_equal_to_fresh_ones() -> None:
    env = make_env()
    forget_tables()
    cal = Calibration().for_gpu("fast")
    one = layer_table(env.profiles, env.model, cal, env.specs, "fast", 1, 1)
    two = layer_table(env.profiles, env.model, cal, env.specs, "fast", 1, 1)
    assert one is two  # shared, not rebuilt
    other = layer_table(env.profiles, env.model, cal, env.specs, "fast", 1, 2)
    assert other is not one and other != one  # another microbatch size
    scaled = layer_table(
        env.profiles,
        env.model,
        cal.model_copy(update={"compute_scale": 2.0}),
        env.specs,
        "fast",
        1,
        1,
    )
    assert scaled.layers[1].fwd_s == pytest.approx(2 * one.layers[1].fwd_s)  # by value
    forget_tables()
    fresh = layer_table(env.profiles, env.model, cal, env.specs, "fast", 1, 1)
    assert fresh is not one and fresh == one
    assert layer_sizes(env.profiles, env.model, 1) is layer_sizes(env.profiles, env.model, 1)
