"""TP all-reduces of estimated layers (lookup rules 3 and 5, ``simulator.tp_comm``)."""

from __future__ import annotations

import pytest

from sailor import catalog
from sailor.schemas import (
    BandwidthCurve,
    Endpoint,
    GPUCalibration,
    LayerProfile,
    Link,
    ModelSpec,
    NetworkProfile,
    ProfileDB,
)
from sailor.schemas.calibration import PCIE_LINK_EFFICIENCY, SPEC_LINK_EFFICIENCY
from sailor.schemas.network import CollectiveLatency
from sailor.schemas.profile import VOCAB_SPLIT_META
from sailor.simulator.estimate_profile import estimate_layer_timing
from sailor.simulator.lookup import layer_table
from sailor.simulator.tp_comm import (
    MIN_COLLECTIVE_S,
    TPLink,
    all_gather_s,
    compute_part,
    layer_comm_s,
    ring_allreduce_s,
    spec_link_efficiency,
    tp_link,
)
from sailor.simulator.uncertainty import corners

MODEL = catalog.model("OPT-350")
SPECS = catalog.gpus()
GPU = "L4"  # PCIe: the all-reduces are a large share of a narrow model's block
CAL = GPUCalibration(gpu_type=GPU)
BLOCK, HEAD = 1, MODEL.num_all_layers - 1


def _flat(gbps: float) -> BandwidthCurve:
    return BandwidthCurve(coeffs=(0.0, 0.0, gbps), max_gbps=gbps)


def _act(mbs: int) -> float:
    return float(mbs * MODEL.seq_length * MODEL.hidden_size * MODEL.param_bytes())


def test_ring_moves_2_t_minus_1_over_t_of_the_bytes() -> None:
    link = TPLink(_flat(100.0), 0.5, "test")
    nbytes = 400e6
    for t in (2, 4, 8):
        expect = 2 * (t - 1) / t * nbytes / (100e9 * 0.5)
        assert ring_allreduce_s(link, nbytes, t) == pytest.approx(expect)
    assert ring_allreduce_s(link, nbytes, 1) == 0.0
    assert ring_allreduce_s(link, 0.0, 4) == 0.0
    assert ring_allreduce_s(link, 8.0, 4) == MIN_COLLECTIVE_S


def test_collectives_per_layer_kind() -> None:
    link = TPLink(_flat(50.0), 1.0, "test")
    one = ring_allreduce_s(link, _act(2), 4)
    assert layer_comm_s(MODEL, 4, 2, BLOCK, link, True) == pytest.approx((2 * one, 2 * one))
    # the embedding sums its rows in fp32 forward; the head reduces its input's gradient
    emb = ring_allreduce_s(link, 4.0 * 2 * MODEL.seq_length * MODEL.hidden_size, 4)
    assert layer_comm_s(MODEL, 4, 2, 0, link, True) == pytest.approx((emb, 0.0))
    f, b = layer_comm_s(MODEL, 4, 2, HEAD, link, True)
    assert f == pytest.approx(3 * MIN_COLLECTIVE_S) and b == pytest.approx(one)
    # held whole on every rank, the embedding and head run no collective; TP 1 none at all
    assert layer_comm_s(MODEL, 4, 2, 0, link, False) == (0.0, 0.0)
    assert layer_comm_s(MODEL, 4, 2, HEAD, link, False) == (0.0, 0.0)
    assert layer_comm_s(MODEL, 1, 2, BLOCK, link, True) == (0.0, 0.0)


def test_link_is_the_measured_curve_else_a_derated_spec_sheet() -> None:
    """A spec sheet's link is derated by the prior's median for its kind: PCIe (L4, T4) far
    more than NVLink (A100-40), as the reference's measured TP profiles say
    (benchmarks/tp_link_evidence.py)."""
    spec = tp_link(None, SPECS, GPU, 4)
    assert spec.curve.max_gbps == SPECS[GPU].intra_node_link_gbps
    assert SPECS[GPU].intra_node_link.startswith("PCIe")
    assert spec.efficiency == PCIE_LINK_EFFICIENCY < SPEC_LINK_EFFICIENCY
    assert tp_link(None, SPECS, "A100-40", 4).efficiency == SPEC_LINK_EFFICIENCY
    prior = catalog.calibration().prior
    assert prior is not None and prior.tp_link_efficiency is not None
    assert prior.tp_link_efficiency_pcie is not None
    assert prior.tp_link_efficiency.median == SPEC_LINK_EFFICIENCY
    assert prior.tp_link_efficiency_pcie.median == PCIE_LINK_EFFICIENCY
    ep = Endpoint(zone="*", gpu_type=GPU, gpus_per_node=4)
    measured = _flat(7.0)
    net = NetworkProfile(intra_node=(Link(src=ep, dst=ep, curve=measured),))
    got = tp_link(net, SPECS, GPU, 4)
    assert got.curve == measured and got.efficiency == 1.0
    # another GPU type has no curve: its spec sheet
    assert tp_link(net, SPECS, "T4", 4).efficiency == PCIE_LINK_EFFICIENCY


def test_unprofiled_gpu_type_pays_its_all_reduces() -> None:
    db = ProfileDB(model=MODEL.name)
    link = tp_link(None, SPECS, GPU, 4)
    t4 = layer_table(db, MODEL, CAL, SPECS, GPU, 4, 2)
    t1 = layer_table(db, MODEL, CAL, SPECS, GPU, 1, 2)
    for layer in (0, BLOCK, HEAD):
        roof4 = estimate_layer_timing(MODEL, SPECS[GPU], 4, 2, layer)
        roof1 = estimate_layer_timing(MODEL, SPECS[GPU], 1, 2, layer)
        cf, cb = layer_comm_s(MODEL, 4, 2, layer, link, True)
        assert t4.layers[layer].fwd_s == pytest.approx(roof4.fwd_s + cf)
        assert t4.layers[layer].bwd_s == pytest.approx(roof4.bwd_s + cb)
        assert t1.layers[layer].fwd_s == pytest.approx(roof1.fwd_s)
    # TP 4 of this narrow model is far from 4x faster than TP 1
    assert t4.layers[BLOCK].fwd_s > 0.35 * t1.layers[BLOCK].fwd_s
    assert any("TP all-reduces at tp=4" in n for n in t4.notes)


def _measured(tps: tuple[int, ...], scale: float, source: str = "imported") -> ProfileDB:
    """Profiles of ``GPU`` at ``tps``: the roofline at each TP times ``scale`` (a GPU slower
    or faster than its roofline), plus its all-reduces over the link (which that scale does
    not touch), as a profiler that runs the layer on a real TP group times it. Imported:
    Megatron's, the embedding's all-reduce in the compute dtype; ``measured``: Sailor's
    profiler on its engine, in fp32 (autocast), stamped split."""
    link = {t: tp_link(None, SPECS, GPU, t) for t in tps if t > 1}
    embed = MODEL.param_bytes() if source == "imported" else 4.0
    rows = []
    for t in tps:
        for layer in range(MODEL.num_all_layers):
            e = estimate_layer_timing(MODEL, SPECS[GPU], t, 2, layer)
            cf, cb = layer_comm_s(MODEL, t, 2, layer, link[t], True, embed) if t > 1 else (0.0, 0.0)
            rows.append(
                LayerProfile(
                    gpu_type=GPU,
                    tp=t,
                    microbatch_size=2,
                    layer=layer,
                    kind=MODEL.layer_kind(layer),
                    fwd_s=scale * e.fwd_s + cf,
                    bwd_s=scale * e.bwd_s + cb,
                    update_s=e.update_s,
                    source=source,
                )
            )
    split = {f"{GPU}.tp{t}.{VOCAB_SPLIT_META}": "true" for t in tps if source == "measured"}
    return ProfileDB(model=MODEL.name, timings=tuple(rows), meta=split)


@pytest.mark.parametrize("source", ["imported", "measured"])
@pytest.mark.parametrize("near", [1, 2])
def test_unprofiled_tp_scales_compute_and_adds_its_all_reduces(near: int, source: str) -> None:
    """A GPU twice as slow as its roofline: the scaled compute keeps the factor 2, the
    all-reduces at the new TP are the link's (not scaled by the compute's factor). What the
    profile at ``near`` holds is taken out in the dtype of the engine that measured it:
    Megatron's embedding all-reduce in fp16, Sailor's in fp32 (before, the planned engine's:
    fp32 taken out of an imported fp16 one)."""
    db = _measured((near,), 2.0, source)
    got = layer_table(db, MODEL, CAL, SPECS, GPU, 4, 2)
    link = tp_link(None, SPECS, GPU, 4)
    for layer in (0, BLOCK, HEAD):
        roof = estimate_layer_timing(MODEL, SPECS[GPU], 4, 2, layer)
        cf, cb = layer_comm_s(MODEL, 4, 2, layer, link, True)
        assert got.layers[layer].fwd_s == pytest.approx(2.0 * roof.fwd_s + cf)
        assert got.layers[layer].bwd_s == pytest.approx(2.0 * roof.bwd_s + cb)
    assert any("plus the TP all-reduces" in n for n in got.notes)


def test_profiled_tp_is_taken_as_measured() -> None:
    db = _measured((1, 4), 1.0)
    got = layer_table(db, MODEL, CAL, SPECS, GPU, 4, 2)
    want = db.timing(GPU, 4, 2, BLOCK)
    assert want is not None
    assert got.layers[BLOCK].fwd_s == pytest.approx(want.fwd_s)
    assert not any("all-reduces" in n for n in got.notes)


def test_a_measured_intra_node_curve_prices_the_all_reduces() -> None:
    db = ProfileDB(model=MODEL.name)
    ep = Endpoint(zone="*", gpu_type=GPU, gpus_per_node=4)
    slow = NetworkProfile(intra_node=(Link(src=ep, dst=ep, curve=_flat(2.0)),))
    fast = NetworkProfile(intra_node=(Link(src=ep, dst=ep, curve=_flat(200.0)),))
    roof = estimate_layer_timing(MODEL, SPECS[GPU], 4, 2, BLOCK).fwd_s
    t_slow = layer_table(db, MODEL, CAL, SPECS, GPU, 4, 2, network=slow).layers[BLOCK].fwd_s
    t_fast = layer_table(db, MODEL, CAL, SPECS, GPU, 4, 2, network=fast).layers[BLOCK].fwd_s
    ar = 2 * 3 / 4 * _act(2)
    assert t_slow == pytest.approx(roof + 2 * ar / 2e9)
    assert t_fast == pytest.approx(roof + 2 * ar / 200e9)


def test_model_without_vocab_split_pays_no_head_all_reduce() -> None:
    db = ProfileDB(model=MODEL.name)
    model = ModelSpec.model_validate({**MODEL.model_dump(), "name": "x"})
    split = layer_table(db, model, CAL, SPECS, GPU, 4, 2, vocab_parallel=True)
    whole = layer_table(db, model, CAL, SPECS, GPU, 4, 2, vocab_parallel=False)
    one = layer_table(db, model, CAL, SPECS, GPU, 1, 2)
    # held whole, the head costs what it costs at TP 1, with no collective
    assert whole.layers[HEAD].bwd_s == pytest.approx(one.layers[HEAD].bwd_s)
    assert split.layers[BLOCK] == whole.layers[BLOCK]


def test_calibrated_compute_scale_leaves_the_all_reduces_alone() -> None:
    db = ProfileDB(model=MODEL.name)
    link = tp_link(None, SPECS, GPU, 4)
    slow = GPUCalibration(gpu_type=GPU, compute_scale=3.0)
    got = layer_table(db, MODEL, slow, SPECS, GPU, 4, 2).layers[BLOCK]
    roof = estimate_layer_timing(MODEL, SPECS[GPU], 4, 2, BLOCK)
    cf, cb = layer_comm_s(MODEL, 4, 2, BLOCK, link, True)
    assert got.fwd_s == pytest.approx(3.0 * roof.fwd_s + cf)
    assert got.bwd_s == pytest.approx(3.0 * roof.bwd_s + cb)


@pytest.mark.parametrize("gpu", [GPU, "A100-40"])
def test_the_spec_link_efficiency_is_a_range_in_the_corners(gpu: str) -> None:
    """Each corner takes its end of the prior's range for the GPU's link kind (L4: PCIe,
    A100-40: NVLink), and the simulator's table pays it."""
    db = ProfileDB(model=MODEL.name)
    got = {}
    for name, cal in corners(catalog.calibration()):
        gcal = cal.for_gpu(gpu)
        table = layer_table(db, MODEL, gcal, SPECS, gpu, 4, 2, network=NetworkProfile())
        eff = spec_link_efficiency(SPECS, gpu, gcal)
        link = tp_link(None, SPECS, gpu, 4, eff)
        assert link.efficiency == eff
        got[name] = layer_comm_s(MODEL, 4, 2, BLOCK, link, True)[0]
        assert table.layers[BLOCK].fwd_s > got[name]
    prior = catalog.calibration().prior
    assert prior is not None
    r = prior.tp_link_efficiency_pcie if gpu == GPU else prior.tp_link_efficiency
    assert r is not None
    assert got["optimistic"] < got["median"] < got["pessimistic"]
    assert got["median"] == pytest.approx(got["optimistic"] * r.high / r.median)
    assert got["pessimistic"] == pytest.approx(got["optimistic"] * r.high / r.low)


def _probe(gpu: str, ranks: int, bus: float, scope: str = "intra_node") -> CollectiveLatency:
    return CollectiveLatency(
        endpoint=Endpoint(zone="us-central1-a", gpu_type=gpu, gpus_per_node=8),
        ranks=ranks,
        latency_s=30e-6,
        bus_gbps=bus,
        scope=scope,  # type: ignore[arg-type]
    )


def test_a_measured_intra_node_all_reduce_prices_them() -> None:
    net = NetworkProfile(
        collectives=(
            _probe(GPU, 2, 20.0),
            _probe(GPU, 8, 12.0),
            _probe("T4", 4, 99.0),  # another type
            _probe(GPU, 4, 99.0, scope="inter_node"),  # one rank per node: not a TP group
        )
    )
    # 2 ranks are nearer 4 than 8 are: that measurement, its latency scaled to 4 ranks' steps
    link = tp_link(net, SPECS, GPU, 4)
    assert link.bus_gbps == 20.0 and link.latency_s == pytest.approx(30e-6 * 3)
    link8 = tp_link(net, SPECS, GPU, 8)
    assert link8.bus_gbps == 12.0 and link8.latency_s == pytest.approx(30e-6)
    nbytes = _act(2)
    assert ring_allreduce_s(link, nbytes, 4) == pytest.approx(30e-6 * 3 + 2 * 3 / 4 * nbytes / 20e9)
    db = ProfileDB(model=MODEL.name)
    got = layer_table(db, MODEL, CAL, SPECS, GPU, 4, 2, network=net).layers[BLOCK]
    roof = estimate_layer_timing(MODEL, SPECS[GPU], 4, 2, BLOCK)
    assert got.fwd_s == pytest.approx(roof.fwd_s + 2 * ring_allreduce_s(link, nbytes, 4))


def test_estimated_all_reduces_above_the_measured_time_leave_compute_its_share() -> None:
    # a profile at TP 2 faster than its estimated all-reduces alone (a link far better than
    # the spec sheet's): compute keeps the share the estimate gives it, never below zero
    db = _measured((2,), 1.0)
    fast = ProfileDB(
        model=MODEL.name,
        timings=tuple(
            t.model_copy(update={"fwd_s": t.fwd_s * 0.01, "bwd_s": t.bwd_s * 0.01})
            for t in db.timings
        ),
    )
    got = layer_table(fast, MODEL, CAL, SPECS, GPU, 4, 2).layers[BLOCK]
    r2 = estimate_layer_timing(MODEL, SPECS[GPU], 2, 2, BLOCK).fwd_s
    r4 = estimate_layer_timing(MODEL, SPECS[GPU], 4, 2, BLOCK).fwd_s
    c2 = layer_comm_s(MODEL, 2, 2, BLOCK, tp_link(None, SPECS, GPU, 2), True)[0]
    c4 = layer_comm_s(MODEL, 4, 2, BLOCK, tp_link(None, SPECS, GPU, 4), True)[0]
    f2 = fast.timing(GPU, 2, 2, BLOCK)
    assert f2 is not None and f2.fwd_s < c2
    assert got.fwd_s == pytest.approx(f2.fwd_s * r2 / (r2 + c2) * r4 / r2 + c4)


def test_a_stage_boundary_all_gather_is_derated_as_the_all_reduces() -> None:
    spec = tp_link(None, SPECS, GPU, 4, 0.5)
    # a ring all-gather: 3 steps of one 2 MB slice each, not the 8 MB tensor in one go
    assert spec.guessed and all_gather_s(spec, 8e6, 4) == pytest.approx(
        3 * 2e6 / (SPECS[GPU].intra_node_link_gbps * 1e9) / 0.5
    )
    assert all_gather_s(spec, 8e6, 2) == pytest.approx(
        4e6 / (SPECS[GPU].intra_node_link_gbps * 1e9) / 0.5
    )
    measured = tp_link(NetworkProfile(collectives=(_probe(GPU, 4, 20.0),)), SPECS, GPU, 4)
    assert not measured.guessed
    assert all_gather_s(measured, 8e6, 4) == pytest.approx(30e-6 + 3 / 4 * 8e6 / 20e9)
    assert all_gather_s(measured, 8e6, 1) == 0.0


def test_the_embedding_all_reduce_is_fp32_under_autocast_else_the_compute_dtype() -> None:
    db = ProfileDB(model=MODEL.name)
    link = tp_link(None, SPECS, GPU, 4)
    roof = estimate_layer_timing(MODEL, SPECS[GPU], 4, 2, 0).fwd_s
    for mp, nbytes in (("autocast", 4), ("fp16_optimizer", MODEL.param_bytes())):
        got = layer_table(db, MODEL, CAL, SPECS, GPU, 4, 2, mixed_precision=mp).layers[0]  # type: ignore[arg-type]
        cf = layer_comm_s(MODEL, 4, 2, 0, link, True, float(nbytes))[0]
        assert got.fwd_s == pytest.approx(roof + cf)
    assert MODEL.param_bytes() == 2


def test_calibration_fits_the_hook_cost_on_the_simulations_table() -> None:
    """The per-layer hook cost is fitted against the table the runs are simulated with: at
    an unprofiled TP, its all-reduces at the base calibration's link efficiency."""
    from sailor.schemas import Calibration, Pipeline, Plan, ReplicaGroup, Stage
    from sailor.simulator.calibrate import _table

    db = _measured((1,), 1.0)
    base = Calibration(gpus=(GPUCalibration(gpu_type=GPU, tp_link_efficiency_pcie=0.05),))
    group = ReplicaGroup(gpu_type=GPU, zone="z", tp=4, gpus_per_node=4)
    stage = Stage(first_layer=0, last_layer=MODEL.num_all_layers - 1, replica=group)
    pipe = Pipeline(stages=(stage,), microbatch_size=2, num_microbatches=8)
    plan = Plan(model=MODEL.name, pipelines=(pipe,), global_batch_size=16)
    got = _table(db, MODEL, GPU, plan, base, SPECS).layers[BLOCK].fwd_s
    slow = GPUCalibration(gpu_type=GPU, tp_link_efficiency_pcie=0.05)
    want = layer_table(db, MODEL, slow, SPECS, GPU, 4, 2, base.vocab_parallel, base.activations)
    assert got == pytest.approx(want.layers[BLOCK].fwd_s)
    assert got > layer_table(db, MODEL, CAL, SPECS, GPU, 4, 2).layers[BLOCK].fwd_s


def test_rule_3_takes_the_hook_cost_out_first() -> None:
    # imported (timed with per-layer hooks) at TP 2, microbatches 2 and 8: at 2 each layer
    # also pays 3 ms of hook latency, which the GPU-bound time at 8 shows is not compute
    rows = []
    for mbs, extra in ((2, 3e-3), (8, 0.0)):
        for layer in range(MODEL.num_all_layers):
            e = estimate_layer_timing(MODEL, SPECS[GPU], 2, mbs, layer)
            rows.append(
                LayerProfile(
                    gpu_type=GPU,
                    tp=2,
                    microbatch_size=mbs,
                    layer=layer,
                    kind=MODEL.layer_kind(layer),
                    fwd_s=e.fwd_s + extra / 2,
                    bwd_s=e.bwd_s + extra / 2,
                    update_s=e.update_s,
                    source="imported",
                )
            )
    db = ProfileDB(model=MODEL.name, timings=tuple(rows))
    hooked = GPUCalibration(gpu_type=GPU, profiler_overhead_s=2e-3)
    plain = layer_table(db, MODEL, CAL, SPECS, GPU, 4, 2).layers[BLOCK].fwd_s
    less = layer_table(db, MODEL, hooked, SPECS, GPU, 4, 2).layers[BLOCK].fwd_s
    at2 = layer_table(db, MODEL, hooked, SPECS, GPU, 2, 2).layers[BLOCK].fwd_s
    assert at2 < layer_table(db, MODEL, CAL, SPECS, GPU, 2, 2).layers[BLOCK].fwd_s
    assert less < plain


def test_the_corners_order_a_tp_degree_below_the_profiled_one() -> None:
    """Profiled at TP 4 only, priced at TP 2: a costlier link costs more in every corner
    (review: taking the corner's all-reduces out of the measured time reversed it)."""
    db = _measured((4,), 2.0)
    got = {}
    for name, cal in corners(catalog.calibration()):
        if name == "original":
            continue
        gcal = GPUCalibration(
            gpu_type=GPU, tp_link_efficiency_pcie=cal.for_gpu(GPU).tp_link_efficiency_pcie
        )
        got[name] = layer_table(db, MODEL, gcal, SPECS, GPU, 2, 2).layers[BLOCK].fwd_s
    assert got["optimistic"] < got["median"] < got["pessimistic"]


@pytest.mark.parametrize("source", ["imported", "measured"])
def test_a_measured_embedding_backward_is_raised_to_its_forwards_compute(source: str) -> None:
    """At TP > 1 a measured split embedding's forward holds its rows' all-reduce, its
    backward none: a backward recorded below the forward is raised to the forward's compute
    (at least the share the roofline gives it), not to the forward with the all-reduce.
    Before, the backward paid an all-reduce it does not run; and where the all-reduce's
    estimate exceeded the measured forward (a slow PCIe link), a first fix raised it to
    nothing (review)."""
    db = _measured((4,), 1.0, source)
    low = tuple(t.model_copy(update={"bwd_s": 1e-6}) if t.layer == 0 else t for t in db.timings)
    got = layer_table(db.model_copy(update={"timings": low}), MODEL, CAL, SPECS, GPU, 4, 2)
    e = estimate_layer_timing(MODEL, SPECS[GPU], 4, 2, 0)
    embed = MODEL.param_bytes() if source == "imported" else 4.0
    held = layer_comm_s(MODEL, 4, 2, 0, tp_link(None, SPECS, GPU, 4), True, embed)[0]
    fwd = e.fwd_s + held
    assert got.layers[0].fwd_s == pytest.approx(fwd)
    assert got.layers[0].bwd_s == pytest.approx(compute_part(fwd, held, e.fwd_s))
    assert 0 < got.layers[0].bwd_s < fwd
    # an all-reduce estimate above the measured forward leaves the roofline's share
    tiny = tuple(
        t.model_copy(update={"fwd_s": held / 2, "bwd_s": 1e-6}) if t.layer == 0 else t
        for t in db.timings
    )
    got = layer_table(db.model_copy(update={"timings": tiny}), MODEL, CAL, SPECS, GPU, 4, 2)
    share = (held / 2) * e.fwd_s / (e.fwd_s + held)
    assert got.layers[0].bwd_s == pytest.approx(share)


def test_a_calibration_written_before_the_pcie_field_holds_its_value_for_every_link() -> None:
    """A calibration file (or prior) of an older release has one TP link efficiency, which
    then held for PCIe links too: read back, it still does (review: it silently took the
    PCIe default). Written now, both fields are there and each keeps its own."""
    from sailor.schemas import ConstantRange, GPUPrior

    old = GPUCalibration.model_validate({"gpu_type": GPU, "tp_link_efficiency": 0.6})
    assert old.tp_link_efficiency_pcie == 0.6
    assert spec_link_efficiency(SPECS, GPU, old) == 0.6
    new = GPUCalibration(gpu_type=GPU, tp_link_efficiency=0.6, tp_link_efficiency_pcie=0.2)
    again = GPUCalibration.model_validate_json(new.model_dump_json())
    assert (again.tp_link_efficiency, again.tp_link_efficiency_pcie) == (0.6, 0.2)
    assert GPUCalibration(gpu_type=GPU).tp_link_efficiency_pcie == PCIE_LINK_EFFICIENCY
    prior = catalog.calibration().prior
    assert prior is not None
    r = ConstantRange(low=0.4, median=0.5, high=0.6, evidence="old")
    older = GPUPrior.model_validate(
        {
            **prior.model_dump(exclude={"tp_link_efficiency_pcie"}),
            "tp_link_efficiency": r.model_dump(),
        }
    )
    assert older.tp_link_efficiency_pcie == r


def test_calibration_keeps_the_base_tp_link_efficiencies() -> None:
    """``calibrate_gpu`` fits h, c, eta and the p2p constants on tables read with the base's
    TP link efficiencies, and the fitted entry carries them (review: it carried the defaults)."""
    pytest.importorskip("numpy")
    from tests.reference_opt350 import DEEPSPEED, REF, load_opt350

    if not REF.exists():
        pytest.skip(f"needs the reference data at {REF}")
    from sailor.simulator import calibrate_gpu

    model, profiles, network, prices, runs = load_opt350()
    mine = GPUCalibration(gpu_type="GH-96", tp_link_efficiency=0.7, tp_link_efficiency_pcie=0.05)
    got = calibrate_gpu(
        runs, model, profiles, network, prices, gpu_specs=SPECS, base=DEEPSPEED.with_gpu(mine)
    )
    assert (got.tp_link_efficiency, got.tp_link_efficiency_pcie) == (0.7, 0.05)


def test_a_mesh_node_reaches_as_many_pair_links_as_the_group_has_peers() -> None:
    """GH200's quad node links its GPUs directly (150 GB/s per pair, no NVSwitch): a TP-2
    group has one pair link, a TP-4 group all three (450 GB/s per GPU, the spec sheet's
    per-GPU figure). A switched node (A100-40) gives every group the whole link."""
    gh = SPECS["GH-96"]
    assert gh.intra_node_pair_link_gbps == 150 and gh.intra_node_link_gbps == 450
    assert tp_link(None, SPECS, "GH-96", 2).curve.max_gbps == 150
    assert tp_link(None, SPECS, "GH-96", 4).curve.max_gbps == 450
    assert "3 of its pair links" in tp_link(None, SPECS, "GH-96", 4).note
    a100 = SPECS["A100-40"]
    assert a100.intra_node_pair_link_gbps is None
    assert {tp_link(None, SPECS, "A100-40", t).curve.max_gbps for t in (2, 4)} == {300}
    # a group never gets more than the whole link, however many peers
    wide = gh.model_copy(update={"intra_node_pair_link_gbps": 400.0})
    assert wide.link_gbps_among(4) == 450 and wide.link_gbps_among(2) == 400
    link2 = tp_link(None, SPECS, "GH-96", 2, 1.0)
    link4 = tp_link(None, SPECS, "GH-96", 4, 1.0)
    # the same bytes per GPU step: the TP-4 ring's steps are a third of TP-2's over a pair
    assert ring_allreduce_s(link4, 3e8, 4) < ring_allreduce_s(link2, 3e8, 2)


def test_a_pair_link_must_be_positive() -> None:
    with pytest.raises(ValueError, match="intra_node_pair_link_gbps"):
        SPECS["GH-96"].model_validate(
            {**SPECS["GH-96"].model_dump(), "intra_node_pair_link_gbps": 0}
        )
