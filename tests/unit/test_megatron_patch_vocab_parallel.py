"""The vocabulary split over TP ranks: padding, and the lookup and loss against TP 1.

The TP runs are real gloo process groups; each rank builds the embedding-only and head-only
stages of a tiny model at TP ``t`` and compares its loss, its output and its shard's
gradients with the TP-1 stages' (the single-process model) on the same inputs.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from sailor.megatron_patch.model import GPTStage, tiny_model
from sailor.megatron_patch.tp_layers import TPContext, tp_dim_of
from sailor.megatron_patch.vocab_parallel import (
    IGNORE_INDEX,
    VOCAB_MULTIPLE,
    LabelOutOfRangeError,
    check_labels,
    pad_rows,
    padded_vocab,
    real_rows,
    rows_per_rank,
    unpad_rows,
    vocab_cross_entropy,
)
from sailor.schemas.model import ModelSpec
from tests.spawn import spawn


def test_padding_rounds_up_to_the_multiple() -> None:
    assert padded_vocab(64) == 64
    assert padded_vocab(50257) == 50304  # GPT-2
    assert padded_vocab(50272) == 50304  # OPT
    assert padded_vocab(128256) == 128256  # Llama 3
    for v in (1, 63, 65, 1000):
        p = padded_vocab(v)
        assert p % VOCAB_MULTIPLE == 0 and v <= p < v + VOCAB_MULTIPLE


def test_pad_and_unpad_are_inverse_and_check_rows() -> None:
    full = torch.randn(50, 3)
    padded = pad_rows(full, 50)
    assert padded.shape == (64, 3) and not padded[50:].any()
    assert torch.equal(unpad_rows(padded, 50), full)
    with pytest.raises(ValueError, match="vocab_size=49"):
        pad_rows(full, 49)
    assert torch.equal(unpad_rows(full, 50), full)  # an older checkpoint's unpadded matrix
    with pytest.raises(ValueError, match="padded 64"):
        unpad_rows(torch.randn(51, 3), 50)


def test_rows_per_rank_and_real_rows() -> None:
    assert rows_per_rank(40, TPContext()) == 64
    # vocab 40 padded to 64 over 4 ranks: 16 each; rank 2 holds 8 real rows, rank 3 none
    assert [real_rows(40, 16, r) for r in range(4)] == [16, 16, 8, 0]
    with pytest.raises(ValueError, match="TP degree 128 does not divide"):
        rows_per_rank(40, TPContext(size=128, rank=0, group=object()))


def _spec(vocab: int, tied: bool) -> ModelSpec:
    return tiny_model("tiny-gpt").model_copy(update={"vocab_size": vocab, "tie_embeddings": tied})


def _run_stage(
    spec: ModelSpec, layer: int, tp: TPContext, x: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor | None]:
    stage = GPTStage(spec, layer, layer, tp=tp, seed=3)
    x = x.clone().requires_grad_(x.is_floating_point())
    out = stage(x, labels)
    if out.dim() == 0:
        out.backward()
    else:
        out.backward(torch.ones_like(out) * torch.arange(out.numel()).reshape(out.shape) / 97)
    grads = {n: p.grad.detach().clone() for n, p in stage.keyed_parameters() if p.grad is not None}
    return out.detach(), grads, x.grad


def _tp_worker(rank: int, world: int, store: str, vocab: int, tied: bool) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        spec = _spec(vocab, tied)
        tp = TPContext(size=world, rank=rank, group=dist.group.WORLD)
        gen = torch.Generator().manual_seed(11)
        b, s, h = 2, spec.seq_length, spec.hidden_size
        tokens = torch.randint(0, vocab, (b, s), generator=gen)
        labels = torch.randint(0, vocab, (b, s), generator=gen)
        labels[0, :3] = vocab - 1  # the last real row (held by a padded shard)
        labels[1, :4] = IGNORE_INDEX  # left out of the loss at every TP degree
        hidden = torch.randn(b, s, h, generator=gen)
        for layer in (0, spec.num_all_layers - 1):
            inp = tokens if layer == 0 else hidden
            ref_out, ref_grads, ref_dx = _run_stage(spec, layer, TPContext(), inp, labels)
            out, grads, dx = _run_stage(spec, layer, tp, inp, labels)
            torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
            if dx is not None:
                assert ref_dx is not None
                torch.testing.assert_close(dx, ref_dx, rtol=1e-5, atol=1e-7)
            stage = GPTStage(spec, layer, layer, tp=tp, seed=3)
            for name, p in stage.keyed_parameters():
                dim = tp_dim_of(p)
                want = ref_grads[name]
                if dim is not None:
                    want = want.chunk(world, dim=dim)[rank]
                torch.testing.assert_close(grads[name], want, rtol=1e-5, atol=1e-7)
                if name.endswith(("wte.weight", "lm_head.weight")):
                    assert dim == 0 and p.shape[0] == padded_vocab(vocab) // world
                    # padding rows: zero at init, and never a gradient
                    real = real_rows(vocab, p.shape[0], rank)
                    assert not p.detach()[real:].any() and not grads[name][real:].any()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("world", "vocab", "tied"),
    [
        (2, 64, True),  # no padding, tied
        (2, 50, False),  # padded to 64: rank 1 holds 18 real rows of 32
        (4, 40, True),  # padded to 64: rank 3 holds padding only
    ],
)
def test_vocab_split_matches_tp1(tmp_path: Path, world: int, vocab: int, tied: bool) -> None:
    """Loss, output, input gradient and every shard's gradient equal the TP-1 stage's."""
    spawn(_tp_worker, args=(world, str(tmp_path / "store"), vocab, tied), nprocs=world)


def test_padding_row_gets_no_gradient() -> None:
    """A global ``padding_idx`` is honoured on whichever shard holds it (OPT, Llama)."""
    from sailor.megatron_patch.architecture import Architecture
    from sailor.megatron_patch.model import Embedding

    spec = _spec(64, False)
    emb = Embedding(spec, arch=Architecture(padding_idx=5))
    tokens = torch.tensor([[5, 6, 5, 7]])
    emb(tokens).sum().backward()
    grad = emb.wte.weight.grad
    assert grad is not None
    assert not grad[5].any() and grad[6].any() and grad[7].any()


def test_the_profilers_bound_counts_a_tp_th_of_the_vocabulary() -> None:
    """The embedding's and head's state per TP rank, as the engine's stage holds it."""
    from sailor.profiler.memory_bound import STATE_BYTES_PER_PARAM, layer_bytes

    spec = _spec(50, False)
    for tp in (1, 2, 4):
        for layer in (0, spec.num_all_layers - 1):
            ctx = TPContext() if tp == 1 else TPContext(size=tp, rank=0, group=object())
            stage = GPTStage(spec, layer, layer, tp=ctx, init=False)
            held = sum(p.numel() for p in stage.parameters())
            bound = layer_bytes(spec, layer, tp, 4).state // STATE_BYTES_PER_PARAM
            assert held <= bound <= held + 4 * spec.hidden_size, (tp, layer, held, bound)


def test_a_negative_padding_idx_counts_from_the_end() -> None:
    """As ``nn.Embedding(padding_idx=-1)``: the last real row gets no gradient."""
    from sailor.megatron_patch.architecture import Architecture
    from sailor.megatron_patch.model import Embedding

    spec = _spec(50, False)  # padded to 64: -1 is row 49, not the last padded row
    emb = Embedding(spec, arch=Architecture(padding_idx=-1))
    emb(torch.tensor([[49, 48, 49]])).sum().backward()
    grad = emb.wte.weight.grad
    assert grad is not None and not grad[49].any() and grad[48].any()


def _all_ignored_worker(rank: int, world: int, store: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        tp = TPContext(size=world, rank=rank, group=dist.group.WORLD)
        logits = torch.randn(6, 32, requires_grad=True)
        labels = torch.full((6,), IGNORE_INDEX)
        loss = vocab_cross_entropy(logits, labels, 64, tp)
        loss.backward()
        assert torch.isnan(loss)
        assert logits.grad is not None and not logits.grad.any()
    finally:
        dist.destroy_process_group()


def test_every_label_ignored_gives_nan_and_zero_gradients_as_tp1(tmp_path: Path) -> None:
    logits = torch.randn(6, 64, requires_grad=True)
    labels = torch.full((6,), IGNORE_INDEX)
    one = vocab_cross_entropy(logits, labels, 64, TPContext())
    one.backward()
    assert torch.isnan(one) and logits.grad is not None and not logits.grad.any()
    spawn(_all_ignored_worker, args=(2, str(tmp_path / "store")), nprocs=2)


def _bad_label_worker(rank: int, world: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        tp = TPContext(size=world, rank=rank, group=dist.group.WORLD)
        logits = torch.randn(4, 32, requires_grad=True)
        labels = torch.tensor([3, IGNORE_INDEX, 70, 5])  # 70: outside a vocabulary of 64
        try:
            vocab_cross_entropy(logits, labels, 64, tp)
        except LabelOutOfRangeError as exc:
            Path(out, f"{rank}.txt").write_text(str(exc))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("bad", [64, 70, -1])
def test_a_label_out_of_the_vocabulary_is_refused_at_tp1(bad: int) -> None:
    logits = torch.randn(3, 64)
    with pytest.raises(LabelOutOfRangeError, match=rf"label id {bad} .*\[0, 64\)"):
        vocab_cross_entropy(logits, torch.tensor([1, bad, IGNORE_INDEX]), 64, TPContext())
    check_labels(torch.tensor([0, 63, IGNORE_INDEX]), 64)  # the ignore index is no error


def test_a_label_out_of_the_vocabulary_is_refused_alike_on_every_tp_rank(
    tmp_path: Path,
) -> None:
    """Before, TP 2 took label 70 silently: inside no rank's rows, its target logit was 0."""
    spawn(_bad_label_worker, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    texts = [(tmp_path / f"{r}.txt").read_text() for r in (0, 1)]
    assert texts[0] == texts[1]
    assert "label id 70" in texts[0] and "[0, 64)" in texts[0]


# Spawned ranks leave ``init_process_group`` together (``tests/spawn.py``), tested here
# where the forkserver is warm already. Seen in a fresh-clone CI: the test above, whose
# ranks each raise a local error with no collective, failed in gloo's ``connectFullMesh``
# ("Connection closed by peer"): one rank had built its group, finished and exited while the
# other was still building its own. Rank 1 here takes longer than rank 0 to finish building
# its group; rank 0 must not leave ``init_process_group`` before it has (before the barrier,
# it left that much earlier).
_LATE_S = 0.5


def _late_builder_rank(rank: int, out: str) -> None:
    if rank == 1:
        build = c10d._new_process_group_helper

        def late(*args: Any, **kwargs: Any) -> Any:
            built = build(*args, **kwargs)
            time.sleep(_LATE_S)  # still finishing its group, as a rank on a loaded host
            Path(out, "built-1").write_text(repr(time.time()))
            return built

        c10d._new_process_group_helper = late
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=2)
    Path(out, f"returned-{rank}").write_text(repr(time.time()))
    dist.destroy_process_group()


def test_no_rank_leaves_init_before_every_rank_has_built_its_group(tmp_path: Path) -> None:
    spawn(_late_builder_rank, args=(str(tmp_path),), nprocs=2)
    built = float((tmp_path / "built-1").read_text())
    returned = float((tmp_path / "returned-0").read_text())
    assert returned >= built, f"rank 0 left init {built - returned:.2f} s before rank 1 built"
