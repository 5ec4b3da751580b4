"""Model FLOPs against a hand computation, MFU per GPU type, TensorBoard event round trip."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from sailor import catalog
from sailor.metrics import MetricsLogger, read_events, step_metrics
from sailor.metrics.flops import (
    flops_per_iteration_by_gpu_type,
    gpus_by_type,
    layer_flops_per_token,
    model_flops_per_token,
)
from sailor.metrics.tensorboard import EventFileWriter, crc32c, masked_crc32c
from sailor.metrics.throughput import mfu_by_gpu_type
from sailor.schemas.model import ModelSpec
from sailor.schemas.plan import Pipeline, Plan, ReplicaGroup, Stage

SPEC = ModelSpec(
    name="hand",
    num_layers=2,
    hidden_size=8,
    num_heads=2,
    ffn_hidden_size=32,
    seq_length=4,
    vocab_size=16,
    global_batch_size=4,
)


def test_flops_per_token_by_hand() -> None:
    # block: q,k,v 8x8 each + out 8x8 + mlp 8x32 + 32x8 = 192 + 64 + 512 = 768 weights
    #   forward 2*768 = 1536, attention 4*s*h = 4*4*8 = 128 -> 1664; training x3 = 4992
    # head: 2*h*v = 2*8*16 = 256 forward -> 768; embedding: 0
    assert layer_flops_per_token(SPEC, 0) == 0
    assert layer_flops_per_token(SPEC, 1) == layer_flops_per_token(SPEC, 2) == 4992
    assert layer_flops_per_token(SPEC, 3) == 768
    assert model_flops_per_token(SPEC) == 2 * 4992 + 768


def test_flops_match_palm_6n_plus_attention() -> None:
    """6 N (N = weights a token meets, embedding excluded) + 12 L h s (PaLM, appendix B)."""
    gqa = SPEC.model_copy(update={"num_kv_heads": 1, "activation": "swiglu"})
    for s in (SPEC, gqa):
        n_blocks = sum(
            s.layer_params(i)
            - (4 * s.hidden_size if s.norm == "layernorm" else 2 * s.hidden_size)  # norms
            - _biases(s)
            for i in range(1, s.num_layers + 1)
        )
        n = n_blocks + s.hidden_size * s.vocab_size
        expected = 6 * n + 12 * s.num_layers * s.hidden_size * s.seq_length
        assert model_flops_per_token(s) == expected


def _biases(s: ModelSpec) -> int:
    kv = s.kv_heads * s.head_dim
    attn = (s.hidden_size + 2 * kv) + s.hidden_size
    return attn + (s.ffn_hidden_size + s.hidden_size if s.activation != "swiglu" else 0)


def _stage(a: int, b: int, gpu: str, tp: int = 1) -> Stage:
    return Stage(
        first_layer=a,
        last_layer=b,
        replica=ReplicaGroup(gpu_type=gpu, zone="z", tp=tp, gpus_per_node=4),
    )


PLAN = Plan(
    model="hand",
    global_batch_size=4,
    pipelines=(
        Pipeline(
            stages=(_stage(0, 1, "A100-40"), _stage(2, 3, "L4", tp=2)),
            microbatch_size=1,
            num_microbatches=3,
        ),
        Pipeline(stages=(_stage(0, 3, "cpu"),), microbatch_size=1, num_microbatches=1),
    ),
)


def test_flops_and_mfu_per_gpu_type() -> None:
    flops = flops_per_iteration_by_gpu_type(PLAN, SPEC)
    tokens_p0, tokens_p1 = 3 * 4, 1 * 4
    assert flops["A100-40"] == tokens_p0 * 4992
    assert flops["L4"] == tokens_p0 * (4992 + 768)
    assert flops["cpu"] == tokens_p1 * model_flops_per_token(SPEC)
    assert sum(flops.values()) == 4 * 4 * model_flops_per_token(SPEC)
    assert gpus_by_type(PLAN) == {"A100-40": 1, "L4": 2, "cpu": 1}
    mfu = mfu_by_gpu_type(PLAN, SPEC, 0.5, "bf16", catalog.gpus())
    assert mfu["A100-40"] == pytest.approx(tokens_p0 * 4992 / 0.5 / 312e12)
    assert mfu["L4"] == pytest.approx(tokens_p0 * 5760 / 0.5 / (121e12 * 2))
    assert mfu["cpu"] is None  # no meaningful peak
    t4 = PLAN.model_copy(
        update={
            "pipelines": (
                Pipeline(stages=(_stage(0, 3, "T4"),), microbatch_size=4, num_microbatches=1),
            )
        }
    )
    # T4 has no bf16 units: its fp16 peak stands in
    assert mfu_by_gpu_type(t4, SPEC, 1.0, "bf16", catalog.gpus())["T4"] == pytest.approx(
        16 * model_flops_per_token(SPEC) / 65e12
    )
    assert mfu_by_gpu_type(t4, SPEC, 1.0, "fp16", {})["T4"] is None  # unknown type
    with pytest.raises(ValueError, match="step_s=0"):
        mfu_by_gpu_type(PLAN, SPEC, 0.0, "bf16", catalog.gpus())


def test_step_metrics() -> None:
    m = step_metrics(
        PLAN, SPEC, step=7, step_s=0.25, loss=2.0, lr=1e-3, precision="bf16", specs=catalog.gpus()
    )
    assert m["tokens_per_s"] == 4 * 4 / 0.25 and m["samples_per_s"] == 16
    assert m["mfu/cpu"] is None and isinstance(m["mfu/A100-40"], float)
    assert (m["step"], m["loss"], m["lr"]) == (7, 2.0, 1e-3)


def test_crc32c_known_values() -> None:
    assert crc32c(b"") == 0
    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value
    assert crc32c(bytes(32)) == 0x8A9136AA  # RFC 3720 B.4: 32 bytes of zeros
    assert masked_crc32c(b"") == 0xA282EAD8


def test_event_file_round_trip(tmp_path: Path) -> None:
    w = EventFileWriter(tmp_path)
    w.add_scalars(1, {"loss": 3.5, "lr": 1e-3, "mfu/cpu": None}, wall_time=100.0)
    w.add_scalars(2, {"loss": 3.25}, wall_time=101.0)
    w.add_scalars(3, {"skipped": None})  # nothing to write
    w.close()
    assert "tfevents" in w.path.name
    events = read_events(w.path)
    assert events[0].file_version == "brain.Event:2" and events[0].scalars == {}
    assert [(e.step, e.wall_time) for e in events[1:]] == [(1, 100.0), (2, 101.0)]
    assert events[1].scalars == {"loss": 3.5, "lr": pytest.approx(1e-3)}
    assert events[2].scalars == {"loss": 3.25}


def test_corrupt_event_file_is_refused_with_offset(tmp_path: Path) -> None:
    w = EventFileWriter(tmp_path)
    w.add_scalars(1, {"loss": 1.0}, wall_time=1.0)
    w.close()
    raw = bytearray(w.path.read_bytes())
    (first_len,) = struct.unpack_from("<Q", raw, 0)
    second = 12 + first_len + 4
    bad = bytearray(raw)
    bad[second + 14] ^= 0xFF  # inside the second record's data
    w.path.write_bytes(bytes(bad))
    with pytest.raises(ValueError, match=f"at byte {second + 12}: data CRC mismatch"):
        read_events(w.path)
    w.path.write_bytes(bytes(raw[:-3]))
    with pytest.raises(ValueError, match=f"at byte {second}: record of .* truncated"):
        read_events(w.path)


def test_tensorboard_reads_our_file(tmp_path: Path) -> None:
    ea = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator",
        reason="tensorboard is not installed (not a dependency); our own reader checks above",
    )
    w = EventFileWriter(tmp_path)
    w.add_scalars(5, {"loss": 2.5})
    w.close()
    acc = ea.EventAccumulator(str(tmp_path))
    acc.Reload()
    assert [(s.step, s.value) for s in acc.Scalars("loss")] == [(5, 2.5)]


def test_metrics_logger_writes_both(tmp_path: Path) -> None:
    log = MetricsLogger(tmp_path / "m.jsonl", tmp_path / "tb")
    log.log(1, {"loss": 2.0, "mfu/cpu": None, "tokens_per_s": 100.0})
    log.log(2, {"loss": 1.5, "mfu/cpu": None, "tokens_per_s": 120.0})
    tb = log.tensorboard_file
    log.close()
    lines = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2] and lines[0]["mfu/cpu"] is None
    assert tb is not None
    ev = read_events(tb)
    assert [e.scalars for e in ev[1:]] == [
        {"loss": 2.0, "tokens_per_s": 100.0},
        {"loss": 1.5, "tokens_per_s": 120.0},
    ]
