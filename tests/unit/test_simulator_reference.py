"""The simulator on the original artifact's 15 measured OPT-350 plans (GH-96).

Out of sample: every plan is predicted with constants ``calibrate_gpu`` derived from the
other 14 runs (leave-one-out), for the closed form and the replay.
The full table with leave-one-out figures is ``benchmarks/simulator_accuracy.py``.
"""

from __future__ import annotations

import dataclasses
import statistics

import pytest

from sailor.catalog import gpus
from sailor.simulator import calibrate_gpu, simulate
from tests.reference_opt350 import DEEPSPEED, REF, load_opt350

pytestmark = pytest.mark.skipif(not REF.is_dir(), reason="reference data not present")


@pytest.fixture(scope="module")
def setup() -> tuple[object, ...]:
    return load_opt350()


@pytest.fixture(scope="module")
def folds(setup: tuple[object, ...]) -> list[object]:
    """Each run's constants, calibrated on the other 14 (shared by the tests below)."""
    model, profiles, network, prices, runs = setup
    return [
        calibrate_gpu(
            runs[:i] + runs[i + 1 :],  # type: ignore[index]
            model,  # type: ignore[arg-type]
            profiles,  # type: ignore[arg-type]
            network,  # type: ignore[arg-type]
            prices,  # type: ignore[arg-type]
            gpu_specs=gpus(),
            base=DEEPSPEED,
        )
        for i in range(len(runs))  # type: ignore[arg-type]
    ]


def test_calibration_constants_are_physical(setup: tuple[object, ...]) -> None:
    model, profiles, network, prices, runs = setup
    cal = calibrate_gpu(runs, model, profiles, network, prices, gpu_specs=gpus(), base=DEEPSPEED)  # type: ignore[arg-type]
    assert 0.0 < cal.profiler_overhead_s < 2e-3
    assert 0.05 < cal.network_efficiency <= 1.0
    # read on the GH-96 node links (the probed curve's peak), where they apply as read
    assert cal.efficiency_link_gbps == pytest.approx(92.55, rel=1e-3)
    assert "read on links of peak 92.55 GB/s" in cal.source
    # read with a fixed cost per transfer from the 9 multi-stage runs' pipeline phases (at
    # two microbatch sizes), below the collectives' efficiency (0.116 and 0.67 ms)
    assert cal.p2p_efficiency is not None
    assert 0.05 < cal.p2p_efficiency < cal.network_efficiency
    assert 1e-4 < cal.p2p_fixed_s < 2e-3
    assert "eta_p2p" in cal.source and "p2p_fixed=" in cal.source
    assert 1.0 <= cal.alloc_factor < 1.5
    assert 1 << 30 < (cal.memory_overhead_bytes or 0) < 8 << 30
    assert "N1_D1_M4_G1" in cal.source


def _loo_errors(
    setup: tuple[object, ...], folds: list[object], method: str
) -> tuple[list[float], list[float]]:
    """Signed time and memory errors of every run, each predicted with constants calibrated
    on the other 14 runs only (out of sample)."""
    model, profiles, network, prices, runs = setup
    et, em = [], []
    for r, fold in zip(runs, folds, strict=True):  # type: ignore[call-overload]
        cal = DEEPSPEED.with_gpu(fold)  # type: ignore[arg-type]
        est = simulate(
            r.plan,
            model,  # type: ignore[arg-type]
            profiles,  # type: ignore[arg-type]
            network,  # type: ignore[arg-type]
            prices,  # type: ignore[arg-type]
            calibration=cal,
            gpu_specs=gpus(),
            method=method,  # type: ignore[arg-type]
        )
        assert est.fits_in_memory
        assert not est.uses_estimates
        et.append(est.iteration_time_s / r.iteration_time_s - 1)
        em.append(est.peak_memory_bytes / r.peak_memory_bytes - 1)
    return et, em


@pytest.mark.parametrize("method", ["closed_form", "replay"])
def test_leave_one_out_accuracy(
    setup: tuple[object, ...], folds: list[object], method: str
) -> None:
    """Out of sample. Measured: time 5.5% mean / 19.6% worst (closed form and replay alike;
    6.3% with the p2p efficiency alone, no fixed cost per transfer; 10.1% / 21.6% before the
    p2p efficiency was fitted and the hook cost read from a single run when its pair is held
    out; worst N4_D4, whose reduce time shows a straggler, and
    N2_D2, both slower than their profile), memory 1.8% / 7.3%. Guards just above those
    figures."""
    et, em = _loo_errors(setup, folds, method)
    t, m = [abs(e) for e in et], [abs(e) for e in em]
    assert statistics.mean(t) < 0.058
    assert max(t) < 0.21
    assert statistics.mean(m) < 0.025
    assert max(m) < 0.08


@pytest.mark.xfail(strict=True, reason="issue 17 target (6% mean, 15% worst) not met out of sample")
def test_leave_one_out_meets_target(setup: tuple[object, ...], folds: list[object]) -> None:
    t = [abs(e) for e in _loo_errors(setup, folds, "closed_form")[0]]
    assert statistics.mean(t) <= 0.06
    assert max(t) <= 0.15


def test_hook_cost_without_its_pair_comes_from_one_run(setup: tuple[object, ...]) -> None:
    """Without the pair differing only in microbatches, h comes from the single-stage,
    single-pipeline run with the most microbatches, minus its measured reduce and its
    update; without a reduce time either, h is 0 (the profile at face value)."""
    model, profiles, network, prices, runs = setup
    rest = [r for r in runs if not r.name.endswith("N1_D1_M4_G1")]  # type: ignore[attr-defined]
    cal = calibrate_gpu(rest, model, profiles, network, prices, gpu_specs=gpus(), base=DEEPSPEED)  # type: ignore[arg-type]
    # _G32 alone: 32 microbatches in 2.281 s minus 8 ms of reduce: ~71.0 ms each against
    # 83.5 ms profiled, so within 3% of the pair's 0.472 ms per layer
    assert cal.profiler_overhead_s == pytest.approx(0.472e-3, rel=0.03)
    assert "N1_D1_M4_G32 alone" in cal.source
    blind = [dataclasses.replace(r, grad_reduce_s=None) for r in rest]  # type: ignore[attr-defined]
    cal = calibrate_gpu(blind, model, profiles, network, prices, gpu_specs=gpus(), base=DEEPSPEED)  # type: ignore[arg-type]
    assert cal.profiler_overhead_s == 0.0
    assert "nor a single-stage run" in cal.source


def test_a_p2p_reading_at_a_bound_is_left_out(setup: tuple[object, ...]) -> None:
    """A pipelined run faster than simulated even with perfect transfers (here N2_D1
    measured 10% faster, ordinary compute noise) reads the bound 1.0; kept, it moved the
    GH-96 fit by 30%. It is left out, and the fit is the other runs'."""
    model, profiles, network, prices, runs = setup
    base = calibrate_gpu(runs, model, profiles, network, prices, gpu_specs=gpus(), base=DEEPSPEED)  # type: ignore[arg-type]
    n2 = next(r for r in runs if r.name.endswith("N2_D1"))  # type: ignore[attr-defined]
    fast = dataclasses.replace(n2, name="fast", iteration_time_s=0.9 * n2.iteration_time_s)
    cal = calibrate_gpu(
        [*runs, fast], model, profiles, network, prices, gpu_specs=gpus(), base=DEEPSPEED
    )  # type: ignore[arg-type,list-item]
    assert cal.p2p_efficiency == pytest.approx(base.p2p_efficiency, rel=1e-9)
    assert cal.p2p_fixed_s == pytest.approx(base.p2p_fixed_s, rel=1e-9)
    assert "1 at a bound of [0.01, 1] left out" in cal.source


def test_p2p_fixed_cost_needs_two_microbatch_sizes(setup: tuple[object, ...]) -> None:
    """Without the two microbatch-1 pipelined runs (N4_D1, N4_D2) every pipelined run is at
    microbatch 8: bytes and transfers move together and the fixed cost cannot be told from
    the efficiency, so it stays 0 and η_p2p is the geometric mean of the readings."""
    model, profiles, network, prices, runs = setup
    rest = [r for r in runs if not r.name.endswith(("N4_D1", "N4_D2"))]  # type: ignore[attr-defined]
    cal = calibrate_gpu(rest, model, profiles, network, prices, gpu_specs=gpus(), base=DEEPSPEED)  # type: ignore[arg-type]
    assert cal.p2p_fixed_s == 0.0
    assert cal.p2p_efficiency is not None and 0.02 < cal.p2p_efficiency < 0.2
    assert "one microbatch size" in cal.source
