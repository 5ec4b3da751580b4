"""The profiler and ``sailor check`` on a real GPU.

CPU counterparts: ``tests/unit/test_profiler_gpu_fit.py`` (the memory bound, the window, the
precision choice with the device query replaced) and ``tests/unit/test_node_check.py`` /
``tests/integration/test_node_check.py`` (the verdicts, the report, reachability).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch

from sailor import catalog
from sailor.catalog.cuda_names import UnknownGPUError, catalog_gpu_name
from sailor.megatron_patch.precision import native_bf16
from sailor.profiler import memory_bound as mb
from sailor.profiler.layers import LayerRun, profile_layers
from sailor.profiler.timing import RepeatSettings
from sailor.schemas.model import ModelSpec

FAST = RepeatSettings(warmup=1, min_reps=2, max_reps=3, min_time_s=0.0)


def _wide_model() -> ModelSpec:
    """Eight blocks of ~12.6 M parameters: ~1.6 GB of fp32 weights, gradients and AdamW state,
    more than the limit the test gives the profiler."""
    return catalog.model("tiny-gpt").model_copy(
        update={
            "name": "wide-gpt",
            "num_layers": 8,
            "hidden_size": 1024,
            "num_heads": 8,
            "ffn_hidden_size": 4096,
            "seq_length": 512,
            "vocab_size": 1024,
            "precision": "bf16",
        }
    )


def _gpu_type() -> str:
    props = torch.cuda.get_device_properties(0)
    try:
        return catalog_gpu_name(props.name, props.total_memory, catalog.gpus())
    except UnknownGPUError:
        return "gpu-under-test"


def test_profiler_measures_a_model_larger_than_its_share_within_the_bound(
    gpus: Callable[[int], None],
) -> None:
    """With a memory limit below the whole model's state the profiler measures a window of
    it; the GPU's peak allocation during the run stays within the limit, and every layer of
    the model has a timing."""
    gpus(1)
    spec = _wide_model()
    precision = "bf16" if native_bf16() else "fp16"
    whole = mb.window_bytes(spec, range(spec.num_all_layers), 1, 2, 2)
    limit = whole // 3
    run = LayerRun(
        spec=spec,
        gpu_type=_gpu_type(),
        device="cuda",
        mbs=(1, 2),
        settings=FAST,
        measure_overhead=False,
        memory_limit=limit,
    )
    dev = torch.device("cuda", 0)
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    db, _ = profile_layers(run)
    peak = torch.cuda.max_memory_allocated(dev) - base
    assert peak <= limit, f"allocated {peak:,} B over a limit of {limit:,} B (whole {whole:,} B)"
    layers = {(t.microbatch_size, t.layer) for t in db.timings}
    assert layers == {(m, i) for m in (1, 2) for i in range(spec.num_all_layers)}
    assert all(t.fwd_s > 0 and t.bwd_s > 0 for t in db.timings)
    assert {t.precision for t in db.timings} == {precision}


def test_sailor_check_passes_on_a_gpu_host(gpus: Callable[[int], None]) -> None:
    """Without a config: the GPUs, CUDA, NCCL and the one-node probe; every GPU named by its
    catalog type (or the line says which name is unknown)."""
    gpus(1)
    out = subprocess.run(
        [sys.executable, "-m", "sailor.cli.main", "check", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    report = json.loads(out.stdout)
    verdicts = {line["check"]: line["verdict"] for line in report["lines"]}
    assert verdicts.get("cuda") == "ok", report["lines"]
    assert report["facts"]["devices"], report["facts"]
    assert len(report["facts"]["devices"]) == torch.cuda.device_count()
    assert out.returncode == (0 if report["serves"] else 1)


@pytest.mark.parametrize("autocast", [True, False], ids=["autocast bf16", "fp32"])
@pytest.mark.parametrize("kind", ["embedding", "block", "head"])
def test_the_backward_peak_holds_the_weight_gradient_transient_on_cuda(
    gpus: Callable[[int], None], kind: str, autocast: bool
) -> None:
    """The simulator's weight copies + weight-gradient transient against the CUDA caching
    allocator's peak of one layer's forward and backward (the CPU test's bounds)."""
    gpus(1)
    from tests.unit.test_weight_grad_transient import check_peak

    check_peak(kind, autocast, torch.device("cuda", 0))


def test_the_link_probe_runs_pairs_of_nccl_ranks(gpus: Callable[[int], None]) -> None:
    """Two pairs of NCCL ranks on GPUs 0-3 of this host exchange half of each message each
    (``ProbeSettings.pairs``; between nodes, ``sailor profile network --pairs``): one point
    per size, the slowest pair's time. CPU counterpart: tests/unit/test_profiler_probe_pairs.py
    and the two-pair gloo probe in tests/integration/test_profiler_real.py."""
    gpus(4)
    from sailor.profiler.network_probe import ProbeSettings, probe_sizes, run_probe

    s = ProbeSettings(
        min_bytes=1 << 20, max_bytes=16 << 20, bytes_per_size=64 << 20, device="cuda", pairs=2
    )
    pts = run_probe(s)
    assert [p.nbytes for p in pts] == [n for n, _ in probe_sizes(s)]
    assert all(p.time.median_s > 0 and p.gbps > 0 for p in pts)
