"""An in-place relayout's memory: the verdict, the staged sends' batches, the empty stage,
the held stage's offload (its GPU half: ``tests/gpu/test_relayout_memory_gpu.py``)."""

from __future__ import annotations

import pytest
import torch

from sailor.comm.api import use_backend
from sailor.comm.strict import StrictBackend
from sailor.megatron_patch.engine import TrainConfig, Trainer
from sailor.megatron_patch.groups import ProcessGroups
from sailor.megatron_patch.in_place import exchange
from sailor.megatron_patch.in_place_steps import (
    RelayoutMemoryError,
    memory_figures,
    memory_verdict,
    offload_held,
)
from sailor.megatron_patch.relayout import batch_peak, buckets, exchange_transients, schedule
from sailor.megatron_patch.relayout_memory import RelayoutMemory, decide, margin_bytes
from sailor.megatron_patch.roles import role_of
from sailor.megatron_patch.state import place
from sailor.megatron_patch.tp_layers import TPContext, tp_dim_of
from tests.unit.test_relayout_schedule import DP2, PP2, _plan

GIB = 2**30
CPU = torch.device("cpu")


def _mem(**kw: int) -> RelayoutMemory:
    base = {
        "new_bytes": 12 * GIB,
        "kept_bytes": 0,
        "held_bytes": 12 * GIB,
        "keep_exchange_bytes": 2 * GIB,
        "offload_exchange_bytes": 2 * GIB,
        "free_bytes": 20 * GIB,
        "margin_bytes": GIB // 2,
    }
    return RelayoutMemory(**(base | kw))


def test_verdict_keeps_offloads_or_refuses() -> None:
    """A rank that moves every layer (nothing kept) on a device with room for one stage
    offloads; one that keeps most of its layers keeps; none fits: too large; a host
    without room for the held stage: too large."""
    # 12 + 2 + 0.5 <= 20 free: keep
    assert decide(_mem()) == "keep"
    # 8 GiB free: 14.5 does not fit beside the old stage; off it, 14.5 - 12 = 2.5 <= 8
    assert decide(_mem(free_bytes=8 * GIB)) == "offload"
    assert decide(_mem(free_bytes=8 * GIB, host_free_bytes=12 * GIB)) == "offload"
    assert decide(_mem(free_bytes=8 * GIB, host_free_bytes=11 * GIB)) == "too_large"
    # most layers kept: only 2 GiB new
    assert decide(_mem(free_bytes=8 * GIB, kept_bytes=10 * GIB)) == "keep"
    # a new stage larger than the device even with the old one gone
    assert decide(_mem(new_bytes=30 * GIB, free_bytes=8 * GIB)) == "too_large"
    # a layer larger than the batch budget: the transients decide
    assert decide(_mem(free_bytes=20 * GIB, keep_exchange_bytes=8 * GIB)) == "offload"
    m = _mem(free_bytes=8 * GIB)
    assert m.keep_need == 12 * GIB + 2 * GIB + GIB // 2
    assert m.offload_need == m.keep_need - 12 * GIB
    assert "free 8.00 GiB" in m.describe()
    with pytest.raises(ValueError, match="kept_bytes"):
        _mem(kept_bytes=13 * GIB)
    with pytest.raises(ValueError, match="free_bytes=-1"):
        _mem(free_bytes=-1)
    assert margin_bytes(80 * GIB) == 4 * GIB and margin_bytes(GIB) == 512 * 2**20


def test_exchange_transients_follow_the_batches() -> None:
    """A rank's transients are its largest batch, a layer over the budget whole; with the
    held stage on the host its staged sends count; a layer gathered from old TP shards
    adds itself whole."""
    s = schedule(PP2, {0: 0, 1: 1}, DP2)  # rank 0 receives 3, 4, 5 from 1; rank 1 0, 1, 2
    size = {0: 50, 1: 30, 2: 30, 3: 30, 4: 30, 5: 70}.__getitem__
    # budget 60: rank 0 receives 30+30 | 70 (the head over the budget: whole)
    assert exchange_transients(s, size, 60, 0)[0] == 70
    # rank 1 receives 50 | 30+30; staged, it also sends its shards of 3, 4, 5
    keep, off = exchange_transients(s, size, 60, 1)
    assert keep == 60 and off >= keep
    plain = buckets(s, size, 1000)
    assert batch_peak(s, size, plain, 0, count_sends=False) == 130
    assert batch_peak(s, size, plain, 0, count_sends=True) == 130 + 110
    # DP2 -> TP 2: each new TP rank gathers every layer from two old shards
    tp2 = _plan(((0, 5, 2),))
    s2 = schedule(DP2, {0: 0, 1: 1}, tp2)
    assert all(len(t.sources) == 1 for t in s2.transfers)  # TP 1 sources: nothing gathered
    s3 = schedule(tp2, {0: 0, 1: 1}, DP2)
    assert all(len(t.sources) == 2 for t in s3.transfers)
    keep3, _ = exchange_transients(s3, size, 1000, 0)
    assert keep3 == batch_peak(s3, size, buckets(s3, size, 1000), 0, False) + 70


def test_staged_sends_count_against_the_senders_budget() -> None:
    """With the senders' shards staged on their devices, no rank holds more than the budget
    in one batch, received and staged together; a shard sent to two receivers in one
    batch is staged once. Without staging the batches are the receivers' alone."""
    s = schedule(PP2, {0: 0, 1: 1}, DP2)  # rank 0 receives 3, 4, 5 from 1; rank 1 0, 1, 2
    size = {0: 50, 1: 30, 2: 30, 3: 30, 4: 30, 5: 70}.__getitem__
    plain = buckets(s, size, 60)
    assert plain == (0, 0, 1, 0, 1, 1)
    staged = buckets(s, size, 60, staged_sends=True)
    per: dict[tuple[int, int], int] = {}
    for t, b in zip(s.transfers, staged, strict=True):
        per[(t.receiver, b)] = per.get((t.receiver, b), 0) + size(t.layer)
        for src in t.sources:
            if src != t.receiver:
                per[(src, b)] = per.get((src, b), 0) + size(t.layer)
    assert all(v <= 60 or v in {50, 70} for v in per.values()), per
    assert max(staged) > max(plain)  # each rank both sends and receives: more batches
    assert buckets(s, size, 1000, staged_sends=True) == (0,) * 6

    # one old replica (ranks 0, 1 of a PP2) feeds two fresh ranks the same layers
    four = _plan(((0, 5, 1),), ((0, 5, 1),), ((0, 5, 1),), ((0, 5, 1),))
    s2 = schedule(PP2, {0: 0, 1: 1}, four)
    fresh = [t for t in s2.transfers if t.receiver >= 2]
    assert {t.sources for t in fresh} == {(0,), (1,)}
    got = buckets(s2, lambda _layer: 10, 30, staged_sends=True)
    staged_by: dict[tuple[int, int], set[int]] = {}
    for t, b in zip(s2.transfers, got, strict=True):
        for src in t.sources:
            if src != t.receiver:
                staged_by.setdefault((src, b), set()).add(t.layer)
    # a source's distinct staged layers per batch fit its budget (3 x 10) with what it
    # receives there; a layer sent to rank 2 and rank 3 in one batch counts once
    assert all(len(v) * 10 <= 30 for v in staged_by.values()), staged_by


def _trainer(rank: int, empty: bool = False) -> Trainer:
    from tests.unit.test_in_place_worker_parts import _two_stage_plan

    spec, plan = _two_stage_plan()
    groups = ProcessGroups(tp=TPContext())
    return Trainer(
        plan,  # type: ignore[arg-type]
        spec,  # type: ignore[arg-type]
        role_of(plan, rank),  # type: ignore[arg-type]
        groups,
        TrainConfig(),
        CPU,
        empty=empty,
    )


def test_place_keeps_the_parameter_object() -> None:
    """A meta parameter takes a real tensor as the same object: the optimizer's reference
    and the TP dim survive; a wrong shape or dtype is refused."""
    tr = _trainer(0, empty=True)
    _key, p = next(iter(tr.stage.keyed_parameters()))
    assert p.is_meta
    ident, dim = id(p), tp_dim_of(p)
    t = torch.ones(p.shape)
    place(p, t)
    assert id(p) == ident and not p.is_meta and p.data_ptr() == t.data_ptr()
    assert tp_dim_of(p) == dim and p.requires_grad
    assert any(q is p for g in tr.optimizer.param_groups for q in g["params"])
    with pytest.raises(ValueError, match="shape"):
        place(p, torch.ones(3, 3, 3))
    with pytest.raises(ValueError, match="float64"):
        place(p, torch.ones(p.shape, dtype=torch.float64))


def test_an_empty_stage_is_filled_by_the_exchange_and_materialize() -> None:
    """The new stage is built on ``meta`` (no memory, no initialisation): kept layers take
    the held tensors, received ones get their own; nothing is left on ``meta``; the held
    tensors of a kept layer are not copied."""
    held = _trainer(0)
    for p in held.stage.parameters():
        held.optimizer.state[p] = {
            "step": torch.tensor(3.0),
            "exp_avg": torch.full_like(p, 0.5),
            "exp_avg_sq": torch.full_like(p, 0.25),
        }
    new = _trainer(0, empty=True)
    assert all(p.is_meta for p in new.stage.parameters())
    with use_backend(StrictBackend(0, CPU, 2)):  # dry: receive buffers stay as allocated
        st = exchange(new, held, schedule(PP2, {0: 0, 1: 1}, PP2), 3, CPU)
    assert st.kept_keys > 0 and new.materialize() == []
    old = dict(held.stage.keyed_parameters())
    for key, p in new.stage.keyed_parameters():
        assert p.device == CPU and p.data_ptr() == old[key].data_ptr(), key
        assert new.optimizer.state[p]["exp_avg"].data_ptr() == (
            held.optimizer.state[old[key]]["exp_avg"].data_ptr()
        )

    # rank 0 of DP2 now: layers 0..2 kept, 3..5 received from rank 1
    new = _trainer(0, empty=True)
    new_dp = Trainer(DP2, new.spec, role_of(DP2, 0), new.groups, TrainConfig(), CPU, empty=True)
    with use_backend(StrictBackend(0, CPU, 2)):
        st = exchange(new_dp, held, schedule(PP2, {0: 0, 1: 1}, DP2), 3, CPU)
    assert st.kept_keys > 0 and st.received_keys > 0
    assert new_dp.materialize() == []
    assert not any(p.is_meta for p in new_dp.stage.parameters())
    opt = {id(q) for g in new_dp.optimizer.param_groups for q in g["params"]}
    assert opt == {id(p) for p in new_dp.stage.parameters()}
    assert all(p in new_dp.optimizer.state for p in new_dp.stage.parameters())


def test_materialize_places_what_nothing_filled() -> None:
    tr = _trainer(1, empty=True)
    keys = tr.materialize()
    assert keys == [k for k, _p in tr.stage.keyed_parameters()]
    assert all(p.device == CPU for p in tr.stage.parameters())
    assert tr.materialize() == []


def test_the_world_verdict() -> None:
    """One MAX over the world (dry here: this rank's own): ``always`` offloads and stages
    sends; ``auto`` off a GPU keeps; a rank whose stage fits nowhere stops every rank
    before the exchange, with its figures."""
    with use_backend(StrictBackend(0, CPU, 2)):
        assert memory_verdict("always", 0, None, CPU) == ("offload", True)
        assert memory_verdict("auto", 0, None, CPU) == ("keep", False)
        assert memory_verdict("never", 0, _mem(free_bytes=0), CPU) == ("keep", False)
        assert memory_verdict("auto", 0, _mem(free_bytes=8 * GIB), CPU) == ("offload", True)
        with pytest.raises(RelayoutMemoryError, match=r"new stage of rank 1 .*: new stage 30"):
            memory_verdict("auto", 1, _mem(new_bytes=30 * GIB, free_bytes=GIB), CPU)


def test_offload_to_where_it_is_moves_nothing() -> None:
    """Off a GPU the held stage is already in host memory (the GPU test moves it)."""
    held = _trainer(0)
    before = [p.data_ptr() for p in held.stage.parameters()]
    assert offload_held(held, CPU) == 0
    assert [p.data_ptr() for p in held.stage.parameters()] == before


def test_a_ranks_figures() -> None:
    """PP2 -> DP2 at step 3 on rank 0: it keeps layers 0..2, receives 3..5 whole from rank
    1; weights and both moments (12 B per parameter) everywhere."""
    from sailor.megatron_patch.in_place import exchange_layer_bytes

    held = _trainer(0)
    for p in held.stage.parameters():
        held.optimizer.state[p] = {
            "step": torch.tensor(3.0),
            "exp_avg": torch.zeros_like(p),
            "exp_avg_sq": torch.zeros_like(p),
        }
    new = Trainer(DP2, held.spec, role_of(DP2, 0), held.groups, TrainConfig(), CPU, 3, empty=True)
    sched = schedule(PP2, {0: 0, 1: 1}, DP2)
    m = memory_figures(new, held, sched, 1 << 30, 10 * GIB, 80 * GIB, None)
    n_new = sum(p.numel() for p in new.stage.parameters())
    n_old = sum(p.numel() for p in held.stage.parameters())
    assert m.new_bytes == 12 * n_new and m.held_bytes == 12 * n_old
    assert m.kept_bytes == m.held_bytes  # every layer it held, it keeps
    received = sum(exchange_layer_bytes(held.spec, 3)(x) for x in (3, 4, 5))
    assert m.keep_exchange_bytes == received  # one batch, nothing gathered (TP 1)
    assert m.margin_bytes == 4 * GIB and m.free_bytes == 10 * GIB
    # with no held state (a fresh rank) nothing is kept or held
    fresh = memory_figures(new, None, sched, 1 << 30, GIB, GIB, 5)
    assert fresh.kept_bytes == fresh.held_bytes == 0 and fresh.host_free_bytes == 5
