"""The simulator on the original artifact's 15 measured OPT-350 plans (GH-96).

A regression guard for the calibrated model, not a fit: the constants come from
``calibrate_gpu`` (each from the measurement that isolates it), and the bounds are loose.
The full table with leave-one-out figures is ``benchmarks/simulator_accuracy.py``.
"""

from __future__ import annotations

import statistics

import pytest

from sailor.catalog import gpus
from sailor.simulator import calibrate_gpu, simulate
from tests.reference_opt350 import DEEPSPEED, REF, load_opt350

pytestmark = pytest.mark.skipif(not REF.is_dir(), reason="reference data not present")


@pytest.fixture(scope="module")
def setup() -> tuple[object, ...]:
    return load_opt350()


def test_calibration_constants_are_physical(setup: tuple[object, ...]) -> None:
    model, profiles, network, prices, runs = setup
    cal = calibrate_gpu(runs, model, profiles, network, prices, gpu_specs=gpus(), base=DEEPSPEED)  # type: ignore[arg-type]
    assert 0.0 < cal.profiler_overhead_s < 2e-3
    assert 0.05 < cal.network_efficiency <= 1.0
    assert 1.0 <= cal.alloc_factor < 1.5
    assert 1 << 30 < (cal.memory_overhead_bytes or 0) < 8 << 30
    assert "N1_D1_M4_G1" in cal.source


def test_accuracy_regression_guard(setup: tuple[object, ...]) -> None:
    model, profiles, network, prices, runs = setup
    cal = DEEPSPEED.with_gpu(calibrate_gpu(runs, model, profiles, network, prices, base=DEEPSPEED))  # type: ignore[arg-type]
    et, em = [], []
    for r in runs:  # type: ignore[attr-defined]
        for method in ("closed_form", "replay"):
            est = simulate(
                r.plan,
                model,
                profiles,
                network,
                prices,
                calibration=cal,  # type: ignore[arg-type]
                gpu_specs=gpus(),
                method=method,
            )  # type: ignore[arg-type]
            assert est.fits_in_memory
            assert not est.uses_estimates
        et.append(abs(est.iteration_time_s / r.iteration_time_s - 1))
        em.append(abs(est.peak_memory_bytes / r.peak_memory_bytes - 1))
    assert statistics.mean(et) < 0.08
    assert statistics.mean(em) < 0.03
    assert max(em) < 0.10
