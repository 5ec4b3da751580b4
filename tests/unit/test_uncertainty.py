"""The uncertainty set: priors with evidence, corners, intervals (sailor.simulator.uncertainty).

On the reference data: the ``original`` corner reproduces the original artifact's own
simulator on the plans its planner chose (it is one point of the set), the catalog's GH-96
spread is the leave-one-out spread of its fit, and an interval orders its corners.
"""

from __future__ import annotations

import json

import pytest

from sailor import catalog
from sailor.importers.sailor_format import import_network, import_profiles, plan_from_dict
from sailor.schemas import Calibration, ConstantRange, GPUPrice, PriceTable
from sailor.simulator import calibrate_gpu
from sailor.simulator.uncertainty import CORNERS, corners, simulate_interval
from tests.reference_opt350 import DEEPSPEED, REF, load_opt350

CAL = catalog.calibration()


def test_range_must_be_ordered_and_names_its_values() -> None:
    with pytest.raises(ValueError, match="low/median/high"):
        ConstantRange(low=2.0, median=1.0, high=3.0)


def test_catalog_prior_covers_every_fitted_constant_with_evidence() -> None:
    prior = CAL.prior
    assert prior is not None
    for name in (
        "profiler_overhead_s",
        "network_efficiency",
        "p2p_efficiency",
        "p2p_fixed_s",
        "sync_fixed_s",
        "alloc_factor",
        "memory_overhead_bytes",
    ):
        r = getattr(prior, name)
        assert r.low < r.high, name  # a range, not a point
        assert len(r.evidence) > 40, name
    # no optimistic point default: the default is the prior's median
    assert CAL.default.network_efficiency == prior.network_efficiency.median
    assert CAL.default.memory_overhead_bytes == int(prior.memory_overhead_bytes.median)


def test_corners_take_each_end_and_the_original_model() -> None:
    by = dict(corners(CAL))
    assert tuple(by) == CORNERS
    opt, med, pes = (by[n].default for n in ("optimistic", "median", "pessimistic"))
    assert opt.network_efficiency > med.network_efficiency > pes.network_efficiency
    assert opt.profiler_overhead_s >= med.profiler_overhead_s >= pes.profiler_overhead_s
    assert opt.sync_fixed_s <= med.sync_fixed_s <= pes.sync_fixed_s
    assert opt.alloc_factor <= med.alloc_factor <= pes.alloc_factor
    assert (opt.memory_overhead_bytes or 0) < (pes.memory_overhead_bytes or 0)
    assert by["pessimistic"].grad_allreduce_bytes == 4
    assert by["pessimistic"].p2p_across_tp == "full_copies"  # deployment uncertainty
    assert by["median"].p2p_across_tp == CAL.p2p_across_tp == "scatter_gather"  # the engine's
    assert by["optimistic"].p2p_across_tp == "scatter_gather"
    orig = by["original"]
    assert orig.ring_links == "per_gpu" and orig.grad_allreduce_bytes == 4
    assert orig.extra_state_bytes_per_param == 8
    assert orig.default.network_efficiency == 1.0 and orig.default.profiler_overhead_s == 0
    # a calibrated type narrows to its spread
    gh = {n: c.for_gpu("GH-96") for n, c in by.items()}
    spread = CAL.for_gpu("GH-96").spread
    assert spread is not None
    assert gh["pessimistic"].network_efficiency == spread.network_efficiency.low
    assert gh["optimistic"].network_efficiency == spread.network_efficiency.high


needs_ref = pytest.mark.skipif(not REF.is_dir(), reason="reference data not present")


@needs_ref
def test_gh96_spread_is_the_leave_one_out_spread() -> None:
    model, profiles, network, prices, runs = load_opt350()
    fits = [
        calibrate_gpu(
            runs[:i] + runs[i + 1 :],
            model,
            profiles,
            network,
            prices,
            gpu_specs=catalog.gpus(),
            base=DEEPSPEED,
        )
        for i in range(len(runs))
    ]
    spread = CAL.for_gpu("GH-96").spread
    assert spread is not None
    for name in (
        "network_efficiency",
        "p2p_efficiency",
        "p2p_fixed_s",
        "sync_fixed_s",
        "alloc_factor",
        "profiler_overhead_s",
    ):
        xs = [getattr(f, name) for f in fits]
        r = getattr(spread, name)
        assert r.low == pytest.approx(min(xs), rel=1e-3), name
        assert r.high == pytest.approx(max(xs), rel=1e-3), name
    m0 = [f.memory_overhead_bytes or 0 for f in fits]
    assert spread.memory_overhead_bytes.low == min(m0)
    assert spread.memory_overhead_bytes.high == max(m0)


def _artifact_setup() -> tuple[object, ...]:
    model = catalog.model("OPT-350").model_copy(update={"global_batch_size": 1024})
    profiles = import_profiles(
        REF / "profiles/profiles_tmp.json", REF / "profiles/llm_info.json", "OPT-350"
    )
    network = import_network(
        REF / "providers/multizone_bandwidths_het.json",
        REF / "providers/intra_node_bandwidths.json",
    )
    prices = PriceTable(
        gpus=tuple(
            GPUPrice(gpu_type=g, region="*", on_demand_usd_per_hour=p, spot_usd_per_hour=p)
            for g, p in {"A100-40": 3.67, "V100-16": 2.86}.items()
        )
    )
    return model, profiles, network, prices


@needs_ref
def test_original_corner_reproduces_the_original_simulator_and_intervals_order() -> None:
    """The original planner's 11 plans, simulated in the ``original`` corner, land within 6%
    of the throughput the original's own simulator gave them (measured: 0-5%)."""
    model, profiles, network, prices = _artifact_setup()
    ref = json.loads((REF / "planner_results/original_planner_ae_scenarios.json").read_text())
    n = 0
    for entries in ref.values():
        for e in entries:
            plan = plan_from_dict(e["plan"], "OPT-350", global_batch_size=1024)
            med, iv = simulate_interval(
                plan,
                model,  # type: ignore[arg-type]
                profiles,  # type: ignore[arg-type]
                network,  # type: ignore[arg-type]
                prices,  # type: ignore[arg-type]
                calibration=CAL,
                gpu_specs=catalog.gpus(),
            )
            assert iv.corner("original").throughput_iter_s == pytest.approx(
                e["throughput"], rel=0.06
            )
            t = iv.iteration_time_s
            assert t.low <= t.median <= t.high
            assert med.iteration_time_s == t.median
            assert iv.corner("optimistic").iteration_time_s <= t.median
            assert iv.corner("pessimistic").iteration_time_s >= t.median
            assert iv.fits_in_memory == all(c.fits_in_memory for c in iv.corners)
            assert iv.peak_memory_bytes.high == max(c.peak_memory_bytes for c in iv.corners)
            n += 1
    assert n == 11


def test_corners_of_a_calibration_without_prior_keep_the_point() -> None:
    by = dict(corners(Calibration()))
    assert by["optimistic"].default.network_efficiency == 1.0
    assert by["pessimistic"].default.network_efficiency == 1.0


def test_a_spread_without_the_fixed_p2p_cost_keeps_the_point_value() -> None:
    """A range written before ``p2p_fixed_s`` existed has none for it: every corner but the
    original's keeps the calibration's point value, rather than 0."""
    gh = CAL.for_gpu("GH-96")
    assert gh.spread is not None and gh.spread.p2p_fixed_s is not None
    old = gh.spread.model_copy(update={"p2p_fixed_s": None})
    cal = CAL.with_gpu(gh.model_copy(update={"spread": old}))
    by = {n: c.for_gpu("GH-96").p2p_fixed_s for n, c in corners(cal)}
    assert by == {
        "optimistic": gh.p2p_fixed_s,
        "median": gh.p2p_fixed_s,
        "pessimistic": gh.p2p_fixed_s,
        "original": 0.0,
    }
    full = {n: c.for_gpu("GH-96").p2p_fixed_s for n, c in corners(CAL)}
    assert full["pessimistic"] == gh.spread.p2p_fixed_s.high > full["optimistic"]
    # and a file without the field loads
    raw = gh.spread.model_dump()
    del raw["p2p_fixed_s"]
    assert type(gh.spread).model_validate(raw).p2p_fixed_s is None


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_a_constant_must_be_finite(bad: float) -> None:
    """An infinite constant would be accepted, then written to JSON as null and refused on
    reading back: it is refused at once, by its name."""
    from pydantic import ValidationError

    from sailor.schemas import GPUCalibration

    for field in ("p2p_fixed_s", "sync_fixed_s", "profiler_overhead_s"):
        with pytest.raises(ValidationError, match=field):
            GPUCalibration(gpu_type="X", **{field: bad})
    with pytest.raises(ValidationError, match="high"):
        ConstantRange(low=0.0, median=1.0, high=bad)
