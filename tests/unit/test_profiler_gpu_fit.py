"""What the profiler does differently on a GPU, checked on the CPU: the precision it computes
in, the memory bound it measures within, and the all-reduce fit of the collective probe."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from sailor import catalog
from sailor.profiler import memory_bound as mb
from sailor.profiler import precision as prec
from sailor.profiler.collective_probe import fit_allreduce, sweep_sizes
from sailor.profiler.layer_bench import measure_kinds
from sailor.profiler.layer_measurement import LayerMeasurement
from sailor.profiler.layers import LayerRun, profile_layers
from sailor.profiler.memory import peak_growth_bytes
from sailor.profiler.timing import RepeatSettings
from sailor.schemas import LayerProfile, ModelSpec, ProfileDB, ReplicaGroup

TINY = catalog.model("tiny-gpt")
FAST = RepeatSettings(warmup=1, min_reps=1, max_reps=1, min_time_s=0.0)
CPU = torch.device("cpu")


# --- precision (issue 24, item 6) -------------------------------------------------------------


@pytest.mark.parametrize(
    ("device", "model_precision", "bf16", "want"),
    [
        ("cuda", "fp16", True, "bf16"),
        ("cuda", "bf16", True, "bf16"),
        ("cuda", "fp16", False, "fp16"),  # V100, T4, Titan RTX, RTX 2080: no bf16 units
        ("cuda", "bf16", False, "fp16"),
        ("cuda", "fp32", True, "fp32"),
        ("cpu", "fp16", True, "fp32"),
        ("cpu", "bf16", False, "fp32"),
    ],
)
def test_precision_follows_the_device(
    device: str, model_precision: str, bf16: bool, want: str
) -> None:
    spec = TINY.model_copy(update={"precision": model_precision})
    assert prec.compute_precision(spec, torch.device(device), lambda: bf16) == want


def test_precision_asks_the_gpu_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without an explicit query, the CUDA capability decides (bf16 emulation does not count)."""
    seen: list[bool] = []

    def query(including_emulation: bool = True) -> bool:
        seen.append(including_emulation)
        return False

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", query)
    fp16_model = TINY.model_copy(update={"precision": "fp16"})
    assert prec.compute_precision(fp16_model, torch.device("cuda", 0)) == "fp16"
    assert seen == [False]
    with prec.autocast(torch.device("cpu"), "fp32"):
        assert not torch.is_autocast_enabled("cpu")
    with prec.autocast(torch.device("cpu"), "bf16"):
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16


def test_layers_are_timed_in_the_precision_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both measurements (in place and alone) run their forward under the autocast dtype the
    device's precision names: a GPU without bf16 gets fp16 (CPU autocast stands in for it)."""
    from sailor.profiler import in_situ, layer_bench

    real = torch.autocast
    used: list[tuple[str, torch.dtype]] = []

    def recording(device_type: str, dtype: torch.dtype) -> Any:
        used.append((device_type, dtype))
        return real(device_type=device_type, dtype=dtype)

    def no_bf16(spec: ModelSpec, device: torch.device) -> prec.ComputePrecision:
        return prec.compute_precision(spec, torch.device("cuda"), lambda: False)

    monkeypatch.setattr(torch, "autocast", recording)
    monkeypatch.setattr(in_situ, "compute_precision", no_bf16)
    monkeypatch.setattr(layer_bench, "compute_precision", no_bf16)
    fp16_model = TINY.model_copy(update={"precision": "fp16"})
    measure_kinds(fp16_model, 1, CPU, FAST, measure_memory=False)
    assert used and set(used) == {("cpu", torch.float16)}
    used.clear()
    measure_kinds(fp16_model, 1, CPU, FAST, in_situ=False, measure_memory=False)
    assert used and set(used) == {("cpu", torch.float16)}


def test_profile_records_its_precision() -> None:
    """The database says what the layers computed in (fp32 on the CPU)."""
    from sailor.profiler.layers import to_profile_db
    from sailor.profiler.timing import Stats

    st = Stats.of([1e-3])
    ms = [
        LayerMeasurement(
            kind=TINY.layer_kind(i),
            tp=1,
            mbs=1,
            fwd=st,
            bwd=st,
            update=st,
            params=1,
            saved_bytes=0,
            output_bytes=0,
            input_bytes=0,
            peak_growth_bytes=0,
            layer=i,
        )
        for i in range(TINY.num_all_layers)
    ]
    db = to_profile_db(TINY, "T4", ms, {}, precision="fp16")
    assert {t.precision for t in db.timings} == {"fp16"}
    assert LayerProfile.model_fields["precision"].default is None  # older files still load


# --- the memory bound (issue 24, item 3) ------------------------------------------------------


class _Built:
    """Every stage the profiler builds: (first layer, last layer, model blocks, parameters)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from sailor.megatron_patch.model import GPTStage
        from sailor.profiler import in_situ, layer_bench

        self.stages: list[tuple[int, int, int, int]] = []
        built = self.stages

        class Recording(GPTStage):
            def __init__(self, spec: ModelSpec, first: int, last: int, **kw: Any) -> None:
                super().__init__(spec, first, last, **kw)
                n = sum(p.numel() for p in self.parameters())
                built.append((first, last, spec.num_layers, n))

        monkeypatch.setattr(in_situ, "GPTStage", Recording)
        monkeypatch.setattr(layer_bench, "GPTStage", Recording)


@pytest.mark.parametrize("name", ["tiny-gpt", "tiny-llama"])
def test_estimate_bounds_what_the_layers_hold(name: str) -> None:
    """The estimate is an upper bound of what autograd keeps per layer, of each layer's peak
    alone and of the whole model's peak allocation, measured on the CPU."""
    spec = catalog.model(name)
    for mbs in (1, 4):
        ms = measure_kinds(spec, mbs, CPU, FAST, measure_memory=True)
        for m in ms:
            est = mb.layer_bytes(spec, m.layer, 1, 4)
            assert m.saved_bytes <= mbs * est.kept_per_sample, (m.layer, m.saved_bytes)
            assert m.peak_growth_bytes <= est.alone(mbs), (m.layer, m.peak_growth_bytes)
        whole = mb.window_bytes(spec, range(spec.num_all_layers), 1, mbs, 4)
        peak = peak_growth_bytes(
            lambda b=mbs: measure_kinds(spec, b, CPU, FAST, measure_memory=False), CPU
        )
        assert 0 < peak <= whole


def test_window_is_measured_within_the_bound_with_the_whole_structure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With a limit the whole model exceeds, the profiler builds the embedding, the blocks that
    fit and the head; what it allocates stays within the limit, and the database has every
    layer of every (TP, mbs), with the sizes of the whole-model run."""
    mbs = (1, 4)
    limit = mb.window_bytes(TINY, mb.window_layers(TINY, 2), 1, max(mbs), 4)
    assert mb.window_bytes(TINY, range(TINY.num_all_layers), 1, max(mbs), 4) > limit

    def run(memory_limit: int | None) -> LayerRun:
        return LayerRun(
            spec=TINY,
            gpu_type="cpu",
            mbs=mbs,
            settings=FAST,
            measure_memory=False,
            measure_overhead=False,
            memory_limit=memory_limit,
        )

    wbox: list[ProfileDB] = []
    whole_peak = peak_growth_bytes(lambda: wbox.append(profile_layers(run(None))[0]), CPU)
    whole = wbox[0]
    assert whole_peak > limit  # the whole model, as measured before the bound, exceeds it
    built = _Built(monkeypatch)
    box: list[tuple[ProfileDB, list[LayerMeasurement]]] = []
    peak = peak_growth_bytes(lambda: box.append(profile_layers(run(limit))), CPU)
    bounded, ms = box[0]
    # mbs 4: embedding, block 1, the window's last block as block 4 (before the head), head,
    # and the interior block as the per-kind entry for blocks 2 and 3
    assert [m.layer for m in ms if m.mbs == 4] == [0, 1, 4, 5, -1]
    assert [m.layer for m in ms if m.mbs == 1] == [0, 1, 2, 4, 5, -1]
    # one window per mbs: 3 blocks fit at mbs 1, 2 at mbs 4; never the whole model's 4
    assert [blocks for _, _, blocks, _ in built.stages] == [3, 2]
    assert max(n for *_, n in built.stages) * mb.STATE_BYTES_PER_PARAM <= limit
    assert 0 < peak <= limit, f"allocated {peak:,} B over a limit of {limit:,} B"

    def keys(db: ProfileDB) -> list[tuple[str, int, int, int, str]]:
        return sorted((t.gpu_type, t.tp, t.microbatch_size, t.layer, t.kind) for t in db.timings)

    assert keys(bounded) == keys(whole)
    assert len(keys(whole)) == len(mbs) * TINY.num_all_layers
    assert [s.model_dump() for s in bounded.sizes] == [s.model_dump() for s in whole.sizes]
    assert all(t.fwd_s > 0 and t.bwd_s > 0 for t in bounded.timings)
    assert "2 of 4 blocks" in bounded.meta["cpu.memory_bound"]


def test_layer_too_large_alone_is_refused_with_the_numbers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A layer that cannot fit even alone is refused before anything is built, naming the
    layer, the bytes it needs and the bytes available."""
    block = mb.layer_bytes(TINY, 1, 1, 4).alone(8)
    built = _Built(monkeypatch)
    run = LayerRun(
        spec=TINY, gpu_type="cpu", settings=FAST, measure_overhead=False, memory_limit=block - 1
    )
    with pytest.raises(mb.LayerTooLargeError) as err:
        profile_layers(run)
    assert (err.value.layer, err.value.kind, err.value.mbs) == (1, "block", 8)
    assert err.value.needed == block and err.value.available == block - 1
    assert f"{block:,} B" in str(err.value) and f"{block - 1:,} B" in str(err.value)
    assert "layer 1 (block)" in str(err.value)
    assert built.stages == []


def test_catalog_models_get_a_window_on_catalog_gpus() -> None:
    """The models the issue names: GPT-Neo-2.7B on a 40 GB card, an 8B Llama and OPT-30B on
    80 GB are measured through a window, not built whole."""
    for name, gpu, mbs in (
        ("GPT-Neo-2.7", "A100-40", 8),
        ("LLAMA-3-8", "H100-80", 1),
        ("OPT-30", "A100-80", 4),
    ):
        spec = catalog.model(name)
        budget = int(catalog.gpu(gpu).memory_bytes * (1 - mb.MARGIN_FRACTION))
        w = mb.plan_window(spec, 1, mbs, 2, budget)
        assert 1 <= w.blocks < spec.num_layers and w.needed_bytes <= budget, (name, w)
    llama = catalog.model("LLAMA-3-8")
    with pytest.raises(mb.LayerTooLargeError, match=r"layer 33 \(head\)"):
        mb.plan_window(llama, 1, 8, 2, 80 << 30)  # its logits at mbs 8 alone exceed 80 GB


def test_cli_memory_limit_and_in_situ_switch(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from sailor.cli.main import app

    out = tmp_path / "db.json"
    res = CliRunner().invoke(
        app,
        ["profile", "layers", "-o", str(out), "--memory-limit", "1KiB", "--no-in-situ"],
    )
    assert res.exit_code != 0
    assert "available" in res.output and "1,024 B" in res.output
    bad = CliRunner().invoke(app, ["profile", "layers", "-o", str(out), "--memory-limit", "x"])
    assert bad.exit_code != 0 and "--memory-limit='x'" in bad.output


# --- the collective probe and the rings it prices (issue 24, item 11) ---------------------------


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_allreduce_fit_recovers_latency_and_bandwidth(ranks: int) -> None:
    """Synthetic NCCL-like sweep: 40 us + 2(n-1)/n B at 150 GB/s, with ±3 % noise."""
    rng = random.Random(ranks)
    lat, bus = 40e-6, 150.0
    sizes = sweep_sizes("cuda")
    assert min(sizes) <= 1 << 10 and max(sizes) >= 64 << 20  # the sweep reaches the bandwidth
    pts = [
        (b, (lat + 2 * (ranks - 1) / ranks * b / (bus * 1e9)) * rng.uniform(0.97, 1.03))
        for b in sizes
    ]
    fit = fit_allreduce(ranks, pts)
    assert fit.bus_gbps == pytest.approx(bus, rel=0.05)
    assert fit.latency_s == pytest.approx(lat, rel=0.5, abs=20e-6)
    exact = fit_allreduce(ranks, [(b, lat + 2 * (ranks - 1) / ranks * b / 150e9) for b in sizes])
    assert exact.latency_s == pytest.approx(lat) and exact.bus_gbps == pytest.approx(bus)
    # the first version's two latency-bound sizes: 256 KiB and 4 MiB at NCCL's latency of
    # ~40 us and a small-message protocol half as fast; the sweep's line is not fooled by them
    flat = [(b, t) for b, t in pts if b > 64 << 20] + [(256 << 10, 60e-6), (4 << 20, 100e-6)]
    assert fit_allreduce(ranks, flat).bus_gbps == pytest.approx(bus, rel=0.1)
    # times that do not grow: no bandwidth; a negative intercept is clamped
    assert fit_allreduce(ranks, [(1 << 10, 1e-3), (1 << 20, 1e-3)]).bus_gbps is None
    neg = fit_allreduce(2, [(1 << 20, 1e-6), (1 << 24, 1.6e-4)])
    assert neg.latency_s == 0.0 and neg.bus_gbps is not None and neg.bus_gbps > 0


def _ring(node_ids: list[str]) -> list[ReplicaGroup]:
    return [ReplicaGroup(gpu_type="A", zone="z-a", gpus_per_node=8, node_id=n) for n in node_ids]


def test_ring_across_nodes_is_not_priced_with_the_intra_node_probe() -> None:
    """The probe of one node's GPUs (NVLink: 5 us, 200 GB/s) must not price a data-parallel
    ring over nodes; it takes the inter-node links, or an inter-node measurement."""
    from sailor.schemas import BandwidthCurve, Endpoint, Link, NetworkProfile
    from sailor.schemas.calibration import LinkEta
    from sailor.schemas.network import CollectiveLatency
    from sailor.simulator.network_model import ring_allreduce, ring_scope

    ep = Endpoint(zone="z-a", gpu_type="A", gpus_per_node=8)
    nic = BandwidthCurve(coeffs=(0, 0, 5.0), max_gbps=5.0, latency_s=50e-6)
    links = NetworkProfile(links=(Link(src=ep, dst=ep, curve=nic),))
    nvlink = CollectiveLatency(endpoint=ep, ranks=4, latency_s=5e-6, bus_gbps=200.0)
    assert nvlink.scope == "intra_node"  # the loopback/one-node probe, as before this field
    probed = links.model_copy(update={"collectives": (nvlink,)})
    nbytes = 64e6
    across = _ring(["", "", "", ""])  # unplaced: each on a node of its own
    assert ring_scope(across) == "inter_node"
    assert ring_scope(_ring(["n1", "n2", "n1", "n1"])) == "inter_node"
    plain = ring_allreduce(links, across, nbytes, 16e6, LinkEta.as_read(1.0)).time_s
    assert plain == pytest.approx(6 * (50e-6 + nbytes / 4 / 5e9))
    assert ring_allreduce(
        probed, across, nbytes, 16e6, LinkEta.as_read(1.0)
    ).time_s == pytest.approx(plain)
    spread = _ring(["n1", "n2", "n3", "n4"])
    assert ring_allreduce(
        probed, spread, nbytes, 16e6, LinkEta.as_read(1.0)
    ).time_s == pytest.approx(plain)
    # four groups on one node: the intra-node probe applies (latency once, its bus bandwidth)
    one_node = _ring(["n1"] * 4)
    assert ring_scope(one_node) == "intra_node"
    assert ring_allreduce(
        probed, one_node, nbytes, 16e6, LinkEta.as_read(1.0)
    ).time_s == pytest.approx(5e-6 + 2 * 3 / 4 * nbytes / 200e9)
    # an inter-node measurement (sailor profile network --rank 0|1) prices the spanning ring
    ib = CollectiveLatency(endpoint=ep, ranks=2, latency_s=30e-6, bus_gbps=20.0, scope="inter_node")
    both = links.model_copy(update={"collectives": (nvlink, ib)})
    assert ring_allreduce(both, across, nbytes, 16e6, LinkEta.as_read(1.0)).time_s == pytest.approx(
        30e-6 * 3 + 2 * 3 / 4 * nbytes / 20e9  # latency scaled from 2 to 4 ranks
    )
    assert ring_allreduce(
        both, one_node, nbytes, 16e6, LinkEta.as_read(1.0)
    ).time_s == pytest.approx(5e-6 + 2 * 3 / 4 * nbytes / 200e9)


def test_cuda_budget_is_the_free_memory_less_a_margin(monkeypatch: pytest.MonkeyPatch) -> None:
    """On cuda the window is planned from each GPU's free memory (the least of the GPUs a TP
    degree uses) less the margin; an explicit limit can only lower it. The TP 1 pass gives
    its cached memory back before the TP > 1 ranks start."""
    from sailor.profiler import layers

    total = 40 << 30
    free = {0: 38 << 30, 1: 30 << 30}
    asked: list[int] = []

    def mem_get_info(i: int) -> tuple[int, int]:
        asked.append(i)
        return free[i], total

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    neo = catalog.model("GPT-Neo-2.7")
    run = LayerRun(spec=neo, gpu_type="A100-40", device="cuda", tps=(1, 2), mbs=(1, 8))
    windows = layers.plan_windows(run, "bf16")
    margin = max(mb.MARGIN_BYTES, int(mb.MARGIN_FRACTION * total))
    assert windows[(1, 8)].limit_bytes == free[0] - margin
    assert windows[(2, 8)].limit_bytes == free[1] - margin  # the TP 2 ranks use GPUs 0 and 1
    assert set(asked) == {0, 1}
    assert 0 < windows[(1, 8)].blocks < windows[(1, 1)].blocks <= neo.num_layers
    assert all(w.needed_bytes <= (w.limit_bytes or 0) for w in windows.values())
    capped = LayerRun(spec=neo, gpu_type="A100-40", device="cuda", mbs=(8,), memory_limit=16 << 30)
    assert layers.plan_windows(capped, "bf16")[(1, 8)].limit_bytes == 16 << 30
    four = LayerRun(spec=neo, gpu_type="A100-40", device="cuda", tps=(4,), mbs=(1,))
    with pytest.raises(ValueError, match="needs GPU 2, but this host has 2"):
        layers.plan_windows(four, "bf16")  # refused before asking a GPU it does not have

    emptied: list[bool] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    layers._release(torch.device("cpu"))
    assert emptied == []
    layers._release(torch.device("cuda", 0))
    assert emptied == [True]
