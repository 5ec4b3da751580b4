"""Reducing the host-sharing probe's raw times to a HostSharing (pure)."""

from __future__ import annotations

import pytest

from sailor.profiler.cpu_host.sharing import host_sharing_from


def _rank(rank: int, shift: float) -> dict[str, object]:
    # two ranks, one round each of 1 and 2 at once; whole steps (waits included) are slower
    # than the ranks' own work
    return {
        "rank": rank,
        "steps": {"1": [0.010], "2": [0.015]},
        "compute": {"1": [0.010], "2": [0.011]},
        "wake": {"idle": [0.001, 0.001], "loaded": [0.003, 0.003]},
        "rendezvous": {"idle": [0.0002, 0.0004], "loaded": [0.002]},
        # the engine's end of step, 2 ranks, two iterations: entry into the gradient
        # all-reduce, its exit (= entry into the next), that one's exit, the optimizer
        # step's end (= entry into the loss all-reduce), its exit; rank 1 enters `shift` later
        "entries": {
            "2": [
                [10.0 + shift, 10.004, 10.005, 10.007, 10.0075],
                [20.0 + shift, 20.006, 20.008, 20.010, 20.0101],
            ]
        },
        "entry_bytes": 8192,
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
    # from the later entry to the later exit: after compute (4 - 1) and (6 - 1) ms; after an
    # all-reduce 1 and 2 ms; after the update 0.5 and 0.1 ms
    assert free.allreduce_after_compute_s == pytest.approx((0.004,))
    assert free.allreduce_after_allreduce_s == pytest.approx((0.0015,))
    assert free.allreduce_after_update_s == pytest.approx((0.0003,))
    assert free.allreduce_probe_bytes == 8192 and free.measures_allreduce_entries
    assert free.allreduce_entry_s("compute", 2) == pytest.approx(0.004)
    # one rank: no all-reduce; more ranks than measured: the largest count measured
    assert free.allreduce_entry_s("compute", 1) == 0.0
    assert free.allreduce_entry_s("update", 4) == pytest.approx(0.0003)
    assert free.collective_wake_s == 0.0


def test_older_probe_output_without_the_new_measures_gives_zero_delays() -> None:
    res = [_rank(0, 0.0), _rank(1, 0.0)]
    for r in res:
        del r["rendezvous"], r["entries"]
    h = host_sharing_from(res, "cpu", cores=2, max_ranks=2)
    assert h.rendezvous_s == 0.0 and not h.measures_allreduce_entries
    assert h.allreduce_entry_s("compute", 2) == 0.0 and h.allreduce_probe_bytes == 0
