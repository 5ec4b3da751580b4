"""The link probe's pairs: which rank each exchanges with, slices, the slowest pair's time."""

from __future__ import annotations

import pytest

from sailor.profiler.network_probe import ProbeSettings, pair_peer, probe_sizes, slowest_pair


def test_side_0_ranks_pair_with_side_1_ranks() -> None:
    assert [pair_peer(r, 1) for r in range(2)] == [1, 0]
    assert [pair_peer(r, 4) for r in range(8)] == [4, 5, 6, 7, 0, 1, 2, 3]


def test_each_pair_sends_whole_float32_slices() -> None:
    sizes = probe_sizes(ProbeSettings(min_bytes=100, max_bytes=100_000, pairs=3))
    assert all(n % 12 == 0 and n > 0 for n, _ in sizes)
    assert sizes[-1][0] == 100_000 - 100_000 % 12
    # one pair: the sizes as they were (4-aligned powers of two from min_bytes)
    one = probe_sizes(ProbeSettings(min_bytes=64 << 10, max_bytes=256 << 10))
    assert [n for n, _ in one] == [64 << 10, 128 << 10, 256 << 10]


def test_a_repetition_lasts_as_long_as_its_slowest_pair() -> None:
    assert slowest_pair([[1.0, 5.0, 2.0], [3.0, 1.0, 2.5]]) == [3.0, 5.0, 2.5]
    assert slowest_pair([[1.0, 2.0]]) == [1.0, 2.0]
    with pytest.raises(ValueError, match="repetitions per pair"):
        slowest_pair([[1.0], [1.0, 2.0]])


def test_pairs_must_be_positive_and_fit_the_message() -> None:
    with pytest.raises(ValueError, match="pairs=0"):
        ProbeSettings(pairs=0)
    with pytest.raises(ValueError, match="each pair needs a float32"):
        ProbeSettings(min_bytes=4, max_bytes=12, pairs=4)
