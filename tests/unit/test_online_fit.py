"""The online fit: constants recovered from the timings a known cluster would report.

Timings come from :func:`expected_rank_timings` under a "true" calibration (a slow kind, a
poor network), so the fit has a known answer; noise between ranks widens its ranges.
OPT-350 on the catalog's A100-40 and V100-16 specs (analytic profiles), as a controller
without profile files plans it.
"""

from __future__ import annotations

from typing import Any

import pytest

from sailor import catalog
from sailor.schemas import (
    Calibration,
    Endpoint,
    Estimate,
    NetworkProfile,
    Pipeline,
    Plan,
    ProfileDB,
    ReplicaGroup,
    Stage,
)
from sailor.schemas.network import CollectiveLatency
from sailor.schemas.online_calibration import FittedConstant, OnlineFit, RankTimings
from sailor.simulator import online_fit
from sailor.simulator.fit_corners import (
    range_corners,
    scale_ends,
    with_constant,
    with_spread_restored,
)
from sailor.simulator.online_fit import fit_online
from sailor.simulator.synthetic_timings import expected_rank_timings
from sailor.simulator.uncertainty import corners

FAST, SLOW = "A100-40", "V100-16"
MODEL = catalog.model("OPT-350").model_copy(update={"global_batch_size": 32})
PROFILES = ProfileDB(model=MODEL.name)
NETWORK = NetworkProfile()
PRICES = catalog.prices()
SPECS = catalog.gpus()
BASE = catalog.calibration()


def _as_read(cal: Calibration) -> Calibration:
    """``cal`` with every efficiency taken on every link as it is (no link it was read on):
    the p2p tests' transfers over this network's fallback link, ~30 times slower than the
    catalog's GH200 links, would keep ~95 % of their bandwidth at any efficiency read there,
    too little time for the fit to identify (the transported frame: the data-parallel tests)."""
    strip = {"efficiency_link_gbps": None}
    prior = cal.prior.model_copy(update=strip) if cal.prior is not None else None
    return cal.model_copy(
        update={
            "default": cal.default.model_copy(update=strip),
            "gpus": tuple(g.model_copy(update=strip) for g in cal.gpus),
            "prior": prior,
        }
    )


AS_READ = _as_read(BASE)


def _rg(gpu: str, node: str) -> ReplicaGroup:
    return ReplicaGroup(gpu_type=gpu, zone="z-a-1", tp=1, gpus_per_node=1, node_id=node)


def _pipeline_plan() -> Plan:
    """Two stages: V100 holds layers 0-9, A100 10-25 (the prior's choice for this pair)."""
    stages = (
        Stage(first_layer=0, last_layer=9, replica=_rg(SLOW, "n2")),
        Stage(first_layer=10, last_layer=25, replica=_rg(FAST, "n1")),
    )
    return Plan(
        plan_id="pp",
        model=MODEL.name,
        global_batch_size=32,
        pipelines=(Pipeline(stages=stages, microbatch_size=1, num_microbatches=32),),
    )


def _dp_plan(kinds: tuple[str, ...]) -> Plan:
    m = 32 // len(kinds)
    return Plan(
        plan_id="dp",
        model=MODEL.name,
        global_batch_size=32,
        pipelines=tuple(
            Pipeline(
                stages=(Stage(first_layer=0, last_layer=25, replica=_rg(g, f"n{i}")),),
                microbatch_size=1,
                num_microbatches=m,
            )
            for i, g in enumerate(kinds)
        ),
    )


def _timings(plan: Plan, truth: Calibration) -> tuple[RankTimings, ...]:
    return expected_rank_timings(
        plan, MODEL, PROFILES, NETWORK, PRICES, calibration=truth, gpu_specs=SPECS
    )


def _fit(plan: Plan, timings: tuple[RankTimings, ...], base: Calibration = BASE) -> OnlineFit:
    return fit_online(
        plan, timings, MODEL, PROFILES, NETWORK, PRICES, calibration=base, gpu_specs=SPECS
    )


def _const(fit: OnlineFit, gpu: str, name: str) -> float:
    c = fit.constant(gpu, name)
    assert c is not None
    return c.value


def test_pipeline_recovers_compute_scales_p2p_efficiency_and_fixed_sync() -> None:
    plan = _pipeline_plan()
    # one microbatch size moves the fixed cost per transfer and the efficiency along one
    # line through the kept pair (fit_p2p.fit_p2p_constants): the truth lies on it
    eta0, c0 = AS_READ.for_gpu(SLOW).p2p_eta, AS_READ.for_gpu(SLOW).p2p_fixed_s
    c_true = c0 * eta0 / 0.3
    truth = with_constant(
        AS_READ, SLOW, compute_scale=2.5, p2p_efficiency=0.3, p2p_fixed_s=c_true, sync_fixed_s=0.01
    )
    truth = with_constant(truth, FAST, compute_scale=0.8, p2p_efficiency=0.3, p2p_fixed_s=c_true)
    timings = list(_timings(plan, truth))
    # as the engine measures it: the head's stage, done first, waits at the tied all-reduce
    timings[1] = timings[1].model_copy(update={"sync_s": timings[1].sync_s + 0.05})
    fit = _fit(plan, tuple(timings), AS_READ)
    assert _const(fit, SLOW, "compute_scale") == pytest.approx(2.5, rel=1e-6)
    assert _const(fit, FAST, "compute_scale") == pytest.approx(0.8, rel=1e-6)
    assert _const(fit, SLOW, "p2p_efficiency") == pytest.approx(0.3, rel=0.01)
    assert _const(fit, FAST, "p2p_fixed_s") == pytest.approx(c_true, rel=0.01)
    # both stages hold a copy of the tied embedding: the first, done last in 1F1B, arrived
    # last at their all-reduce, and gives the fixed cost (tests below)
    assert _const(fit, SLOW, "sync_fixed_s") == pytest.approx(0.01, rel=1e-6)
    assert fit.calibration.for_gpu(SLOW).compute_scale == pytest.approx(2.5, rel=1e-6)
    # a single pipeline all-reduces nothing: the network efficiency is not identified
    eta = fit.constant(SLOW, "network_efficiency")
    assert (
        eta is not None and not eta.fitted and eta.value == AS_READ.for_gpu(SLOW).network_efficiency
    )
    # the running plan was predicted 2x too fast; after the fit within the closed form's
    # distance from the replay the timings came from
    assert fit.error_before < -0.4
    assert abs(fit.error_after) < 0.03
    print(
        f"pipeline fit: error {fit.error_before:+.3f} -> {fit.error_after:+.3f}; "
        f"p2p {_const(fit, SLOW, 'p2p_efficiency'):.4f} (true 0.3)"
    )


@pytest.mark.parametrize(
    ("eta", "fixed"), [(1.0, 0.0), (1.0, 2e-4), (0.15, 2e-3), (0.3, 0.0), (0.8, 5e-3)]
)
def test_transfers_off_the_kept_line_are_matched(eta: float, fixed: float) -> None:
    """Clusters whose transfers cost what the kept pair's line does not hold (no fixed cost at
    full bandwidth: the fixed cost shrinks once the efficiency reaches 1; a slower or faster
    link, with a fixed cost of its own): the scale of the transfers' cost still matches the
    measured waits, so the running plan is predicted as it runs."""
    plan = _pipeline_plan()
    truth = AS_READ
    for g in (SLOW, FAST):
        truth = with_constant(truth, g, p2p_efficiency=eta, p2p_fixed_s=fixed)
    fit = _fit(plan, _timings(plan, truth), AS_READ)
    got = fit.constant(SLOW, "p2p_efficiency"), fit.constant(SLOW, "p2p_fixed_s")
    assert got[0] is not None and got[1] is not None and got[0].fitted and got[1].fitted
    assert got[0].low <= got[0].value <= got[0].high <= 1.0
    assert 0.0 <= got[1].low <= got[1].value <= got[1].high
    kept = AS_READ.for_gpu(SLOW)
    if eta == 1.0:  # past the line's η = 1 point, where the fixed cost is c0 · η0
        assert got[0].value == 1.0
        assert abs(got[1].value - fixed) < kept.p2p_fixed_s * kept.p2p_eta / 100
    assert abs(fit.error_after) < 0.01 and abs(fit.error_before) > 0.03


def test_successive_fits_stay_on_the_configured_line() -> None:
    """A first fit on a cluster without a fixed cost takes it (nearly) away; when the
    transfers later cost what the configured pair says, the next fit, anchored on the
    configured calibration, brings it back. Anchored on the kept one, it could not: its line
    has (nearly) no fixed cost left, and the efficiency alone moves."""
    plan = _pipeline_plan()
    free = BASE
    for g in (SLOW, FAST):
        free = with_constant(free, g, p2p_efficiency=1.0, p2p_fixed_s=0.0)
    first = _fit(plan, _timings(plan, free))
    kept = first.calibration
    assert kept.for_gpu(SLOW).p2p_fixed_s < 1e-5
    timings = _timings(plan, BASE)  # the cluster is the configured pair after all
    again = fit_online(
        plan, timings, MODEL, PROFILES, NETWORK, PRICES, calibration=kept, gpu_specs=SPECS,
        anchor=BASE,
    )  # fmt: skip
    want = BASE.for_gpu(SLOW)
    assert _const(again, SLOW, "p2p_fixed_s") == pytest.approx(want.p2p_fixed_s, rel=0.01)
    assert _const(again, SLOW, "p2p_efficiency") == pytest.approx(want.p2p_eta, rel=0.01)
    stuck = _fit(plan, timings, kept)  # no anchor: the kept calibration's line
    assert _const(stuck, SLOW, "p2p_fixed_s") < 1e-5


def test_without_a_kept_fixed_cost_the_efficiency_alone_is_fitted() -> None:
    """A kept pair without a fixed cost (the CPU kind, a calibration from before it): the
    scale moves the efficiency only, and the fixed cost is reported kept, at 0."""
    plan = _pipeline_plan()
    base = truth = AS_READ
    for g in (SLOW, FAST):
        base = with_constant(base, g, p2p_fixed_s=0.0)
        truth = with_constant(truth, g, p2p_efficiency=0.3, p2p_fixed_s=0.0)
    fit = _fit(plan, _timings(plan, truth), base)
    eta, fixed = fit.constant(SLOW, "p2p_efficiency"), fit.constant(SLOW, "p2p_fixed_s")
    assert eta is not None and eta.fitted and eta.value == pytest.approx(0.3, rel=0.01)
    assert fixed is not None and not fixed.fitted and fixed.value == 0.0


def test_data_parallel_recovers_network_efficiency_from_the_last_arriver() -> None:
    plan = _dp_plan((FAST, SLOW))
    truth = with_constant(BASE, SLOW, compute_scale=1.5, network_efficiency=0.2)
    truth = with_constant(truth, FAST, network_efficiency=0.2)
    timings = _timings(plan, truth)
    # the fast replica waits in the all-reduce for the slow one: its sync is the longer
    assert timings[0].sync_s > timings[1].sync_s
    fit = _fit(plan, timings)
    assert _const(fit, SLOW, "network_efficiency") == pytest.approx(0.2, rel=0.01)
    assert _const(fit, FAST, "network_efficiency") == pytest.approx(0.2, rel=0.01)
    assert _const(fit, SLOW, "compute_scale") == pytest.approx(1.5, rel=1e-6)
    assert abs(fit.error_after) < abs(fit.error_before)


def test_noise_between_ranks_widens_the_range() -> None:
    plan = _dp_plan((SLOW,) * 4)
    truth = with_constant(BASE, SLOW, compute_scale=2.0)
    clean = _timings(plan, truth)

    def noisy(spread: float) -> tuple[RankTimings, ...]:
        out = []
        for t, k in zip(
            clean, (1 - spread, 1 - spread / 3, 1 + spread / 3, 1 + spread), strict=True
        ):
            out.append(
                t.model_copy(
                    update={
                        "fwd_s": t.fwd_s * k,
                        "bwd_s": t.bwd_s * k,
                        "steps": 8,
                        "compute_spread": spread,
                    }
                )
            )
        return tuple(out)

    widths = []
    for spread in (0.0, 0.02, 0.2):
        c = _fit(plan, noisy(spread)).constant(SLOW, "compute_scale")
        assert c is not None and c.low <= 2.0 <= c.high
        assert c.value == pytest.approx(2.0, rel=spread / 2 + 1e-9)
        widths.append(c.relative_uncertainty)
    assert widths[0] == 0.0 < widths[1] < widths[2]


def test_one_replica_groups_network_efficiency_has_its_syncs_step_to_step_range() -> None:
    """One replica group (two A100 replicas all-reducing together): η is read from its last
    arriver's sync over some steps, so its range is the interval the sync's step-to-step
    spread gives (through η = all-reduce at η=1 / (sync - fixed)), narrower over more steps,
    the point when the steps do not vary. Fails on the old code: the range was the min/max
    over replica groups, one group's low == high however much its steps varied."""
    plan = _dp_plan((FAST, FAST))
    truth = with_constant(BASE, FAST, network_efficiency=0.3)
    clean = _timings(plan, truth)

    def eta_of(spread: float, steps: int) -> FittedConstant:
        ts = tuple(t.model_copy(update={"steps": steps, "sync_spread": spread}) for t in clean)
        c = _fit(plan, ts).constant(FAST, "network_efficiency")
        assert c is not None and c.fitted and c.samples == 1
        assert c.value == pytest.approx(0.3, rel=0.01)
        assert c.low <= c.value <= c.high
        return c

    steady = eta_of(0.0, 8)
    assert steady.low == steady.high == steady.value
    varied, longer = eta_of(0.2, 8), eta_of(0.2, 32)
    assert varied.low < varied.value < varied.high
    assert varied.relative_uncertainty > 0.05
    assert 0 < longer.relative_uncertainty < varied.relative_uncertainty
    assert eta_of(0.02, 8).relative_uncertainty < varied.relative_uncertainty


def test_kinds_not_running_keep_their_constants_and_foreign_ranks_are_ignored() -> None:
    plan = _dp_plan((FAST,))
    base = with_constant(BASE, "H100-80", compute_scale=1.7)
    timings = (*_timings(plan, with_constant(base, FAST, compute_scale=1.2)),)
    stray = timings[0].model_copy(update={"rank": 5})
    fit = _fit(plan, (*timings, stray), base)
    assert fit.calibration.for_gpu("H100-80").compute_scale == 1.7
    assert fit.calibration.for_gpu(FAST).compute_scale == pytest.approx(1.2)
    assert any("rank 5" in n for n in fit.notes)
    with pytest.raises(ValueError, match="no timing"):
        _fit(plan, (stray,), base)


def _ranged(gpu: str, name: str, value: float, low: float, high: float) -> FittedConstant:
    return FittedConstant(
        gpu_type=gpu, name=name, value=value, low=low, high=high, previous=1.0, samples=2,
        fitted=True, evidence="test",
    )  # fmt: skip


def test_range_corners_span_every_combination_of_the_fitted_ends() -> None:
    fitted = [
        _ranged(FAST, "compute_scale", 1.0, 0.8, 1.5),
        _ranged(SLOW, "compute_scale", 2.0, 1.6, 2.4),
        _ranged(FAST, "p2p_efficiency", 0.5, 0.4, 0.7),
        _ranged(SLOW, "p2p_efficiency", 0.5, 0.4, 0.7),
        _ranged(FAST, "p2p_fixed_s", 5e-4, 3e-4, 8e-4),
        _ranged(SLOW, "p2p_fixed_s", 5e-4, 3e-4, 8e-4),
        _ranged(FAST, "sync_fixed_s", 0.01, 0.0, 0.02),  # not a corner dimension
    ]
    corners = range_corners(BASE, fitted)
    seen = {
        (c.for_gpu(FAST).compute_scale, c.for_gpu(SLOW).compute_scale, c.for_gpu(SLOW).p2p_eta)
        for c in corners
    }
    assert seen == {(f, s, e) for f in (0.8, 1.5) for s in (1.6, 2.4) for e in (0.4, 0.7)}
    assert all(c.for_gpu(FAST).p2p_eta == c.for_gpu(SLOW).p2p_eta for c in corners)
    # the fixed cost per transfer moves with the efficiency, on one dimension: dear together
    fixed_at = {c.for_gpu(SLOW).p2p_eta: c.for_gpu(FAST).p2p_fixed_s for c in corners}
    assert fixed_at == {0.4: 8e-4, 0.7: 3e-4}
    # at an efficiency of 1 its range is empty, the fixed cost's is not: still a dimension
    at_one = [
        _ranged(FAST, "p2p_efficiency", 1.0, 1.0, 1.0),
        _ranged(FAST, "p2p_fixed_s", 2e-4, 1e-4, 3e-4),
    ]
    assert {c.for_gpu(FAST).p2p_fixed_s for c in range_corners(BASE, at_one)} == {1e-4, 3e-4}
    assert range_corners(BASE, [_ranged(FAST, "compute_scale", 1.0, 1.0, 1.0)]) == []


def test_a_plan_that_moves_work_between_kinds_can_lose_at_a_mixed_corner() -> None:
    """The running plan gives both kinds 8 units of work, the best one 11 to the fast kind and
    5 to the slow: it wins at the point estimate and at both uniform ends of the ranges, and
    loses where the fast kind is at its slowest and the slow one at its fastest. The rule bets
    on it only if it wins at every corner: range_corners includes that one, scale_ends not."""
    fitted = [
        _ranged(FAST, "compute_scale", 1.0, 0.8, 1.5),
        _ranged(SLOW, "compute_scale", 2.0, 1.6, 2.4),
    ]

    def gains(cals: list[Calibration]) -> list[float]:
        out = []
        for c in cals:
            kf, ks = c.for_gpu(FAST).compute_scale, c.for_gpu(SLOW).compute_scale
            running, best = max(8 * kf, 8 * ks), max(11 * kf, 5 * ks)
            out.append(1 - best / running)
        return out

    point = with_constant(with_constant(BASE, FAST, compute_scale=1.0), SLOW, compute_scale=2.0)
    assert gains([point])[0] > 0.3
    assert min(gains(scale_ends(point, fitted))) > 0  # the uniform ends would bet on it
    assert min(gains(range_corners(point, fitted))) < 0  # a mixed corner does not


def test_a_tied_embeddings_wait_is_not_read_as_fixed_sync_cost() -> None:
    """Three stages, the embedding on the first and the head on the last: the engine
    all-reduces the two copies after the segments, so the head's stage, done first in 1F1B,
    waits there for the first stage (its measured sync holds the pipeline's drain). The
    fixed cost comes from the middle stage and the first, which arrived last."""
    stages = (
        Stage(first_layer=0, last_layer=8, replica=_rg(SLOW, "n1")),
        Stage(first_layer=9, last_layer=17, replica=_rg(SLOW, "n2")),
        Stage(first_layer=18, last_layer=25, replica=_rg(FAST, "n3")),
    )
    plan = Plan(
        plan_id="pp3",
        model=MODEL.name,
        global_batch_size=32,
        pipelines=(Pipeline(stages=stages, microbatch_size=1, num_microbatches=32),),
    )
    truth = with_constant(BASE, SLOW, sync_fixed_s=0.01)
    truth = with_constant(truth, FAST, sync_fixed_s=0.01)
    timings = list(_timings(plan, truth))
    # what the engine measures on the head's stage: the wait for the first (0.4 s)
    timings[2] = timings[2].model_copy(update={"sync_s": timings[2].sync_s + 0.4})
    fit = _fit(plan, tuple(timings))
    slow = fit.constant(SLOW, "sync_fixed_s")
    fast = fit.constant(FAST, "sync_fixed_s")
    assert slow is not None and slow.fitted and slow.samples == 2
    assert slow.value == pytest.approx(0.01, rel=1e-6)
    assert fast is not None and not fast.fitted  # only the head's stage is of this kind
    assert fast.value == BASE.for_gpu(FAST).sync_fixed_s
    assert any("tied embedding" in n for n in fit.notes)


def test_the_fixed_cost_takes_in_the_rest_of_the_step_beyond_the_profiled_framework_time() -> None:
    """The engine's step outside pipeline, sync and optimizer (zeroing gradients, the loss
    all-reduce: ``rest_s``) is a fixed cost of each iteration; the framework time per
    iteration the profile holds is already in the simulator, so it is taken off."""
    from sailor.schemas.profile import FrameworkTime

    frame = FrameworkTime(gpu_type=SLOW, iteration_s=0.001, source="test")
    profiles = PROFILES.model_copy(update={"framework": (frame,)})
    plan = _pipeline_plan()
    truth = with_constant(BASE, SLOW, sync_fixed_s=0.01)
    timings = expected_rank_timings(
        plan, MODEL, profiles, NETWORK, PRICES, calibration=truth, gpu_specs=SPECS
    )
    timings = tuple(
        t.model_copy(update={"rest_s": 0.004, "sync_s": t.sync_s + (0.05 if t.rank else 0)})
        for t in timings
    )
    fit = fit_online(
        plan, timings, MODEL, profiles, NETWORK, PRICES, calibration=BASE, gpu_specs=SPECS
    )
    # the first stage arrived last at the tied all-reduce: its sync 0.01, rest 0.004, less 0.001
    assert _const(fit, SLOW, "sync_fixed_s") == pytest.approx(0.013, rel=1e-6)


def test_code_between_the_passes_is_compute_and_a_slow_optimizer_a_fixed_cost() -> None:
    """What the engine spends per microbatch outside its timed passes (data, loss: between_s)
    is pipeline compute, as the simulator's stage time holds it; an optimizer step slower
    than profiled (not fitted) is a fixed cost of the iteration."""
    plan = _dp_plan((SLOW,))
    truth = with_constant(BASE, SLOW, compute_scale=2.0, sync_fixed_s=0.0)
    (t,) = _timings(plan, truth)
    m = t.microbatches
    plain = _fit(plan, (t,))
    # the same total per microbatch, a tenth of it outside the timed passes
    share = 0.1 * (t.fwd_s + t.bwd_s)
    moved = t.model_copy(
        update={"fwd_s": t.fwd_s - share, "between_s": share * m, "optim_s": t.optim_s + 0.002}
    )
    fit = _fit(plan, (moved,))
    assert _const(fit, SLOW, "compute_scale") == pytest.approx(
        _const(plain, SLOW, "compute_scale"), rel=1e-6
    )
    assert _const(fit, SLOW, "sync_fixed_s") == pytest.approx(
        _const(plain, SLOW, "sync_fixed_s") + 0.002, rel=1e-6
    )


def test_a_fitted_kind_keeps_the_priors_ranges_of_what_the_fit_did_not_measure() -> None:
    """An uncalibrated kind (the catalog prior's ranges in the corners) fitted online: the
    corners the planner searches in take the fitted constants' ranges and, for what no step
    timing measures (memory, allocator, hook cost), the prior's ranges as before. Fails on
    the old code: the kind's new entry had no spread and every corner collapsed to the fitted
    point, the pessimistic non-tensor memory from the prior's high end to its median."""
    plan = _dp_plan((FAST, FAST))
    truth = with_constant(BASE, FAST, compute_scale=1.3, network_efficiency=0.3)
    fit = _fit(plan, _timings(plan, truth))
    eta = fit.constant(FAST, "network_efficiency")
    assert eta is not None and eta.fitted
    before = {name: c.for_gpu(FAST) for name, c in corners(BASE)}
    after = {name: c.for_gpu(FAST) for name, c in corners(fit.calibration)}
    for name in ("optimistic", "median", "pessimistic"):
        for field in ("memory_overhead_bytes", "alloc_factor", "profiler_overhead_s"):
            assert getattr(after[name], field) == getattr(before[name], field), (name, field)
        assert after[name].compute_scale == pytest.approx(1.3, rel=1e-6)
    assert after["median"].network_efficiency == eta.value
    assert after["optimistic"].network_efficiency == eta.high
    assert after["pessimistic"].network_efficiency == eta.low
    # the point calibration is the fit's, and a kind not running keeps no entry of its own
    assert fit.calibration.for_gpu(FAST).network_efficiency == eta.value
    assert not fit.calibration.is_calibrated(SLOW)


def test_a_kind_with_a_leave_one_out_spread_is_priced_at_its_fitted_constants() -> None:
    """A kind calibrated offline with a leave-one-out spread (GH-96: η 0.19-0.23) fitted
    online to another network: every corner the planner searches in takes the fitted η
    (its median corner the fitted value), the spread's other ranges stay. Fails on the old
    code: the entry kept the offline spread, which overrode the fitted η in every corner."""
    gh = "GH-96"
    plan = Plan(
        plan_id="gh",
        model=MODEL.name,
        global_batch_size=32,
        pipelines=tuple(
            Pipeline(
                stages=(Stage(first_layer=0, last_layer=25, replica=_rg(gh, f"n{i}")),),
                microbatch_size=1,
                num_microbatches=16,
            )
            for i in range(2)
        ),
    )
    assert BASE.for_gpu(gh).spread is not None
    truth = with_constant(BASE, gh, network_efficiency=0.6)
    fit = _fit(plan, _timings(plan, truth))
    eta = fit.constant(gh, "network_efficiency")
    assert eta is not None and eta.fitted and eta.value == pytest.approx(0.6, rel=0.02)
    before = {name: c.for_gpu(gh) for name, c in corners(BASE)}
    after = {name: c.for_gpu(gh) for name, c in corners(fit.calibration)}
    assert after["median"].network_efficiency == eta.value
    assert after["pessimistic"].network_efficiency == eta.low
    for name in ("optimistic", "median", "pessimistic"):
        assert after[name].memory_overhead_bytes == before[name].memory_overhead_bytes
    spread = fit.calibration.for_gpu(gh).spread
    assert spread is not None and spread.source.startswith("online fit")
    # a record kept before the fit carried its ranges (the offline spread, a prior-covered
    # kind's entry without one) is read back as the fit makes it today; the fit's own as is
    cal = fit.calibration
    old = cal.with_gpu(cal.for_gpu(gh).model_copy(update={"spread": BASE.for_gpu(gh).spread}))
    assert with_spread_restored(old, BASE, fit.constants) == (cal, [gh])
    bare = cal.with_gpu(cal.for_gpu(gh).model_copy(update={"spread": None}))
    assert with_spread_restored(bare, BASE, fit.constants) == (cal, [gh])
    assert with_spread_restored(cal, BASE, fit.constants) == (cal, [])
    # a second fit from the kept one names the source once, and keeps the first fit's range
    # of a constant it does not identify
    again = _fit(plan, _timings(plan, truth), fit.calibration)
    spread2 = again.calibration.for_gpu(gh).spread
    assert spread2 is not None and spread2.source.count("online fit") == 1


def test_a_fitted_p2p_efficiency_keeps_the_fixed_cost_it_was_fitted_with_in_the_corners() -> None:
    """Kinds the prior covers, under a default without a fixed cost per transfer: the fit
    moves the efficiency alone (the fixed cost stays 0, not fitted), and the corners pair the
    fitted efficiency with that 0, not with the prior's 0-1.7 ms it was not fitted beside."""
    base = AS_READ.model_copy(
        update={"default": AS_READ.default.model_copy(update={"p2p_fixed_s": 0})}
    )
    plan = _pipeline_plan()
    truth = base
    for g in (SLOW, FAST):
        truth = with_constant(truth, g, p2p_efficiency=0.3)
    fit = _fit(plan, _timings(plan, truth), base)
    eta = fit.constant(SLOW, "p2p_efficiency")
    assert eta is not None and eta.fitted
    for name, c in corners(fit.calibration):
        if name != "original":
            assert c.for_gpu(SLOW).p2p_fixed_s == 0.0, name
    median = dict(corners(fit.calibration))["median"].for_gpu(SLOW)
    assert median.p2p_efficiency == eta.value


def test_without_a_lone_rank_the_kept_fixed_cost_is_taken_from_the_same_sum() -> None:
    """Every rank all-reduces (no lone rank gives the sync's own fixed part): the kept c is
    taken from the last arriver's sync plus the rest of its step, as c is fitted (c = sync +
    rest + optimizer beyond its profile, of the ranks without an all-reduce). A real worker
    reports the rest (zeroing the gradients, here 1 s of the kept c's 1.0063 s) apart from its
    sync; subtracting the whole c from the sync alone left the all-reduces 1 s short and read
    η = 0.28 for a network at 0.2. Fails on the old code."""
    plan = _dp_plan((FAST, SLOW))
    rest = 1.0
    base = truth = BASE
    for g in (FAST, SLOW):
        c = BASE.for_gpu(g).sync_fixed_s + rest
        base = with_constant(base, g, sync_fixed_s=c)
        truth = with_constant(truth, g, sync_fixed_s=c, network_efficiency=0.2)
    timings = tuple(
        t.model_copy(update={"sync_s": t.sync_s - rest, "rest_s": t.rest_s + rest})
        for t in _timings(plan, truth)
    )
    fit = _fit(plan, timings, base)
    assert _const(fit, SLOW, "network_efficiency") == pytest.approx(0.2, rel=0.01)
    c = fit.constant(SLOW, "sync_fixed_s")
    assert c is not None and not c.fitted


def test_without_a_link_to_transport_from_the_sync_fit_runs_one_simulation_fewer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Efficiencies read on no link of their own (as read on every link) and no measured
    all-reduce of the plan's kinds: the all-reduces take their time at η = 1 over η, so the
    η fit needs no simulation at η = 1/2 (fit_sync._scales_as_read). The answer is the one
    that simulation gives (bit for bit), and the fit runs one simulation fewer. A measured
    all-reduce of these kinds elsewhere (another zone: none of this plan's rings) keeps the
    simulation, and a calibration read on GH200 links needs it. Fails on the old code: it
    ran the η = 1/2 simulation whatever the calibration (the same count both ways)."""
    plan = _dp_plan((FAST, SLOW))
    truth = with_constant(AS_READ, SLOW, compute_scale=1.5, network_efficiency=0.2)
    truth = with_constant(truth, FAST, network_efficiency=0.2)
    timings = _timings(plan, truth)
    runs: list[Calibration] = []
    real = online_fit.simulate

    def counted(*args: Any, **kwargs: Any) -> Estimate:
        runs.append(kwargs["calibration"])
        return real(*args, **kwargs)

    monkeypatch.setattr(online_fit, "simulate", counted)
    elsewhere = NetworkProfile(
        collectives=(
            CollectiveLatency(
                endpoint=Endpoint(zone="z-b-1", gpu_type=FAST, gpus_per_node=1),
                ranks=2,
                latency_s=1e-3,
                scope="inter_node",
            ),
        )
    )

    def fit(network: NetworkProfile, base: Calibration) -> tuple[OnlineFit, int]:
        runs.clear()
        out = fit_online(
            plan, timings, MODEL, PROFILES, network, PRICES, calibration=base, gpu_specs=SPECS
        )
        return out, len(runs)

    skipped, fewer = fit(NETWORK, AS_READ)
    full, more = fit(elsewhere, AS_READ)
    assert fewer == more - 1
    assert skipped == full
    assert _const(skipped, SLOW, "network_efficiency") == pytest.approx(0.2, rel=0.01)
    assert _const(skipped, FAST, "network_efficiency") == pytest.approx(0.2, rel=0.01)
    assert fit(NETWORK, BASE)[1] == more
