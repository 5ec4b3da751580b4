"""Reducing the host-sharing probe's raw times to a HostSharing (pure)."""

from __future__ import annotations

import pytest

from sailor.profiler.host_sharing import host_sharing_from


def _rank(rank: int, shift: float) -> dict[str, object]:
    # two ranks, one round each of 1 and 2 at once; whole steps (waits included) are slower
    # than the ranks' own work
    return {
        "rank": rank,
        "steps": {"1": [0.010], "2": [0.015]},
        "compute": {"1": [0.010], "2": [0.011]},
        "wake": {"idle": [0.001, 0.001], "loaded": [0.003, 0.003]},
        "rendezvous": {"idle": [0.0002, 0.0004], "loaded": [0.002]},
        # entries and exits on the host's clock: rank 1 enters 1 ms later each time
        "collective": {
            "cold_in": [10.0 + shift, 20.0 + shift],
            "cold_out": [10.004 + 0.001, 20.006 + 0.001],
            "hot_in": [10.005, 20.007],
            "hot_out": [10.0055, 20.0075],
        },
    }


def test_the_factors_come_from_whole_steps_or_from_each_rank_s_own_work() -> None:
    res = [_rank(0, 0.0), _rank(1, 0.001)]
    free = host_sharing_from(res, "cpu", cores=2, max_ranks=2)
    bound = host_sharing_from(res, "cpu", cores=2, max_ranks=2, pinned=True)
    assert free.slowdown == pytest.approx((1.0, 1.5)) and not free.pinned
    assert bound.slowdown == pytest.approx((1.0, 1.1)) and bound.pinned
    assert free.wake_s == pytest.approx(0.002)
    assert free.rendezvous_s == pytest.approx(0.0003)
    assert free.rendezvous_busy_s == pytest.approx(0.002)
    # from the later entry to the later exit: cold 4 and 6 ms, hot 0.5 ms each time
    assert free.collective_wake_s == pytest.approx(0.0045)


def test_older_probe_output_without_the_new_measures_gives_zero_delays() -> None:
    res = [_rank(0, 0.0), _rank(1, 0.0)]
    for r in res:
        del r["rendezvous"], r["collective"]
    h = host_sharing_from(res, "cpu", cores=2, max_ranks=2)
    assert h.rendezvous_s == 0.0 and h.collective_wake_s == 0.0
