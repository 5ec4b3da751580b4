"""One precision per job: chosen from the plan's GPUs, recorded in the plan, priced as the
engine runs it (compute peak, fp32 gradient all-reduce, wire dtype, autocast weight copies)."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from sailor.catalog import gpus, models
from sailor.planner import plan as make_plans
from sailor.profiler.layers import saved_bytes_fit, to_profile_db
from sailor.schemas import (
    BandwidthCurve,
    Calibration,
    GPUPrice,
    GPUSpec,
    NetworkProfile,
    Pipeline,
    Plan,
    Pool,
    PoolEntry,
    PriceTable,
    ProfileDB,
    ReplicaGroup,
    Stage,
)
from sailor.schemas.calibration import GPUCalibration
from sailor.schemas.model import ModelSpec
from sailor.schemas.precision import (
    GRAD_ALLREDUCE_BYTES,
    choose_precision,
    compute_bytes,
    keeps_weight_copies,
    loss_scaling,
    wire_bytes,
)
from sailor.schemas.profile import VOCAB_SPLIT_META, LayerProfile
from sailor.simulator import simulate
from sailor.simulator.estimate_profile import estimate_layer_timing
from sailor.simulator.lookup import ProfileLookupError, layer_table
from sailor.simulator.tp_comm import layer_comm_s, tp_link
from tests.unit.test_planner_search import make_env
from tests.unit.test_simulator_simulate import (
    MODEL,
    PRICES,
    PROFILES,
    SPECS,
    N,
    _network,
    _pipe,
    _plan,
    _rg,
)

DEEPSPEED = Calibration(
    mixed_precision="fp16_optimizer", p2p_across_tp="scatter_gather", sends_attention_mask=False
)

# -- choice -----------------------------------------------------------------------------------


def test_bf16_where_every_gpu_has_it_else_fp16_and_fp32_on_cpu() -> None:
    cat = gpus()
    assert choose_precision(["A100-40", "H100-80"], cat) == "bf16"
    # catalog: V100, T4, Titan-RTX, RTX-2080 have no bf16 units
    for old in ("V100-16", "T4", "Titan-RTX", "RTX-2080"):
        assert choose_precision(["A100-40", old], cat) == "fp16"
    # the catalog's cpu type has a nominal bf16 peak; the engine still computes in fp32
    assert cat["cpu"].peak_tflops_bf16 > 0
    assert choose_precision(["cpu"], cat) == "fp32"
    assert choose_precision(["A100-40"], cat, requested="fp32") == "fp32"
    # a GPU type without a spec cannot be shown to have bf16
    assert choose_precision(["A100-40", "mystery"], cat) == "fp16"
    with pytest.raises(ValueError, match="gpu_types"):
        choose_precision([], cat)


def test_engine_byte_constants() -> None:
    assert GRAD_ALLREDUCE_BYTES == 4  # the engine all-reduces fp32 gradients
    assert [compute_bytes(p) for p in ("fp32", "bf16", "fp16")] == [4, 2, 2]
    assert [wire_bytes(p) for p in ("fp32", "bf16", "fp16")] == [4, 2, 2]
    assert not keeps_weight_copies("fp32") and keeps_weight_copies("bf16")
    assert loss_scaling("fp16") and not loss_scaling("bf16")


# -- the plan records it ----------------------------------------------------------------------


def _one_stage_plan(gpu_type: str, precision: str | None = None) -> Plan:
    n = MODEL.num_all_layers
    return Plan(
        model="tiny",
        global_batch_size=4,
        pipelines=(
            Pipeline(
                stages=(
                    Stage(
                        first_layer=0,
                        last_layer=n - 1,
                        replica=ReplicaGroup(gpu_type=gpu_type, zone="z-a", gpus_per_node=2),
                    ),
                ),
                microbatch_size=1,
                num_microbatches=4,
            ),
        ),
        precision=precision,  # type: ignore[arg-type]
    )


def test_old_plan_json_loads_and_derives_its_precision() -> None:
    old = json.loads(_one_stage_plan("V100-16").model_dump_json())
    del old["precision"]  # written before the field existed
    p = Plan.model_validate(old)
    assert p.precision is None
    assert p.resolved_precision(gpus()) == "fp16"
    assert p.with_precision(gpus()).precision == "fp16"
    assert _one_stage_plan("H100-80").resolved_precision(gpus()) == "bf16"
    assert _one_stage_plan("H100-80", "fp32").resolved_precision(gpus()) == "fp32"
    rt = Plan.model_validate_json(_one_stage_plan("H100-80", "bf16").model_dump_json())
    assert rt.precision == "bf16"
    with pytest.raises(ValueError, match="precision"):
        Plan.model_validate({**old, "precision": "int8"})


def test_imported_plans_record_fp16() -> None:
    from sailor.importers.sailor_plan import plan_from_dict

    d = {
        "mbs": 1,
        "gbs": 2,
        "pipeline_list": [
            {
                "num_stages": 1,
                "layers_per_stage": [[0, 1, 2]],
                "dp": [1],
                "tmp_per_stage": [[[[["A100-40", 4, "us-central1-a"]], 1]]],
            }
        ],
    }
    # the original trains in fp16 (Megatron-DeepSpeed); its format does not say so
    assert plan_from_dict(d, "x").precision == "fp16"
    assert plan_from_dict(d, "x", precision="bf16").precision == "bf16"


def test_planner_plans_carry_their_precision() -> None:
    env = make_env(gbs=8)
    pool = Pool(entries=(PoolEntry(gpu_type="fast", zone="us-test1-a", nodes=2, gpus_per_node=2),))
    ranked = make_plans(**env.kw(), pool=pool, gpu_specs=env.specs)  # type: ignore[arg-type]
    assert ranked and all(r.plan.precision == "bf16" for r in ranked)
    no_bf16 = {g: s.model_copy(update={"peak_tflops_bf16": 0.0}) for g, s in env.specs.items()}
    ranked = make_plans(**env.kw(), pool=pool, gpu_specs=no_bf16)  # type: ignore[arg-type]
    assert ranked and all(r.plan.precision == "fp16" for r in ranked)


# -- the simulator prices it ------------------------------------------------------------------


def _flat(gbps: float) -> NetworkProfile:
    """``_network`` with every curve flat at ``gbps`` and no latency."""
    base = _network()
    curve = BandwidthCurve(coeffs=(0.0, 0.0, gbps), max_gbps=gbps)
    return NetworkProfile(
        links=tuple(ln.model_copy(update={"curve": curve}) for ln in base.links),
        intra_node=tuple(ln.model_copy(update={"curve": curve}) for ln in base.intra_node),
    )


def test_gradients_are_all_reduced_in_fp32() -> None:
    # two replicas of one stage: a 2-member ring moves 2(d-1)/d of the bytes each way
    plan = _plan(_pipe([], 1, 2), _pipe([], 1, 2))
    est = simulate(plan, MODEL, PROFILES, _flat(1.0), PRICES, gpu_specs=SPECS)
    params = MODEL.num_all_layers * 1_000_000
    want = 2 * (2 - 1) * (params * 4 / 2) / 1e9
    assert est.stages[0].grad_sync_s == pytest.approx(want, rel=1e-9)
    # DeepSpeed's FP16_Optimizer (the reference plans) reduces 16-bit gradients
    ds = simulate(plan, MODEL, PROFILES, _flat(1.0), PRICES, gpu_specs=SPECS, calibration=DEEPSPEED)
    assert ds.stages[0].grad_sync_s == pytest.approx(want / 2, rel=1e-9)


def test_compute_at_the_plan_precision_peak() -> None:
    # GPU type E has no profile: the roofline estimate at the plan's precision's peak (fp32
    # 10 TFLOP/s, 16-bit 100); memory bandwidth made ample so that every layer is
    # compute-bound
    fast = {g: s.model_copy(update={"memory_bandwidth_gbps": 1e9}) for g, s in SPECS.items()}
    groups = [_rg("E")]

    def fwd(precision: str | None, specs: dict[str, GPUSpec] = fast) -> float:
        p = _plan(_pipe([], 4, 1, groups)).model_copy(update={"precision": precision})
        est = simulate(p, MODEL, PROFILES, _network(), PRICES, gpu_specs=specs)
        return est.stages[0].fwd_s

    assert fwd("fp32") == pytest.approx(10 * fwd("bf16"))
    assert fwd(None) == fwd("bf16")  # E has bf16 units: derived bf16
    # a GPU type without bf16 units: derived fp16, priced at its fp16 peak (here 50)
    no_bf16 = {
        **fast,
        "E": fast["E"].model_copy(update={"peak_tflops_bf16": 0.0, "peak_tflops_fp16": 50.0}),
    }
    assert fwd(None, no_bf16) == pytest.approx(2 * fwd("bf16"))
    assert fwd(None, no_bf16) == fwd("fp16", no_bf16)
    with pytest.raises(ValueError, match="no bf16 units"):
        fwd("bf16", no_bf16)


def test_cpu_plans_run_fp32() -> None:
    cpu = {**SPECS, "cpu": gpus()["cpu"]}
    profiles = ProfileDB(model="tiny")  # estimated layers, no cpu price needed beyond this
    prices = PriceTable(
        gpus=(
            GPUPrice(gpu_type="cpu", region="*", on_demand_usd_per_hour=0.0, spot_usd_per_hour=0.0),
        )
    )
    plan = _plan(_pipe([4], 1, 2, [_rg("cpu"), _rg("cpu")]))
    est = simulate(plan, MODEL, profiles, _network(), prices, gpu_specs=cpu)
    assert all(m.weight_copies == 0 for m in est.memory)
    assert any("fp32 derived" in n for n in est.notes)
    with pytest.raises(ValueError, match="CPU ranks compute in fp32"):
        simulate(
            plan.model_copy(update={"precision": "bf16"}),
            MODEL,
            profiles,
            _network(),
            prices,
            gpu_specs=cpu,
        )


def test_activations_on_the_wire_in_the_plan_precision() -> None:
    # the profile's sizes are in the model spec's precision (fp16: 2 bytes); an fp32 plan
    # sends twice the bytes of a bf16 one
    cal = Calibration(sends_attention_mask=False, blocking_p2p=False)
    plan = _plan(_pipe([4], 2, 4))

    def send(precision: str) -> float:
        p = plan.model_copy(update={"precision": precision})
        est = simulate(p, MODEL, PROFILES, _flat(1.0), PRICES, gpu_specs=SPECS, calibration=cal)
        return est.stages[0].send_s

    assert send("bf16") == pytest.approx(2 * 100_000 / 1e9)
    assert send("fp32") == pytest.approx(2 * send("bf16"))


# -- autocast weight copies -------------------------------------------------------------------


def test_eight_block_llama_stage_holds_a_weight_copy_per_microbatch_in_flight() -> None:
    """An 8-block 8B-Llama stage with 4 microbatches in flight keeps ~14 GB of bf16 copies
    (8 x 218M params x 2 B x 4); dividing the profiled saved bytes by the microbatch size
    predicted ~1.7 GB."""
    llama = models()["LLAMA-3-8"]
    n = llama.num_all_layers
    cuts = [0, 8, 16, 24, 32, n]  # stage 1: blocks 8..15, stages - stage = 4
    pipe = Pipeline(
        stages=tuple(
            Stage(
                first_layer=a,
                last_layer=b - 1,
                replica=ReplicaGroup(gpu_type="H100-80", zone="z", gpus_per_node=8),
            )
            for a, b in itertools.pairwise(cuts)
        ),
        microbatch_size=1,
        num_microbatches=8,
    )
    plan = Plan(model=llama.name, global_batch_size=8, pipelines=(pipe,))
    prices = PriceTable(
        gpus=(
            GPUPrice(
                gpu_type="H100-80", region="*", on_demand_usd_per_hour=1.0, spot_usd_per_hour=1.0
            ),
        )
    )
    est = simulate(
        plan, llama, ProfileDB(model=llama.name), NetworkProfile(), prices, gpu_specs=gpus()
    )
    stage1 = est.memory[1]
    block = llama.layer_params(1)
    assert stage1.weight_copies == 8 * block * 2 * 4
    assert 13e9 < stage1.weight_copies < 15e9
    assert est.memory[4].weight_copies == sum(llama.layer_params(i) for i in range(32, n)) * 2
    # fp32: no copies
    fp32 = simulate(
        plan.model_copy(update={"precision": "fp32"}),
        llama,
        ProfileDB(model=llama.name),
        NetworkProfile(),
        prices,
        gpu_specs=gpus(),
    )
    assert all(m.weight_copies == 0 for m in fp32.memory)


def test_a_plan_that_fit_without_the_copies_is_refused() -> None:
    # 4 single-GPU nodes of 160 MiB: without the copies (DeepSpeed's accounting) the planner's
    # best plan, 4 stages (2, 1, 1, 1), fits at exactly 160 MiB; its first stage holds 4
    # copies (+48 MiB) and no longer fits, so the planner now refuses it
    env = make_env(memory_mb={"fast": 160}, speed={"fast": 1.0}, gpus_per_node=1, gbs=16)
    pool = Pool(entries=(PoolEntry(gpu_type="fast", zone="us-test1-a", nodes=4, gpus_per_node=1),))
    before = make_plans(**env.kw(), pool=pool, gpu_specs=env.specs, calibration=DEEPSPEED)  # type: ignore[arg-type]
    old = before[0].plan
    assert before[0].estimate.fits_in_memory
    est = simulate(old, env.model, env.profiles, env.network, env.prices, gpu_specs=env.specs)
    assert not est.fits_in_memory
    assert est.memory[0].weight_copies > 0
    after = make_plans(**env.kw(), pool=pool, gpu_specs=env.specs)  # type: ignore[arg-type]
    layouts = {
        (r.plan.pipelines[0].partition(), r.plan.pipelines[0].microbatch_size) for r in after
    }
    assert (old.pipelines[0].partition(), old.pipelines[0].microbatch_size) not in layouts
    assert all(r.estimate.fits_in_memory for r in after)


def test_recomputation_keeps_one_microbatchs_copies_of_the_stage() -> None:
    """Autocast's cache holds every cast until the microbatch's forward leaves its autocast
    context, checkpointed layers included: the stage's copies, once (not one per microbatch
    in flight, not one layer's)."""
    plan = _plan(_pipe([4], 1, 8))
    stages = [s.model_copy(update={"recompute": True}) for s in plan.pipelines[0].stages]
    rec = plan.model_copy(
        update={"pipelines": (plan.pipelines[0].model_copy(update={"stages": tuple(stages)}),)}
    )
    est = simulate(rec, MODEL, PROFILES, _network(), PRICES, gpu_specs=SPECS)
    # the embedding and 3 blocks of 1M parameters; the blocks' cast to 2 bytes each
    assert est.memory[0].weight_copies == 3 * 1_000_000 * 2


def test_autocast_casts_the_blocks_weights_not_the_embeddings_table() -> None:
    """What the memory model's weight copies count: under autocast (CPU bf16 standing in
    for a GPU's) a block's forward keeps 16-bit copies of its matmul weights for the
    backward, while the embedding's lookup keeps none of its table (before, the model
    counted one: ~1 GB per microbatch in flight on an 8B Llama's stage 0)."""
    from sailor.megatron_patch.model import Block, Embedding
    from sailor.megatron_patch.tp_layers import TPContext

    def saved_bf16(layer: torch.nn.Module, x: torch.Tensor) -> int:
        saved: list[torch.Tensor] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved.append(t)
            return t

        with (
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
            torch.autocast("cpu", dtype=torch.bfloat16),
        ):
            layer(x)
        weights = {p.data_ptr() for p in layer.parameters()}
        # a saved 16-bit tensor with a weight's shape is a cast copy of it (each once)
        shapes = {tuple(p.shape) for p in layer.parameters() if p.dim() == 2}
        copies = {
            t.untyped_storage().data_ptr(): t.numel()
            for t in saved
            if t.dtype == torch.bfloat16
            and tuple(t.shape) in shapes
            and t.data_ptr() not in weights
        }
        return sum(copies.values())

    spec = MODEL
    emb = Embedding(spec)
    # 3 x 32 tokens: no activation has a weight's shape
    tokens = torch.randint(0, spec.vocab_size, (3, spec.seq_length))
    assert saved_bf16(emb, tokens) == 0
    block = Block(spec, TPContext())
    x = torch.randn(3, spec.seq_length, spec.hidden_size, requires_grad=True)
    matmuls = sum(p.numel() for p in block.parameters() if p.dim() == 2)
    assert saved_bf16(block, x) == matmuls


# -- the profiler separates the copy from the activations -------------------------------------


def test_saved_bytes_fit_separates_the_per_microbatch_copy() -> None:
    copy, per_sample = 3_000_000, 40_000
    pts = [(b, copy + b * per_sample) for b in (1, 2, 4, 8)]
    assert saved_bytes_fit(pts) == (per_sample, copy)
    assert saved_bytes_fit([(4, 400)]) == (100, 0)  # one size: no intercept to fit
    assert saved_bytes_fit([(1, 50), (2, 200)]) == (100, 0)  # negative intercept: none


def test_profile_db_records_the_copy_not_as_activations() -> None:
    from sailor.profiler.layer_measurement import LayerMeasurement
    from sailor.profiler.timing import Stats

    st = Stats.of([1e-3, 1e-3, 1e-3])
    spec = MODEL
    ms = [
        LayerMeasurement(
            kind=kind,
            tp=1,
            mbs=b,
            fwd=st,
            bwd=st,
            update=st,
            params=1000,
            saved_bytes=2000 + b * 500,
            output_bytes=b * 64,
            input_bytes=b * 64,
            peak_growth_bytes=0,
        )
        for kind in ("embedding", "block", "head")
        for b in (1, 2, 4)
    ]
    db = to_profile_db(spec, "cpu", ms, {})
    size = db.size(1, 1)
    assert size is not None
    assert (size.activation_bytes_per_sample, size.per_microbatch_bytes) == (500, 2000)
    # the sizes record the precision the run computed in (one per file, ProfileDB)
    assert {s.precision for s in db.sizes} == {None}
    db = to_profile_db(spec, "cpu", ms, {}, precision="bf16")
    assert db.sizes and {s.precision for s in db.sizes} == {"bf16"}


def test_autocast_copy_is_measured_as_a_per_microbatch_intercept() -> None:
    """On CPU, bf16 autocast saves the cast of a Linear's weight once per forward: the fit
    over microbatch sizes puts it in the intercept, not the per-sample slope."""
    torch = pytest.importorskip("torch")
    from sailor.profiler.memory import saved_tensor_bytes

    lin = torch.nn.Linear(256, 256, bias=False)
    points = []
    for b in (1, 2, 4):
        x = torch.randn(b, 8, 256, requires_grad=True)

        def fwd(x=x):  # type: ignore[no-untyped-def]
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return lin(x).float().sum()

        points.append((b, saved_tensor_bytes(fwd, lin.parameters())))
    per_sample, per_mb = saved_bytes_fit(points)
    assert per_mb == 256 * 256 * 2  # the bf16 copy of the weight
    assert per_sample == 8 * 256 * 2  # the bf16 input saved for the weight gradient


def test_a_stage_hands_on_and_holds_an_fp32_output_under_autocast() -> None:
    """What ``held_output_bytes`` counts: a stage that does not end with the head returns
    the fp32 residual stream under autocast (``4·s·h`` per sample), which the schedule keeps
    until that microbatch's backward starts from it; the last stage holds only the loss."""
    from sailor.megatron_patch.model import GPTStage
    from sailor.simulator.memory import held_output_bytes

    spec = MODEL.model_copy(update={"precision": "bf16"})
    stage = GPTStage(spec, 0, 2)
    tokens = torch.randint(0, spec.vocab_size, (3, spec.seq_length))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = stage(tokens, None)
    assert out.dtype == torch.float32
    assert out.numel() * out.element_size() == 3 * held_output_bytes(spec, 2, "autocast")
    assert held_output_bytes(spec, N - 1, "autocast") == 0
    assert held_output_bytes(spec, 2, "fp16_optimizer") == 0


def test_an_fp32_plan_on_16_bit_profiles_prices_its_compute_in_fp32() -> None:
    """Type A's layers were profiled under bf16 autocast; a plan forced to fp32 on A was
    priced at the profile's speed (10x too fast here: fp32 peak 10 TFLOP/s, bf16 100).
    Its forward and backward are scaled by the roofline's ratio (the peaks' where a layer is
    compute-bound, the bytes' where it is not), and the estimate says so."""
    fast = {g: s.model_copy(update={"memory_bandwidth_gbps": 1e9}) for g, s in SPECS.items()}
    bf16 = PROFILES.model_copy(
        update={
            "timings": tuple(t.model_copy(update={"precision": "bf16"}) for t in PROFILES.timings)
        }
    )

    def est(precision: str, profiles: ProfileDB = bf16) -> object:
        p = _plan(_pipe([], 4, 1)).model_copy(update={"precision": precision})
        return simulate(p, MODEL, profiles, _network(), PRICES, gpu_specs=fast)

    b, f = est("bf16"), est("fp32")
    # the blocks are compute-bound (x10, the peaks); the embedding's lookup moves bytes
    # alone (x2, fp32's): 9x for the stage
    for part in ("fwd_s", "bwd_s"):
        ratio = getattr(f.stages[0], part) / getattr(b.stages[0], part)  # type: ignore[attr-defined]
        assert 8 < ratio <= 10, part
    assert f.uses_estimates and not b.uses_estimates  # type: ignore[attr-defined]
    assert any("profiled in bf16, priced in fp32" in n for n in f.notes)  # type: ignore[attr-defined]
    # a profile measured in fp32 (or one that does not say) is priced as measured
    fp32 = PROFILES.model_copy(
        update={
            "timings": tuple(t.model_copy(update={"precision": "fp32"}) for t in PROFILES.timings)
        }
    )
    assert est("fp32", fp32).stages[0].fwd_s == est("bf16", PROFILES).stages[0].fwd_s  # type: ignore[attr-defined]


# -- a profile in another precision than the plan's: what it holds --------------------------

_WIDE = ModelSpec(
    name="wide",
    num_layers=2,
    hidden_size=1024,
    num_heads=16,
    ffn_hidden_size=4096,
    seq_length=512,
    vocab_size=1024,
    global_batch_size=8,
    precision="bf16",
)
_COMPUTE_BOUND = SPECS["A"].model_copy(
    update={"memory_bandwidth_gbps": 1e9, "intra_node_link_gbps": 128.0}
)


def _synthetic_tp2_profile(model: ModelSpec, spec: GPUSpec, precision: str) -> ProfileDB:
    """What a profiler measures at TP 2 if the roofline and the TP all-reduce estimate were
    exact: each layer's compute plus its all-reduces, in ``precision``."""
    link = tp_link(None, {spec.name: spec}, spec.name, 2)
    there = model.model_copy(update={"precision": precision})
    timings = []
    for layer in range(model.num_all_layers):
        roof = estimate_layer_timing(there, spec, 2, 1, layer)
        cf, cb = layer_comm_s(there, 2, 1, layer, link, True, 4.0)
        timings.append(
            LayerProfile(
                gpu_type=spec.name,
                tp=2,
                microbatch_size=1,
                layer=layer,
                kind=model.layer_kind(layer),
                fwd_s=roof.fwd_s + cf,
                bwd_s=roof.bwd_s + cb,
                update_s=1e-4 * (layer + 1),
                source="measured",
                precision=precision,  # type: ignore[arg-type]
            )
        )
    return ProfileDB(
        model=model.name,
        timings=tuple(timings),
        meta={f"{spec.name}.tp2.{VOCAB_SPLIT_META}": "split"},
    )


def test_an_fp32_plan_on_a_bf16_profile_at_tp_2_scales_the_compute_not_the_all_reduces() -> None:
    """A block's time measured at TP 2 holds its all-reduces (here about a third of it).
    Priced in fp32, the whole time was multiplied by the peaks' ratio (10x), the
    all-reduces too: about 4x too slow here. The compute scales by the roofline's ratio, the
    all-reduces by the plan's bytes over the profile's on the same link."""
    spec = _COMPUTE_BOUND
    bf16 = _synthetic_tp2_profile(_WIDE, spec, "bf16")
    fp32_model = _WIDE.model_copy(update={"precision": "fp32"})
    link = tp_link(None, {spec.name: spec}, spec.name, 2)
    cal = GPUCalibration(gpu_type="*")
    got = layer_table(bf16, fp32_model, cal, {spec.name: spec}, spec.name, 2, 1)
    for layer in range(1, _WIDE.num_all_layers - 1):  # the blocks
        measured = bf16.timings[layer]
        held, _ = layer_comm_s(_WIDE, 2, 1, layer, link, True)
        assert 0.25 < held / measured.fwd_s < 0.5  # the all-reduces' share of the time
        roof = estimate_layer_timing(fp32_model, spec, 2, 1, layer)
        cf, cb = layer_comm_s(fp32_model, 2, 1, layer, link, True)
        assert got.layers[layer].fwd_s == pytest.approx(roof.fwd_s + cf, rel=1e-9)
        assert got.layers[layer].bwd_s == pytest.approx(roof.bwd_s + cb, rel=1e-9)
        assert got.layers[layer].estimated
    assert any("the TP all-reduces measured in them by the plan's bytes" in n for n in got.notes)
    # the same profile in the plan's precision is priced as measured
    same = layer_table(bf16, _WIDE, cal, {spec.name: spec}, spec.name, 2, 1)
    assert [c.fwd_s for c in same.layers] == [t.fwd_s for t in bf16.timings]


def test_another_precision_without_the_types_spec_is_refused() -> None:
    """An fp32 plan on bf16 profiles of a type the catalog does not know was priced at the
    bf16 time without a note (no spec: both peaks read as 0, 'equal'). Refused, naming the
    type and both precisions; fp16 against bf16 only when the spec gives them one peak."""
    bf16 = _synthetic_tp2_profile(_WIDE, _COMPUTE_BOUND, "bf16")
    cal = GPUCalibration(gpu_type="*")
    fp32_model = _WIDE.model_copy(update={"precision": "fp32"})
    with pytest.raises(ProfileLookupError, match=r"'A'.*profiled in bf16.*computes in fp32"):
        layer_table(bf16, fp32_model, cal, {}, "A", 2, 1)
    fp16_model = _WIDE.model_copy(update={"precision": "fp16"})
    with pytest.raises(ProfileLookupError, match="profiled in bf16"):
        layer_table(bf16, fp16_model, cal, {}, "A", 2, 1)
    # same peaks: fp16 and bf16 are one speed, priced as measured
    one = layer_table(bf16, fp16_model, cal, {"A": _COMPUTE_BOUND}, "A", 2, 1)
    assert [c.fwd_s for c in one.layers] == [t.fwd_s for t in bf16.timings]
    assert not any(c.estimated for c in one.layers)
    # a spec whose bf16 peak is half its fp16 one: scaled
    slow_bf16 = _COMPUTE_BOUND.model_copy(update={"peak_tflops_bf16": 50.0})
    two = layer_table(bf16, fp16_model, cal, {"A": slow_bf16}, "A", 2, 1)
    assert two.layers[1].fwd_s < bf16.timings[1].fwd_s
    assert any("profiled in bf16, priced in fp16" in n for n in two.notes)


def test_an_fp32_plan_at_an_unprofiled_tp_takes_the_bf16_all_reduces_out_in_bf16() -> None:
    """Rule 3 from a bf16 profile at TP 2 to an fp32 plan at TP 4 took the profile's
    all-reduces out in fp32 bytes against the fp32 roofline, whose share of the time then
    left them in (its floor): they were scaled with the compute, ~25 % slow here. In the
    profile's precision, the exact synthetic profile gives the fp32 roofline plus the fp32
    all-reduces at TP 4."""
    spec = _COMPUTE_BOUND
    bf16 = _synthetic_tp2_profile(_WIDE, spec, "bf16")
    fp32_model = _WIDE.model_copy(update={"precision": "fp32"})
    cal = GPUCalibration(gpu_type="*")
    got = layer_table(bf16, fp32_model, cal, {spec.name: spec}, spec.name, 4, 1)
    link = tp_link(None, {spec.name: spec}, spec.name, 4)
    for layer in range(1, _WIDE.num_all_layers - 1):
        roof = estimate_layer_timing(fp32_model, spec, 4, 1, layer)
        cf, cb = layer_comm_s(fp32_model, 4, 1, layer, link, True)
        assert got.layers[layer].fwd_s == pytest.approx(roof.fwd_s + cf, rel=1e-9)
        assert got.layers[layer].bwd_s == pytest.approx(roof.bwd_s + cb, rel=1e-9)
