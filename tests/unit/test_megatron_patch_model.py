"""Single-process checks of the model, data and checkpoint interface (no process group)."""

from __future__ import annotations

import pytest
import torch

from sailor.megatron_patch.data import SyntheticTokens, microbatch_indices
from sailor.megatron_patch.engine import TrainConfig
from sailor.megatron_patch.errors import InjectedFailureError, classify, failure_record
from sailor.megatron_patch.model import TINY_MODELS, GPTStage, full_init, shard, tiny_model
from sailor.megatron_patch.reference import train_reference
from sailor.megatron_patch.roles import role_of
from sailor.megatron_patch.state import gather_full, load_full_state, stage_state
from sailor.schemas.plan import Pipeline, Plan, ReplicaGroup, Stage


@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_stage_params_keyed_by_global_layer_and_count_matches_spec(name: str) -> None:
    spec = tiny_model(name)
    full = GPTStage(spec, 0, spec.num_all_layers - 1)
    keys = [k for k, _ in full.keyed_parameters()]
    assert "0.wte.weight" in keys and f"{spec.num_all_layers - 1}.lm_head.weight" in keys
    assert "1.attn_q.weight" in keys
    for layer in range(spec.num_all_layers):
        n = sum(p.numel() for k, p in full.keyed_parameters() if k.split(".")[0] == str(layer))
        assert n == spec.layer_params(layer), (name, layer)
    part = GPTStage(spec, 2, 3)
    assert {k.split(".")[0] for k, _ in part.keyed_parameters()} == {"2", "3"}


def test_stages_compose_to_the_full_model() -> None:
    spec = tiny_model("tiny-llama")
    x, y = SyntheticTokens(spec.vocab_size, spec.seq_length).batch(range(3))
    full = GPTStage(spec, 0, spec.num_all_layers - 1)
    a, b = GPTStage(spec, 0, 2), GPTStage(spec, 3, spec.num_all_layers - 1, recompute=True)
    assert torch.equal(full(x, y), b(a(x), y))


def test_init_is_layout_free_and_sharding_round_trips() -> None:
    spec = tiny_model("tiny-gpt")
    w = full_init(spec, "2.attn_q.weight", (32, 32), seed=3)
    assert torch.equal(w, full_init(spec, "2.attn_q.weight", (32, 32), seed=3))
    assert not torch.equal(w, full_init(spec, "3.attn_q.weight", (32, 32), seed=3))
    tied = full_init(spec, "5.lm_head.weight", (64, 32), seed=3)
    assert torch.equal(tied, full_init(spec, "0.wte.weight", (64, 32), seed=3))
    parts = [shard(w, 1, 4, r) for r in range(4)]
    assert torch.equal(gather_full(parts, 1), w)
    assert shard(w, None, 4, 2) is w


def test_stage_state_reports_tp_dims_and_loads_full_tensors() -> None:
    spec = tiny_model("tiny-gpt")
    src = GPTStage(spec, 1, 2, seed=7)
    st = stage_state(src)
    assert st["1.attn_q.weight"][1] == 0
    assert st["1.attn_out.weight"][1] == 1
    assert st["1.attn_out.bias"][1] is None
    assert st["2.ln1.weight"][1] is None
    dst = GPTStage(spec, 1, 2, seed=8)
    load_full_state(dst, {k: t for k, (t, _) in st.items()})
    for k, (t, _) in stage_state(dst).items():
        assert torch.equal(t, st[k][0])
    with pytest.raises(KeyError):
        load_full_state(dst, {})


def test_data_is_a_pure_function_of_the_position() -> None:
    ds = SyntheticTokens(64, 16, seed=1)
    assert torch.equal(ds.sample(10), SyntheticTokens(64, 16, seed=1).sample(10))
    assert not torch.equal(ds.sample(10), ds.sample(11))
    x, y = ds.batch([4, 5])
    assert x.shape == (2, 16) and torch.equal(x[:, 1:], y[:, :-1])
    plan = Plan(
        model="tiny-gpt",
        global_batch_size=6,
        pipelines=(
            Pipeline(stages=(_st(0, 5),), microbatch_size=1, num_microbatches=2),
            Pipeline(stages=(_st(0, 5),), microbatch_size=2, num_microbatches=2),
        ),
    )
    r1 = role_of(plan, 1)
    assert microbatch_indices(r1, 60, 1) == range(64, 66)
    with pytest.raises(ValueError):
        microbatch_indices(r1, 0, 2)


def _st(a: int, b: int) -> Stage:
    return Stage(first_layer=a, last_layer=b, replica=ReplicaGroup(gpu_type="A", zone="z"))


def test_reference_loss_falls_and_is_deterministic() -> None:
    spec = tiny_model("tiny-gpt")
    cfg = TrainConfig(lr=3e-3)
    a = train_reference(spec, 8, 8, cfg)
    b = train_reference(spec, 8, 8, cfg, microbatch_size=2)
    assert a.losses[-1] < a.losses[0]
    assert a.losses == pytest.approx(b.losses, rel=1e-5)


def test_failure_classification() -> None:
    assert classify(InjectedFailureError("x"), True) == "local"
    assert classify(RuntimeError("Connection closed by peer [127.0.0.1]:1"), True) == "peer"
    assert classify(ValueError("bad plan"), False) == "config"
    # NCCL's own texts: a peer's failure, and this rank's (which say "nccl" too)
    nccl = "NCCL error in: ProcessGroupNCCL.cpp:2100, {}, NCCL version 2.21.5"
    for peer in (
        "remote process exited or there was a network error",
        "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE)",
    ):
        assert classify(RuntimeError(nccl.format(peer)), True) == "peer", peer
    for own in (
        "unhandled cuda error (run with NCCL_DEBUG=INFO for details)",
        "invalid usage (run with NCCL_DEBUG=WARN for details)",
        "invalid argument (run with NCCL_DEBUG=WARN for details)",
        "CUDA error: out of memory",
        "CUDA error: an illegal memory access was encountered",
    ):
        assert classify(RuntimeError(nccl.format(own)), True) == "local", own
    assert (
        classify(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate"), True) == "local"
    )
    rec = failure_record(KeyError("k"), rank=3, step=2, in_training=True)
    assert rec["origin"] == "local" and rec["retry"] and rec["rank"] == 3
