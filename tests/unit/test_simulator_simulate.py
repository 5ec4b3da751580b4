"""simulate(): time, memory and cost on small synthetic setups (unit + hypothesis)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sailor.schemas import (
    BandwidthCurve,
    Calibration,
    EgressPrice,
    Endpoint,
    Estimate,
    GPUCalibration,
    GPUPrice,
    GPUSpec,
    LayerProfile,
    LayerSize,
    Link,
    ModelSpec,
    NetworkProfile,
    Pipeline,
    Plan,
    PriceTable,
    ProfileDB,
    ReplicaGroup,
    Stage,
)
from sailor.schemas.precision import GRAD_ALLREDUCE_BYTES
from sailor.simulator import ProfileLookupError, simulate, simulate_with_timeline
from sailor.simulator.lookup import layer_table

MODEL = ModelSpec(
    name="tiny",
    num_layers=6,
    hidden_size=64,
    num_heads=4,
    ffn_hidden_size=256,
    seq_length=32,
    vocab_size=128,
    global_batch_size=16,
)
N = MODEL.num_all_layers
SPEC = GPUSpec(
    name="X",
    memory_bytes=16 << 30,
    peak_tflops_fp16=100,
    peak_tflops_bf16=100,
    peak_tflops_fp32=10,
    memory_bandwidth_gbps=1000,
    intra_node_link_gbps=100,
    intra_node_link="NVLink",
    default_gpus_per_node=4,
    source="test",
)
SPECS = {
    "A": SPEC.model_copy(update={"name": "A"}),
    "B": SPEC.model_copy(update={"name": "B"}),
    "E": SPEC.model_copy(update={"name": "E"}),
}


def _profiles() -> ProfileDB:
    timings = []
    for gpu, speed in (("A", 1.0), ("B", 2.0)):
        for tp in (1, 2):
            for mbs in (1, 2, 4):
                for layer in range(N):
                    f = 1e-3 * mbs * speed / tp
                    timings.append(
                        LayerProfile(
                            gpu_type=gpu,
                            tp=tp,
                            microbatch_size=mbs,
                            layer=layer,
                            kind=MODEL.layer_kind(layer),
                            fwd_s=f,
                            bwd_s=2 * f,
                            update_s=1e-4 * (layer + 1),
                            source="imported",
                        )
                    )
    sizes = [
        LayerSize(
            tp=tp,
            layer=layer,
            params=1_000_000 // tp,
            activation_bytes_per_sample=4_000_000 // tp,
            output_bytes_per_sample=100_000,
            source="imported",
        )
        for tp in (1, 2)
        for layer in range(N)
    ]
    return ProfileDB(model="tiny", timings=tuple(timings), sizes=tuple(sizes))


PROFILES = _profiles()


def _curve(gbps: float) -> BandwidthCurve:
    return BandwidthCurve(coeffs=(0.0, 0.0, gbps), max_gbps=gbps)


def _network(cross_gbps: float = 1.0) -> NetworkProfile:
    links = []
    for g1 in ("A", "B"):
        for g2 in ("A", "B"):
            for z1 in ("z-a", "z-b"):
                for z2 in ("z-a", "z-b"):
                    bw = 10.0 if z1 == z2 else cross_gbps
                    links.append(
                        Link(
                            src=Endpoint(zone=z1, gpu_type=g1, gpus_per_node=2),
                            dst=Endpoint(zone=z2, gpu_type=g2, gpus_per_node=2),
                            curve=_curve(bw),
                        )
                    )
    intra = [
        Link(
            src=Endpoint(zone="*", gpu_type=g, gpus_per_node=2),
            dst=Endpoint(zone="*", gpu_type=g, gpus_per_node=2),
            curve=_curve(50.0),
        )
        for g in ("A", "B")
    ]
    return NetworkProfile(links=tuple(links), intra_node=tuple(intra))


PRICES = PriceTable(
    gpus=(
        GPUPrice(gpu_type="A", region="z", on_demand_usd_per_hour=2.0, spot_usd_per_hour=1.0),
        GPUPrice(gpu_type="B", region="z", on_demand_usd_per_hour=1.0, spot_usd_per_hour=0.5),
        GPUPrice(gpu_type="E", region="z", on_demand_usd_per_hour=1.5, spot_usd_per_hour=0.5),
    ),
    egress=(EgressPrice(src="*", dst="*", usd_per_gb=0.01),),
)


def _rg(gpu: str = "A", zone: str = "z-a", tp: int = 1) -> ReplicaGroup:
    return ReplicaGroup(gpu_type=gpu, zone=zone, tp=tp, gpus_per_node=2)


def _pipe(cuts: list[int], mbs: int, m: int, groups: list[ReplicaGroup] | None = None) -> Pipeline:
    bounds = [0, *cuts, N]
    groups = groups or [_rg() for _ in range(len(bounds) - 1)]
    return Pipeline(
        stages=tuple(
            Stage(first_layer=a, last_layer=b - 1, replica=g)
            for a, b, g in zip(bounds[:-1], bounds[1:], groups, strict=True)
        ),
        microbatch_size=mbs,
        num_microbatches=m,
    )


def _plan(*pipes: Pipeline) -> Plan:
    return Plan(model="tiny", global_batch_size=sum(p.samples for p in pipes), pipelines=pipes)


def _sim(plan: Plan, **kw: object) -> object:
    return simulate(
        plan,
        MODEL,
        PROFILES,
        kw.pop("network", _network()),
        PRICES,  # type: ignore[arg-type]
        gpu_specs=SPECS,
        **kw,
    )  # type: ignore[arg-type]


def test_single_stage_matches_hand_computation() -> None:
    est = simulate(_plan(_pipe([], 1, 4)), MODEL, PROFILES, _network(), PRICES, gpu_specs=SPECS)
    per_mb = N * 3e-3
    update = sum(1e-4 * (i + 1) for i in range(N))  # per-layer update_s, summed
    assert est.iteration_time_s == pytest.approx(4 * per_mb + update, rel=1e-6)
    assert est.time.compute_s == pytest.approx(4 * per_mb)
    assert not est.uses_estimates


def test_cost_is_time_times_price_plus_egress() -> None:
    plan = _plan(
        _pipe([4], 2, 2, [_rg("A", "z-a"), _rg("B", "z-b", tp=2)]),
        _pipe([3], 2, 2, [_rg("B", "z-a"), _rg("A", "z-b")]),
    )
    est = simulate(plan, MODEL, PROFILES, _network(), PRICES, gpu_specs=SPECS)
    gpu_usd_h = 2.0 + 1.0 * 2 + 1.0 + 2.0
    assert est.compute_cost_usd == pytest.approx(est.iteration_time_s * gpu_usd_h / 3600)
    assert est.egress_cost_usd > 0
    assert est.cost_per_iter_usd == pytest.approx(est.compute_cost_usd + est.egress_cost_usd)
    spot = simulate(plan, MODEL, PROFILES, _network(), PRICES, gpu_specs=SPECS, spot=True)
    assert spot.compute_cost_usd < est.compute_cost_usd


def test_breakdown_adds_up_and_memory_has_every_stage() -> None:
    plan = _plan(_pipe([2, 5], 1, 4), _pipe([4], 2, 2, [_rg("B"), _rg("A", tp=2)]), _pipe([], 4, 1))
    for method in ("closed_form", "replay"):
        est = simulate(plan, MODEL, PROFILES, _network(), PRICES, gpu_specs=SPECS, method=method)  # type: ignore[arg-type]
        t = est.time
        total = t.compute_s + t.p2p_s + t.bubble_s + t.grad_sync_s + t.update_s
        assert total == pytest.approx(est.iteration_time_s, rel=1e-9)
        assert len(est.memory) == 3 + 2 + 1
        assert est.peak_memory_bytes == max(m.total for m in est.memory)
        assert est.model == method


def test_uniform_stages_closed_form_equals_replay() -> None:
    # no transfers: stage outputs of zero bytes and no attention mask
    # a fresh ProfileDB: model_copy would carry over the cached lookup index
    silent = ProfileDB(
        model="tiny",
        timings=PROFILES.timings,
        sizes=tuple(z.model_copy(update={"output_bytes_per_sample": 0}) for z in PROFILES.sizes),
    )
    cal = Calibration(sends_attention_mask=False)
    plan = _plan(_pipe([2, 4, 6], 1, 8), _pipe([2, 4, 6], 1, 8))
    a = simulate(plan, MODEL, silent, _network(), PRICES, calibration=cal)
    b = simulate(plan, MODEL, silent, _network(), PRICES, calibration=cal, method="replay")

    def pipe(e: Estimate) -> float:
        return e.time.compute_s + e.time.p2p_s + e.time.bubble_s

    assert pipe(a) == pytest.approx(pipe(b), rel=1e-9)
    # the replay lets the last stage start its gradient sync before the first finishes
    assert b.iteration_time_s <= a.iteration_time_s + 1e-12


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.integers(1, 12), st.integers(1, 6))
def test_more_microbatches_never_faster(depth: int, m: int, extra: int) -> None:
    cuts = [1 + i * (N - 1) // depth for i in range(1, depth)]
    base = simulate(_plan(_pipe(cuts, 2, m)), MODEL, PROFILES, _network(), PRICES)
    more = simulate(_plan(_pipe(cuts, 2, m + extra)), MODEL, PROFILES, _network(), PRICES)
    assert more.iteration_time_s >= base.iteration_time_s


@settings(max_examples=40, deadline=None)
@given(st.floats(0.05, 5.0), st.floats(0.01, 0.99))
def test_slower_cross_zone_link_never_faster(gbps: float, factor: float) -> None:
    plan = _plan(
        _pipe([4], 1, 4, [_rg("A", "z-a"), _rg("A", "z-b")]),
        _pipe([4], 1, 4, [_rg("A", "z-b"), _rg("A", "z-a")]),
    )
    fast = simulate(plan, MODEL, PROFILES, _network(gbps), PRICES, method="replay")
    slow = simulate(plan, MODEL, PROFILES, _network(gbps * factor), PRICES, method="replay")
    assert slow.iteration_time_s >= fast.iteration_time_s


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 7), st.integers(1, 3))
def test_memory_monotone_in_microbatch_size(mbs: int, depth: int) -> None:
    cuts = [1 + i * (N - 1) // depth for i in range(1, depth)]
    a = simulate(_plan(_pipe(cuts, mbs, 4)), MODEL, PROFILES, _network(), PRICES)
    b = simulate(_plan(_pipe(cuts, mbs + 1, 4)), MODEL, PROFILES, _network(), PRICES)
    assert b.peak_memory_bytes > a.peak_memory_bytes


def test_memory_breakdown_mixed_precision_adam() -> None:
    # DeepSpeed's FP16_Optimizer: 16-bit weights and gradients, an fp32 master copy
    cal = Calibration(mixed_precision="fp16_optimizer")
    est = simulate(_plan(_pipe([], 1, 1)), MODEL, PROFILES, _network(), PRICES, calibration=cal)
    m = est.memory[0]
    params = N * 1_000_000
    assert (m.weights, m.gradients, m.optimizer) == (6 * params, 2 * params, 8 * params)
    assert m.weight_copies == 0
    assert m.total == m.weights + m.gradients + m.optimizer + m.activations + m.overhead


def test_memory_breakdown_autocast_adam() -> None:
    # the engine: fp32 weights, gradients and moments; one 16-bit weight copy per microbatch
    # in flight (here 1 stage, so 1) of every layer but the embedding (its lookup reads the
    # fp32 table)
    est = simulate(_plan(_pipe([], 1, 1)), MODEL, PROFILES, _network(), PRICES)
    m = est.memory[0]
    params = N * 1_000_000
    assert (m.weights, m.gradients, m.optimizer) == (4 * params, 4 * params, 8 * params)
    assert m.weight_copies == 2 * (params - 1_000_000)
    assert m.total == (
        m.weights + m.gradients + m.optimizer + m.activations + m.weight_copies + m.overhead
    )


def test_first_stage_holds_more_microbatches() -> None:
    est = simulate(_plan(_pipe([4], 1, 8)), MODEL, PROFILES, _network(), PRICES)
    s0, s1 = est.memory
    assert s0.activations > s1.activations


def test_interpolation_and_extrapolation_in_mbs() -> None:
    cal = GPUCalibration(gpu_type="A")
    t3 = layer_table(PROFILES, MODEL, cal, {}, "A", 1, 3).layers[2]
    assert t3.fwd_s == pytest.approx(3e-3)
    t8 = layer_table(PROFILES, MODEL, cal, {}, "A", 1, 8).layers[2]
    assert t8.fwd_s == pytest.approx(8e-3)
    assert not t8.estimated


def test_unprofiled_gpu_uses_estimate_and_says_so() -> None:
    plan = _plan(_pipe([4], 1, 4, [_rg("A"), _rg("E")]))
    est = simulate(plan, MODEL, PROFILES, _network(), PRICES, gpu_specs=SPECS)
    assert est.uses_estimates
    assert any("analytic roofline" in n for n in est.notes)
    with pytest.raises(ProfileLookupError):
        simulate(plan, MODEL, PROFILES, _network(), PRICES)


def test_unprofiled_tp_scaled_from_nearest() -> None:
    plan = _plan(_pipe([], 1, 2, [ReplicaGroup(gpu_type="A", zone="z-a", tp=4, gpus_per_node=4)]))
    est = simulate(plan, MODEL, PROFILES, _network(), PRICES, gpu_specs=SPECS)
    assert est.uses_estimates
    assert any("TP degree not profiled" in n for n in est.notes)


def test_missing_link_falls_back_conservatively_with_note() -> None:
    plan = _plan(_pipe([4], 1, 4, [_rg("A", "z-a"), _rg("A", "far-away-1")]))
    est = simulate(plan, MODEL, PROFILES, _network(), PRICES)
    assert any("conservative" in n for n in est.notes)
    near = simulate(
        _plan(_pipe([4], 1, 4, [_rg("A", "z-a"), _rg("A", "z-b")])),
        MODEL,
        PROFILES,
        _network(),
        PRICES,
    )
    assert est.iteration_time_s > near.iteration_time_s


def test_calibration_constants_enter() -> None:
    plan = _plan(_pipe([], 1, 4), _pipe([], 1, 4))
    base = simulate(plan, MODEL, PROFILES, _network(), PRICES)
    cal = Calibration(
        gpus=(
            GPUCalibration(
                gpu_type="A",
                sync_fixed_s=0.5,
                network_efficiency=0.5,
                alloc_factor=1.5,
                memory_overhead_bytes=0,
            ),
        )
    )
    tuned = simulate(plan, MODEL, PROFILES, _network(), PRICES, calibration=cal)
    assert tuned.iteration_time_s > base.iteration_time_s + 0.5
    assert tuned.stages[0].grad_sync_s == pytest.approx(2 * base.stages[0].grad_sync_s)
    assert tuned.memory[0].activations == int(1.5 * base.memory[0].activations) or (
        abs(tuned.memory[0].activations - 1.5 * base.memory[0].activations) <= 1
    )


def test_layer_count_mismatch_is_rejected() -> None:
    other = MODEL.model_copy(update={"num_layers": 3})
    with pytest.raises(ValueError, match="num_layers"):
        simulate(_plan(_pipe([], 1, 1)), other, PROFILES, _network(), PRICES)


def test_timeline_and_plot(tmp_path: Path) -> None:
    from sailor.simulator.timeline_plot import plot_timeline

    plan = _plan(_pipe([3], 1, 4), _pipe([2, 5], 2, 2, [_rg("B"), _rg("A"), _rg("B")]))
    est, tl = simulate_with_timeline(plan, MODEL, PROFILES, _network(), PRICES)
    assert len(tl.ops) == 2 * (2 * 4) + 2 * (3 * 2)
    assert tl.iteration_time_s == est.iteration_time_s
    assert max(op.end_s for op in tl.ops) <= est.iteration_time_s
    out = plot_timeline(tl, tmp_path / "t.png")
    assert out.stat().st_size > 1000


def _with_framework(it: float, mb: float, sample: float) -> ProfileDB:
    from sailor.schemas.profile import FrameworkTime

    ft = FrameworkTime(
        gpu_type="A", iteration_s=it, microbatch_s=mb, sample_s=sample, source="test"
    )
    return ProfileDB(model="tiny", timings=PROFILES.timings, sizes=PROFILES.sizes, framework=(ft,))


def test_framework_time_single_stage_by_hand() -> None:
    it, mb, sample = 2e-3, 0.5e-3, 0.1e-3
    db = _with_framework(it, mb, sample)
    plan = _plan(_pipe([], 2, 4))
    base = simulate(plan, MODEL, PROFILES, _network(), PRICES, gpu_specs=SPECS)
    for method in ("closed_form", "replay"):
        est = simulate(plan, MODEL, db, _network(), PRICES, gpu_specs=SPECS, method=method)  # type: ignore[arg-type]
        # one stage reads the data once per microbatch: m (mb + b·sample) + iteration
        extra = 4 * (mb + 2 * sample) + it
        assert est.iteration_time_s == pytest.approx(base.iteration_time_s + extra, rel=1e-9)


def test_framework_time_absent_changes_nothing_and_data_read_by_first_and_last() -> None:
    plan = _plan(_pipe([2, 4], 1, 6))
    zero = simulate(plan, MODEL, _with_framework(0.0, 0.0, 0.0), _network(), PRICES)
    base = simulate(plan, MODEL, PROFILES, _network(), PRICES)
    assert zero.iteration_time_s == base.iteration_time_s
    est = simulate(plan, MODEL, _with_framework(0.0, 0.0, 1e-3), _network(), PRICES)
    fwd = [s.fwd_s - b.fwd_s for s, b in zip(est.stages, base.stages, strict=True)]
    assert fwd == pytest.approx([1e-3, 0.0, 1e-3])


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 4),
    st.integers(1, 10),
    st.floats(0, 5e-3),
    st.floats(0, 5e-3),
    st.booleans(),
)
def test_new_terms_keep_the_closed_form_replay_bounds(
    depth: int, m: int, mb: float, it: float, blocking: bool
) -> None:
    cuts = [1 + i * (N - 1) // depth for i in range(1, depth)]
    plan = _plan(_pipe(cuts, 2, m))
    db = _with_framework(it, mb, mb / 10)
    net = _network()
    cal = Calibration(blocking_p2p=blocking, tied_allreduce=True, loss_allreduce=True)
    cf = simulate(plan, MODEL, db, net, PRICES, calibration=cal)
    rp = simulate(plan, MODEL, db, net, PRICES, calibration=cal, method="replay")
    # the post-pipeline terms are the same for both; the pipeline part keeps its relations
    assert rp.iteration_time_s <= 1.3 * cf.iteration_time_s + 1e-12
    assert cf.iteration_time_s <= 2.0 * rp.iteration_time_s + 2 * m * sum(
        s.send_s for s in rp.stages
    )
    if depth == 1:
        assert cf.iteration_time_s == pytest.approx(rp.iteration_time_s, rel=1e-9)


def test_async_sends_are_link_delays() -> None:
    from sailor.simulator.pipeline import replay_1f1b

    plan = _plan(_pipe([3], 1, 4))
    slow = _network(cross_gbps=1.0)
    blocking = simulate(plan, MODEL, PROFILES, slow, PRICES, method="replay")
    cal = Calibration(blocking_p2p=False)
    est = simulate(plan, MODEL, PROFILES, slow, PRICES, calibration=cal, method="replay")
    s0, s1 = est.stages
    f = [s0.fwd_s, s1.fwd_s]
    b = [s0.bwd_s, s1.bwd_s]
    run = replay_1f1b(f, b, 4, [s0.send_s])
    assert est.time.compute_s + est.time.p2p_s + est.time.bubble_s == pytest.approx(run.end_s)
    assert est.iteration_time_s < blocking.iteration_time_s  # only the receiver waits


def test_tied_and_loss_allreduce_only_when_asked() -> None:
    from sailor.schemas.network import BandwidthCurve as Curve

    tied_model = MODEL.model_copy(update={"tie_embeddings": True})
    lat = 1e-3
    net = NetworkProfile(
        links=tuple(
            ln.model_copy(update={"curve": Curve(coeffs=(0, 0, 1e3), max_gbps=1e3, latency_s=lat)})
            for ln in _network().links
        ),
        intra_node=_network().intra_node,
    )
    plan = _plan(_pipe([3], 1, 4))  # embedding and head on different stages
    base = simulate(plan, tied_model, PROFILES, net, PRICES)
    both = Calibration(tied_allreduce=True, loss_allreduce=True)
    est = simulate(plan, tied_model, PROFILES, net, PRICES, calibration=both)
    # each a 2-member ring: 2 steps of (latency + bytes / bandwidth)
    # the engine all-reduces the fp32 gradient of the tied matrix
    tied_bytes = 128 * 64 * GRAD_ALLREDUCE_BYTES / 2
    expect = 2 * (lat + tied_bytes / 1e12) + 2 * (lat + 8 / 2 / 1e12)
    assert est.iteration_time_s - base.iteration_time_s == pytest.approx(expect, rel=1e-6)
    one_stage = _plan(_pipe([], 1, 4))  # one stage holds both copies: no tied collective
    a = simulate(one_stage, tied_model, PROFILES, net, PRICES)
    b = simulate(one_stage, tied_model, PROFILES, net, PRICES, calibration=both)
    assert b.iteration_time_s == pytest.approx(a.iteration_time_s)  # one rank: no ring


def test_measured_allreduce_latency_replaces_per_step_latency() -> None:
    from sailor.schemas.calibration import LinkEta
    from sailor.schemas.network import CollectiveLatency
    from sailor.simulator.network_model import ring_allreduce

    ep = Endpoint(zone="z-a", gpu_type="A", gpus_per_node=2)
    curve = BandwidthCurve(coeffs=(0, 0, 1.0), max_gbps=1.0, latency_s=2e-3)
    link = Link(src=ep, dst=ep, curve=curve)
    plain = NetworkProfile(links=(link,))
    # one rank per node, as the ring of two groups on nodes of their own
    coll = CollectiveLatency(endpoint=ep, ranks=2, latency_s=0.5e-3, scope="inter_node")
    measured = plain.model_copy(update={"collectives": (coll,)})
    assert measured.collective_latency(ep, 2, "inter_node") == pytest.approx(0.5e-3)
    # 3x the ring steps
    assert measured.collective_latency(ep, 4, "inter_node") == pytest.approx(1.5e-3)
    assert plain.collective_latency(ep, 2, "inter_node") is None
    groups = [_rg(), _rg()]
    nbytes = 1e6
    # per-step p2p latency: 2 steps of (2 ms + 0.5 MB at 1 GB/s)
    assert ring_allreduce(plain, groups, nbytes, 1e6, LinkEta.as_read(1.0)).time_s == pytest.approx(
        2 * (2e-3 + 0.5e-3)
    )
    # measured: the all-reduce latency once, plus the steps' bandwidth time
    assert ring_allreduce(
        measured, groups, nbytes, 1e6, LinkEta.as_read(1.0)
    ).time_s == pytest.approx(0.5e-3 + 2 * 0.5e-3)
    # a ring over two endpoint kinds has no measurement: per-step latency again
    mixed = [_rg(), _rg(gpu="B")]
    both = measured.model_copy(
        update={
            "links": (link, Link(src=ep, dst=ep.model_copy(update={"gpu_type": "B"}), curve=curve))
        }
    )
    assert ring_allreduce(both, mixed, nbytes, 1e6, LinkEta.as_read(1.0)).time_s == pytest.approx(
        2 * 2.5e-3
    )
    # with the backend's bus bandwidth measured, the bytes move at it: 2(n-1)/n * B / bus
    fast = coll.model_copy(update={"bus_gbps": 0.25, "max_bytes": 4 << 20})
    busy = plain.model_copy(update={"collectives": (fast,)})
    assert busy.collective_bus_gbps(ep, 2, "inter_node") == 0.25
    assert measured.collective_bus_gbps(ep, 2, "inter_node") is None
    assert ring_allreduce(busy, groups, nbytes, 1e6, LinkEta.as_read(1.0)).time_s == pytest.approx(
        0.5e-3 + 2 * 1 / 2 * nbytes / 0.25e9
    )
    # ... and the calibration's network efficiency still derates it
    assert ring_allreduce(busy, groups, nbytes, 1e6, LinkEta.as_read(0.5)).time_s == pytest.approx(
        0.5e-3 + 2 * nbytes / 0.25e9
    )


def test_bus_bandwidth_fit() -> None:
    from sailor.profiler.collective_probe import bus_gbps

    lat = 1e-4
    # 4 ranks at 2 GB/s bus: t = lat + 1.5 * B / 2e9
    pts = [(b, lat + 1.5 * b / 2e9) for b in (1 << 18, 1 << 22)]
    assert bus_gbps(4, lat, pts) == pytest.approx(2.0)
    assert bus_gbps(2, lat, [(1 << 20, lat / 2)]) is None  # nothing above the latency


def test_compute_scale_multiplies_layer_compute_and_nothing_else() -> None:
    one = layer_table(PROFILES, MODEL, GPUCalibration(gpu_type="B"), SPECS, "B", 1, 2)
    two = layer_table(
        PROFILES, MODEL, GPUCalibration(gpu_type="B", compute_scale=2.0), SPECS, "B", 1, 2
    )
    for a, b in zip(one.layers, two.layers, strict=True):
        assert (b.fwd_s, b.bwd_s, b.update_s) == pytest.approx(
            (2 * a.fwd_s, 2 * a.bwd_s, a.update_s)
        )
    # on a single stage it doubles exactly the compute of the iteration
    single = _plan(_pipe([], 1, 4))
    scaled = Calibration(gpus=(GPUCalibration(gpu_type="A", compute_scale=2.0),))
    est = _sim(single, calibration=scaled)
    assert est.iteration_time_s == pytest.approx(  # type: ignore[attr-defined]
        4 * 2 * N * 3e-3 + sum(1e-4 * (i + 1) for i in range(N)), rel=1e-6
    )
    # a mixed plan: only B's stages compute twice as long; transfers, sync, updates, memory
    # and A's stages are untouched
    plan = _plan(
        _pipe([4], 2, 2, [_rg("A", "z-a"), _rg("B", "z-b", tp=2)]),
        _pipe([3], 2, 2, [_rg("B", "z-a"), _rg("A", "z-b")]),
    )
    base = _sim(plan)
    slow_b = _sim(
        plan, calibration=Calibration(gpus=(GPUCalibration(gpu_type="B", compute_scale=2.0),))
    )
    kinds = {
        (pi, si): p.stages[si].replica.gpu_type
        for pi, p in enumerate(plan.pipelines)
        for si in range(p.depth)
    }
    for s0, s1 in zip(base.stages, slow_b.stages, strict=True):  # type: ignore[attr-defined]
        k = 2.0 if kinds[(s0.pipeline, s0.stage)] == "B" else 1.0
        assert s1.fwd_s == pytest.approx(k * s0.fwd_s) and s1.bwd_s == pytest.approx(k * s0.bwd_s)
        assert (s1.send_s, s1.update_s, s1.grad_sync_s) == pytest.approx(
            (s0.send_s, s0.update_s, s0.grad_sync_s)
        )
    assert slow_b.memory == base.memory  # type: ignore[attr-defined]
    assert slow_b.iteration_time_s > base.iteration_time_s  # type: ignore[attr-defined]


def test_uncertainty_corners_keep_a_measured_compute_scale() -> None:
    from sailor.simulator.uncertainty import corners

    cal = Calibration(gpus=(GPUCalibration(gpu_type="B", compute_scale=2.5),))
    assert [c.for_gpu("B").compute_scale for _, c in corners(cal)] == [2.5] * 4


@pytest.mark.parametrize("method", ["closed_form", "replay"])
def test_a_fixed_cost_per_transfer_is_charged_per_boundary_and_microbatch(method: str) -> None:
    """``p2p_fixed_s`` adds the same seconds to every transfer, each direction: a
    single-stage plan pays nothing, a pipelined one pays in proportion to it, and at the
    p2p efficiency its bytes are unchanged."""
    from sailor.schemas import GPUCalibration

    def t(plan: Plan, fixed: float) -> float:
        cal = Calibration().with_gpu(GPUCalibration(gpu_type="A", p2p_fixed_s=fixed))
        est = simulate(
            plan,
            MODEL,
            PROFILES,
            _network(),
            PRICES,
            calibration=cal,
            gpu_specs=SPECS,
            method=method,  # type: ignore[arg-type]
        )
        return est.iteration_time_s

    single = _plan(_pipe([], 2, 8))
    assert t(single, 5e-3) == t(single, 0.0)
    piped = _plan(_pipe([3, 6], 2, 8))
    d1, d2 = t(piped, 1e-3) - t(piped, 0.0), t(piped, 2e-3) - t(piped, 0.0)
    # 3 stages, 8 microbatches: at least every microbatch's two transfers of the middle stage
    # forward and back lie on the critical path
    assert d1 >= 8 * 4 * 1e-3 - 1e-9
    assert d2 == pytest.approx(2 * d1, rel=1e-6)


def test_a_gradient_ring_over_a_guessed_link_is_flagged() -> None:
    """Two single-stage replicas in zones the network profile has no link between: their
    gradient all-reduce runs over a flat guess by distance, and the estimate says it rests
    on a guess (as a pipeline transfer over one does)."""
    plan = _plan(_pipe([], 2, 4), _pipe([], 2, 4, [_rg(zone="z-c")]))
    est = simulate(plan, MODEL, PROFILES, _network(), PRICES, gpu_specs=SPECS)
    assert any(n.startswith("no link") for n in est.notes)
    assert est.uses_estimates
    measured = _plan(_pipe([], 2, 4), _pipe([], 2, 4, [_rg(zone="z-b")]))
    est = simulate(measured, MODEL, PROFILES, _network(), PRICES, gpu_specs=SPECS)
    assert not any(n.startswith("no link") for n in est.notes)
    assert not est.uses_estimates


@pytest.mark.parametrize(("source", "corrected"), [("imported", True), ("measured", False)])
def test_the_hook_correction_is_for_imported_profiles(source: str, corrected: bool) -> None:
    """A latency-bound layer (the same time at every microbatch size) loses the imported
    profiler's hook cost ``h``; Sailor's own profile (``measured``: CUDA events, no per-layer
    hook) keeps its time."""
    from sailor.schemas import GPUCalibration

    flat = ProfileDB(
        model="tiny",
        timings=tuple(
            t.model_copy(update={"fwd_s": 1e-3, "bwd_s": 2e-3, "source": source})
            for t in PROFILES.timings
            if t.gpu_type == "A" and t.tp == 1
        ),
        sizes=PROFILES.sizes,
    )
    cal = GPUCalibration(gpu_type="A", profiler_overhead_s=5e-4)
    table = layer_table(flat, MODEL, cal, SPECS, "A", 1, 1)
    block = table.layers[1]
    total = block.fwd_s + block.bwd_s
    assert total == pytest.approx(3e-3 - 5e-4 if corrected else 3e-3)


def test_recompute_adds_each_blocks_forward_to_its_backward() -> None:
    """The engine recomputes each block's forward in its backward (not the embedding's or
    the head's): a stage with recompute takes that much longer per microbatch."""

    def plan(recompute: bool) -> Plan:
        stage = Stage(
            first_layer=0,
            last_layer=N - 1,
            replica=ReplicaGroup(gpu_type="A", zone="z-a", tp=1, gpus_per_node=4),
            recompute=recompute,
        )
        pipe = Pipeline(stages=(stage,), microbatch_size=1, num_microbatches=4)
        return Plan(model="tiny", global_batch_size=4, pipelines=(pipe,))

    def time(p: Plan) -> float:
        est = simulate(p, MODEL, PROFILES, _network(), PRICES, gpu_specs=SPECS)
        return est.iteration_time_s

    table = layer_table(PROFILES, MODEL, Calibration().for_gpu("A"), SPECS, "A", 1, 1)
    blocks = sum(c.fwd_s for c in table.layers[1:-1])
    assert time(plan(True)) - time(plan(False)) == pytest.approx(4 * blocks, rel=1e-9)


def _one_stage_at_tp2(vocab_parallel: bool, mbs: int, microbatches: int) -> Estimate:
    """The whole model as one TP-2 stage on GPU type A, with or without a vocab-parallel
    head (4 samples per iteration)."""
    rg = ReplicaGroup(gpu_type="A", zone="z-a", tp=2, gpus_per_node=4)
    stage = Stage(first_layer=0, last_layer=N - 1, replica=rg)
    pipe = Pipeline(stages=(stage,), microbatch_size=mbs, num_microbatches=microbatches)
    plan = Plan(model="tiny", global_batch_size=4, pipelines=(pipe,))
    cal = Calibration(vocab_parallel=vocab_parallel)
    return simulate(plan, MODEL, PROFILES, _network(), PRICES, calibration=cal, gpu_specs=SPECS)


def test_sailors_engine_holds_the_embedding_and_head_whole_on_each_tp_rank() -> None:
    """Without a vocab-parallel head (Sailor's engine) the embedding's and head's sizes at
    TP 2 are their TP 1 sizes (imported ones split them, as Megatron does), blocks keep
    theirs, and a stage ending with the head holds twice the head's kept bytes in its first
    backward (the logits' and the log-softmax's gradients beside the log-probabilities)."""
    from sailor.simulator.lookup import layer_sizes
    from sailor.simulator.memory import backward_working_set

    split, _ = layer_sizes(PROFILES, MODEL, 2, vocab_parallel=True)
    whole, _ = layer_sizes(PROFILES, MODEL, 2, vocab_parallel=False)
    one, _ = layer_sizes(PROFILES, MODEL, 1, vocab_parallel=True)
    for layer in (0, N - 1):
        assert whole[layer].params == one[layer].params == 2 * split[layer].params
        assert whole[layer].tp == 2
    assert whole[1:-1] == split[1:-1]
    head = whole[-1]
    assert backward_working_set(MODEL, head, False) == 2 * head.activation_bytes_per_sample
    assert backward_working_set(MODEL, head, True) == head.activation_bytes_per_sample
    assert backward_working_set(MODEL, whole[1], False) == whole[1].activation_bytes_per_sample

    def peak(vocab_parallel: bool) -> int:
        return _one_stage_at_tp2(vocab_parallel, mbs=1, microbatches=4).peak_memory_bytes

    assert peak(False) > peak(True)


def test_a_measured_size_at_tp_is_already_whole() -> None:
    """Sailor's own profiler measures its engine: a ``measured`` head size at TP 2 is kept."""
    from sailor.simulator.lookup import layer_sizes

    mine = PROFILES.sizes[-1].model_copy(update={"tp": 2, "source": "measured", "params": 7})
    db = ProfileDB(
        model="tiny",
        timings=PROFILES.timings,
        sizes=(
            *tuple(s for s in PROFILES.sizes if not (s.tp == 2 and s.layer == mine.layer)),
            mine,
        ),
    )
    whole, _ = layer_sizes(db, MODEL, 2, vocab_parallel=False)
    assert whole[mine.layer] == mine
    # measured since the engine split them (the TP-2 stamp): split, so taken at TP 1
    stamped = db.model_copy(update={"meta": {"A.tp2.vocab_parallel": "true"}})
    one, _ = layer_sizes(stamped, MODEL, 1)
    again, _ = layer_sizes(stamped, MODEL, 2, vocab_parallel=False)
    assert again[mine.layer] == one[mine.layer].model_copy(update={"tp": 2})


def test_sailors_engine_computes_the_embedding_and_head_whole_on_each_tp_rank() -> None:
    """Without a vocab-parallel head every TP rank runs the whole embedding and head: their
    time at TP 2 is their TP 1 time (the imported TP 2 timings are Megatron's split head),
    blocks keep their TP 2 time, and a head timed at TP 2 by Sailor's own profiler is kept.
    Before, the head was priced split, about TP times too cheap."""
    cal = Calibration().for_gpu("A")
    split = layer_table(PROFILES, MODEL, cal, SPECS, "A", 2, 2, vocab_parallel=True)
    whole = layer_table(PROFILES, MODEL, cal, SPECS, "A", 2, 2, vocab_parallel=False)
    one = layer_table(PROFILES, MODEL, cal, SPECS, "A", 1, 2)
    for layer in (0, N - 1):
        assert whole.layers[layer] == one.layers[layer]
        assert whole.layers[layer].fwd_s == pytest.approx(2 * split.layers[layer].fwd_s)
    assert whole.layers[1:-1] == split.layers[1:-1]
    assert any("timed at tp=1" in n for n in whole.notes)
    # TP 1 has nothing to take whole
    assert layer_table(PROFILES, MODEL, cal, SPECS, "A", 1, 2, vocab_parallel=False) == one

    mine = [
        t.model_copy(update={"source": "measured", "fwd_s": 5e-3})
        if (t.gpu_type, t.tp, t.layer) == ("A", 2, N - 1)
        else t
        for t in PROFILES.timings
    ]
    db = ProfileDB(model="tiny", timings=tuple(mine), sizes=PROFILES.sizes)
    kept = layer_table(db, MODEL, cal, SPECS, "A", 2, 4, vocab_parallel=False)
    assert kept.layers[-1].fwd_s == pytest.approx(5e-3)  # measured at mbs 4, whole already
    assert kept.layers[0] == layer_table(db, MODEL, cal, SPECS, "A", 1, 4).layers[0]
    # measured with the vocabulary split (stamped): a split head, timed at TP 1 here
    stamped = db.model_copy(update={"meta": {"A.tp2.vocab_parallel": "true"}})
    again = layer_table(stamped, MODEL, cal, SPECS, "A", 2, 4, vocab_parallel=False)
    assert again.layers[-1] == layer_table(stamped, MODEL, cal, SPECS, "A", 1, 4).layers[-1]

    def time(vocab_parallel: bool) -> float:
        return _one_stage_at_tp2(vocab_parallel, mbs=2, microbatches=2).iteration_time_s

    heads = sum(
        w.fwd_s + w.bwd_s - s.fwd_s - s.bwd_s
        for w, s in zip(whole.layers, split.layers, strict=True)
    )
    assert time(False) - time(True) == pytest.approx(2 * heads, rel=1e-6)


def _only_at_tp2(source: str) -> ProfileDB:
    return ProfileDB(
        model="tiny",
        timings=tuple(
            t.model_copy(update={"source": source})
            for t in PROFILES.timings
            if t.gpu_type == "A" and t.tp == 2
        ),
        sizes=PROFILES.sizes,
    )


def test_a_head_measured_whole_at_another_tp_is_not_scaled_again() -> None:
    """Sailor's profiler timed the whole head at TP 2 only: at TP 4 the head costs that time,
    not the TP 1 time the estimate's split-head ratio would make of it (twice as much)."""
    db = _only_at_tp2("measured")
    cal = Calibration().for_gpu("A")
    at2 = layer_table(db, MODEL, cal, SPECS, "A", 2, 2, vocab_parallel=False)
    at4 = layer_table(db, MODEL, cal, SPECS, "A", 4, 2, vocab_parallel=False)
    for layer in (0, N - 1):
        assert at4.layers[layer].fwd_s == pytest.approx(at2.layers[layer].fwd_s)
        assert at4.layers[layer].bwd_s == pytest.approx(at2.layers[layer].bwd_s)
    assert any("as measured at tp=2" in n for n in at4.notes)


def test_a_split_head_without_tp1_or_spec_is_priced_tp_times_its_split_time() -> None:
    """Imported (split) timings at TP 2 only and no spec sheet: nothing prices TP 1, so the
    whole head is its split time times 2, marked estimated; before, the layer table raised
    and the planner dropped the GPU type at TP > 1."""
    db = _only_at_tp2("imported")
    cal = Calibration().for_gpu("A")
    split = layer_table(db, MODEL, cal, {}, "A", 2, 2, vocab_parallel=True)
    whole = layer_table(db, MODEL, cal, {}, "A", 2, 2, vocab_parallel=False)
    assert whole.layers[-1].fwd_s == pytest.approx(2 * split.layers[-1].fwd_s)
    assert whole.layers[-1].estimated and not whole.layers[1].estimated
    assert whole.layers[1] == split.layers[1]
    assert any("nothing prices tp=1" in n for n in whole.notes)


def test_estimated_entries_of_an_unprofiled_gpu_are_read() -> None:
    """``sailor profile estimate`` writes estimated entries for a GPU not at hand: they are
    what the simulator prices it with (before, they were skipped for the plain roofline,
    which the leave-one-GPU-out check finds worse), marked estimated."""
    est = tuple(
        t.model_copy(update={"gpu_type": "E", "source": "estimated", "fwd_s": 7e-3 * t.tp})
        for t in PROFILES.timings
        if t.gpu_type == "A" and t.tp == 1
    )
    db = ProfileDB(model="tiny", timings=PROFILES.timings + est, sizes=PROFILES.sizes)
    cal = Calibration().for_gpu("E")
    table = layer_table(db, MODEL, cal, SPECS, "E", 1, 2)
    assert table.layers[2].fwd_s == pytest.approx(7e-3)
    assert table.estimated
    roofline = layer_table(PROFILES, MODEL, cal, SPECS, "E", 1, 2)
    assert roofline.layers[2].fwd_s != pytest.approx(7e-3)
    # beside a measured or imported entry of the same type they are not read
    mixed = tuple(t.model_copy(update={"gpu_type": "A"}) for t in est if t.microbatch_size == 4)
    db2 = ProfileDB(
        model="tiny",
        timings=tuple(t for t in PROFILES.timings if t.microbatch_size != 4) + mixed,
        sizes=PROFILES.sizes,
    )
    assert layer_table(db2, MODEL, Calibration().for_gpu("A"), SPECS, "A", 1, 4).layers[
        2
    ].fwd_s == pytest.approx(4e-3)


def test_compute_only_estimated_entries_get_the_tp_all_reduces_of_the_plans_link() -> None:
    """Entries ``sailor profile estimate`` stamps compute-only get their TP all-reduces added
    over the link the lookup is given, after ``compute_scale`` (a link's time, not compute),
    at the calibration's link efficiency; unstamped (older) estimated entries are read as
    they are."""
    from sailor.schemas.profile import COMPUTE_ONLY_META
    from sailor.simulator.tp_comm import layer_comm_s, tp_link

    est = tuple(
        t.model_copy(update={"gpu_type": "E", "source": "estimated"})
        for t in PROFILES.timings
        if t.gpu_type == "A" and t.tp == 2
    )
    old = ProfileDB(model="tiny", timings=PROFILES.timings + est, sizes=PROFILES.sizes)
    new = old.model_copy(update={"meta": {f"E.{COMPUTE_ONLY_META}": "x"}})
    cal = Calibration().for_gpu("E").model_copy(update={"compute_scale": 2.0})
    mbs = est[0].microbatch_size
    entry = next(t.fwd_s for t in est if t.layer == 2 and t.microbatch_size == mbs)
    assert layer_table(old, MODEL, cal, SPECS, "E", 2, mbs).layers[2].fwd_s == pytest.approx(
        2.0 * entry
    )
    got = layer_table(new, MODEL, cal, SPECS, "E", 2, mbs)
    link = tp_link(None, SPECS, "E", 2, cal.tp_link_efficiency)
    comm = layer_comm_s(MODEL, 2, mbs, 2, link, True)[0]
    assert comm > 0 and got.layers[2].fwd_s == pytest.approx(2.0 * entry + comm)
    assert any("TP all-reduces" in n for n in got.notes)


def test_the_estimated_whole_head_keeps_its_fp32_log_probabilities() -> None:
    from sailor.simulator.estimate_profile import estimate_layer_size

    s, h, v = MODEL.seq_length, MODEL.hidden_size, MODEL.vocab_size
    head = estimate_layer_size(MODEL, 4, N - 1, vocab_parallel=False)
    assert head.params == MODEL.layer_params(N - 1)
    assert head.activation_bytes_per_sample == 4 * s * v + s * h * MODEL.param_bytes()
    emb = estimate_layer_size(MODEL, 4, 0, vocab_parallel=False)
    assert emb.params == MODEL.layer_params(0)
    assert estimate_layer_size(MODEL, 4, 0).params < emb.params  # split by vocabulary


def test_recompute_keeps_the_heads_activations_and_working_set() -> None:
    """The engine checkpoints blocks only: a head-only stage holds as much with recompute
    as without (before, recompute counted only its input and no doubled working set)."""

    def acts(recompute: bool) -> int:
        rg = ReplicaGroup(gpu_type="A", zone="z-a", tp=1, gpus_per_node=4)
        stages = (
            Stage(first_layer=0, last_layer=N - 2, replica=rg),
            Stage(first_layer=N - 1, last_layer=N - 1, replica=rg, recompute=recompute),
        )
        plan = Plan(
            model="tiny",
            global_batch_size=4,
            pipelines=(Pipeline(stages=stages, microbatch_size=1, num_microbatches=4),),
        )
        cal = Calibration(vocab_parallel=False)
        est = simulate(plan, MODEL, PROFILES, _network(), PRICES, calibration=cal, gpu_specs=SPECS)
        return est.memory[1].activations

    assert acts(True) == acts(False)


def test_a_head_measured_whole_at_tp2_by_an_older_profiler_is_noted() -> None:
    """Sailor's profiler stamps the TP degrees it measured with the engine's vocabulary split;
    a ``measured`` TP-2 head without the stamp timed the older engine's whole head, and the
    simulation says so (it prices what was measured)."""
    measured = PROFILES.model_copy(
        update={
            "timings": tuple(t.model_copy(update={"source": "measured"}) for t in PROFILES.timings)
        }
    )

    def notes(db: ProfileDB) -> list[str]:
        rg = ReplicaGroup(gpu_type="A", zone="z-a", tp=2, gpus_per_node=4)
        stage = Stage(first_layer=0, last_layer=N - 1, replica=rg)
        pipe = Pipeline(stages=(stage,), microbatch_size=2, num_microbatches=2)
        plan = Plan(model="tiny", global_batch_size=4, pipelines=(pipe,))
        est = simulate(plan, MODEL, db, _network(), PRICES, gpu_specs=SPECS)
        return [n for n in est.notes if "measured whole" in n]

    assert (
        len(notes(measured)) == 1 and "re-run `sailor profile layers` for A" in notes(measured)[0]
    )
    stamped = measured.model_copy(update={"meta": {"A.tp2.vocab_parallel": "true"}})
    assert notes(stamped) == []
    assert notes(PROFILES) == []  # imported: Megatron's split head


def test_tied_allreduce_moves_the_split_matrix_once_per_node() -> None:
    """Split by vocabulary, the tied matrix is reduced in TP-many chunk groups: a node moves
    it once whatever the TP degree, a GPU of a TP-t holder a t-th of it (one per-GPU ring:
    the smallest TP degree's share); replicated, each TP rank reduces all of it."""
    from sailor.schemas.network import BandwidthCurve as Curve

    tied = MODEL.model_copy(update={"tie_embeddings": True})
    net = NetworkProfile(
        links=tuple(
            ln.model_copy(update={"curve": Curve(coeffs=(0, 0, 1.0), max_gbps=1.0)})
            for ln in _network().links
        ),
        intra_node=_network().intra_node,
    )

    def extra(tps: tuple[int, int], vocab_parallel: bool, rings: str = "node") -> float:
        stages = tuple(
            Stage(
                first_layer=a,
                last_layer=b,
                replica=ReplicaGroup(gpu_type="A", zone="z-a", tp=t, gpus_per_node=4),
            )
            for (a, b), t in zip(((0, 2), (3, N - 1)), tps, strict=True)
        )
        plan = Plan(
            model="tiny",
            global_batch_size=4,
            pipelines=(Pipeline(stages=stages, microbatch_size=1, num_microbatches=4),),
        )
        off = Calibration(vocab_parallel=vocab_parallel, ring_links=rings)
        on = off.model_copy(update={"tied_allreduce": True})
        a = simulate(plan, tied, PROFILES, net, PRICES, calibration=off)
        b = simulate(plan, tied, PROFILES, net, PRICES, calibration=on)
        return b.iteration_time_s - a.iteration_time_s

    assert extra((2, 2), True) == pytest.approx(extra((1, 1), True), rel=1e-6)
    assert extra((2, 2), False) == pytest.approx(2 * extra((1, 1), False), rel=1e-6)
    # per-GPU rings: the TP-1 holder's GPU moves the whole matrix, as between two TP-1 ones
    one = extra((1, 1), True, "per_gpu")
    assert extra((1, 2), True, "per_gpu") == pytest.approx(one, rel=1e-6)
    assert extra((2, 2), True, "per_gpu") == pytest.approx(one / 2, rel=1e-6)


def test_a_boundary_inside_a_mesh_node_goes_over_one_pair_link() -> None:
    """Two stages on one node whose GPUs are linked directly (a mesh: 100 GB/s per pair,
    300 per GPU to its three peers): the boundary's bytes go from one GPU to another, over
    one pair link, priced as on a switched node whose GPUs have 100 GB/s each; not at the
    GPU's whole 300."""
    groups = [
        ReplicaGroup(gpu_type="A", zone="z-a", tp=1, gpus_per_node=4, node_id="n1")
        for _ in range(2)
    ]
    plan = _plan(_pipe([3], 4, 4, groups))
    no_curves = NetworkProfile(links=_network().links)
    mesh = {
        **SPECS,
        "A": SPECS["A"].model_copy(
            update={"intra_node_link_gbps": 300.0, "intra_node_pair_link_gbps": 100.0}
        ),
    }
    switched = {**SPECS, "A": SPECS["A"].model_copy(update={"intra_node_link_gbps": 100.0})}
    wide = {**SPECS, "A": SPECS["A"].model_copy(update={"intra_node_link_gbps": 300.0})}
    t = {
        name: simulate(plan, MODEL, PROFILES, no_curves, PRICES, gpu_specs=s).iteration_time_s
        for name, s in (("mesh", mesh), ("switched", switched), ("wide", wide))
    }
    assert t["mesh"] == pytest.approx(t["switched"], rel=1e-12)
    assert t["wide"] < t["switched"]  # the link matters to this plan
