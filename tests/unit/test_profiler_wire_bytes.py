"""The profiler records what crosses a stage boundary in the engine's wire dtype.

Under autocast a block's output stays fp32 (the residual stream), but the engine sends
activations in the compute dtype (``schemas.precision.wire_bytes``): a 16-bit GPU profile
that counted 4 B per element doubled every plan's pipeline traffic. CPU autocast in bf16
stands in for a GPU's 16-bit compute here."""

from __future__ import annotations

import pytest
import torch

from sailor import catalog
from sailor.profiler import in_situ, layer_bench
from sailor.profiler.timing import RepeatSettings

ONE = RepeatSettings(warmup=0, min_reps=1, max_reps=1, min_time_s=0.0)


@pytest.mark.parametrize(("precision", "wire"), [("fp32", 4), ("bf16", 2)])
def test_layer_bench_counts_the_wire_dtype(
    monkeypatch: pytest.MonkeyPatch, precision: str, wire: int
) -> None:
    monkeypatch.setattr(layer_bench, "compute_precision", lambda *_a, **_k: precision)
    spec = catalog.model("tiny-gpt")
    m = layer_bench.measure_layer(spec, "block", 2, torch.device("cpu"), ONE, measure_memory=False)
    elems = 2 * spec.seq_length * spec.hidden_size
    assert m.output_bytes == elems * wire
    assert m.input_bytes == elems * wire
    emb = layer_bench.measure_layer(
        spec, "embedding", 2, torch.device("cpu"), ONE, measure_memory=False
    )
    assert emb.input_bytes == 2 * spec.seq_length * 8  # token ids (int64) as they are


@pytest.mark.parametrize(("precision", "wire"), [("fp32", 4), ("bf16", 2)])
def test_in_situ_counts_the_wire_dtype(
    monkeypatch: pytest.MonkeyPatch, precision: str, wire: int
) -> None:
    monkeypatch.setattr(in_situ, "compute_precision", lambda *_a, **_k: precision)
    spec = catalog.model("tiny-gpt")
    ms = in_situ.measure_model(spec, 1, torch.device("cpu"), ONE)
    elems = spec.seq_length * spec.hidden_size
    assert [m.output_bytes for m in ms[:-1]] == [elems * wire] * (len(ms) - 1)
    assert ms[-1].output_bytes == 0
    assert [m.input_bytes for m in ms[1:]] == [elems * wire] * (len(ms) - 1)
