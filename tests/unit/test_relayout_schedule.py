"""The in-place relayout schedule (``sailor.megatron_patch.relayout``): kept, received,
from checkpoint, on plans of every kind of change."""

from __future__ import annotations

import pytest

from sailor.megatron_patch.relayout import Transfer, buckets, schedule
from sailor.schemas.plan import Pipeline, Plan, ReplicaGroup, Stage

# tiny-gpt: global layers 0 (embedding) .. 5 (head; a tied copy of the embedding).


def _plan(*pipes: tuple[tuple[int, int, int], ...]) -> Plan:
    return Plan(
        model="tiny-gpt",
        global_batch_size=4 * len(pipes),
        pipelines=tuple(
            Pipeline(
                stages=tuple(
                    Stage(
                        first_layer=a,
                        last_layer=b,
                        replica=ReplicaGroup(gpu_type="cpu", zone="z", tp=tp, gpus_per_node=4),
                    )
                    for a, b, tp in stages
                ),
                microbatch_size=1,
                num_microbatches=4,
            )
            for stages in pipes
        ),
    )


PP2 = _plan(((0, 2, 1), (3, 5, 1)))
DP2 = _plan(((0, 5, 1),), ((0, 5, 1),))


def test_pipeline_to_data_parallel_both_kept() -> None:
    s = schedule(PP2, {0: 0, 1: 1}, DP2)
    assert s.of(0).kept == (0, 1, 2) and s.of(0).received == (3, 4, 5)
    assert s.of(1).kept == (3, 4, 5) and s.of(1).received == (0, 1, 2)
    assert s.of(0).checkpoint == s.of(1).checkpoint == ()
    assert s.transfers == (
        *(Transfer(0, layer, (1,)) for layer in (3, 4, 5)),
        *(Transfer(1, layer, (0,)) for layer in (0, 1, 2)),
    )
    assert s.sends_of(0) == s.transfers[3:]


def test_fresh_rank_receives_spread_over_replicas() -> None:
    three = _plan(((0, 5, 1),), ((0, 5, 1),), ((0, 5, 1),))
    s = schedule(DP2, {0: 0, 1: 1}, three)
    assert s.of(0).kept == s.of(1).kept == tuple(range(6))
    assert s.of(2).received == tuple(range(6)) and s.of(2).kept == ()
    assert len({t.sources for t in s.transfers}) == 1  # one new rank: round-robin per layer
    two_fresh = _plan(*[((0, 5, 1),)] * 4)
    s = schedule(DP2, {0: 0, 1: 1}, two_fresh)
    # layer by layer the two fresh ranks get their copy from different replicas
    for layer in range(6):
        srcs = {t.sources for t in s.transfers if t.layer == layer}
        assert srcs == {(0,), (1,)}


def test_tp_1_to_2_and_back() -> None:
    tp1 = _plan(((0, 5, 1),))
    tp2 = _plan(((0, 5, 2),))
    s = schedule(tp1, {0: 0}, tp2)
    assert s.of(0).kept == () and s.of(0).received == tuple(range(6))  # same rank, new shard
    assert s.of(1).received == tuple(range(6))
    assert all(t.sources == (0,) for t in s.transfers)
    s = schedule(tp2, {0: 0, 1: 1}, DP2)  # TP 2 -> two TP-1 replicas
    assert s.of(0).received == s.of(1).received == tuple(range(6))
    assert all(t.sources == (0, 1) for t in s.transfers)  # every shard, old TP order
    # each rank's own shard is copied locally: it sends only to the other
    assert all(t.receiver == 0 for t in s.sends_of(1)) and len(s.sends_of(1)) == 6
    # only one TP rank of the group survives: incomplete, so from the checkpoint
    s = schedule(tp2, {0: 1}, tp1)
    assert s.of(0).checkpoint == tuple(range(6)) and s.transfers == ()


def test_tp_rank_swap_is_not_kept() -> None:
    tp2 = _plan(((0, 5, 2),))
    s = schedule(tp2, {0: 1, 1: 0}, tp2)
    assert s.of(0).kept == () and all(t.sources == (1, 0) for t in s.transfers)


def test_lost_layers_come_from_the_checkpoint_tied_copies_apart() -> None:
    three = _plan(((0, 0, 1), (1, 4, 1), (5, 5, 1)))
    # the head's stage (layer 5, the tied copy of the embedding) is lost, layer 0 survives
    s = schedule(three, {0: 0, 1: 1}, DP2)
    assert s.of(0).kept == (0,) and s.of(0).received == (1, 2, 3, 4)
    assert s.of(0).checkpoint == (5,) and s.of(1).checkpoint == (5,)
    assert s.of(1).received == (0,) and s.of(1).kept == (1, 2, 3, 4)


def test_no_holders_everything_from_checkpoint() -> None:
    s = schedule(None, {}, DP2)
    assert all(r.checkpoint == tuple(range(6)) for r in s.ranks) and s.transfers == ()


@pytest.mark.parametrize(
    "holders",
    [{0: 5}, {5: 0}, {0: 0, 1: 0}],
)
def test_bad_holders_raise(holders: dict[int, int]) -> None:
    with pytest.raises(ValueError):
        schedule(PP2, holders, DP2)


def test_buckets_bound_what_each_receiver_takes_per_batch() -> None:
    """Each receiver's transfers fill its batches 0, 1, ... in order, up to the budget; a
    layer larger than the budget gets a batch of its own; receivers are counted apart."""
    s = schedule(PP2, {0: 0, 1: 1}, DP2)  # rank 0 receives 3, 4, 5; rank 1 receives 0, 1, 2
    size = {0: 50, 1: 30, 2: 30, 3: 30, 4: 30, 5: 70}.__getitem__
    assert buckets(s, size, 60) == (0, 0, 1, 0, 1, 1)  # 30+30 | 70; 50 | 30+30
    assert buckets(s, size, 1000) == (0,) * 6  # one batch: the exchange as it was
    assert buckets(s, size, 1) == (0, 1, 2, 0, 1, 2)
    for budget in (1, 60, 100):
        got = buckets(s, size, budget)
        per: dict[tuple[int, int], int] = {}
        for t, b in zip(s.transfers, got, strict=True):
            per[(t.receiver, b)] = per.get((t.receiver, b), 0) + size(t.layer)
        # over the budget only when a single layer is
        assert all(v <= budget or v in {size(x) for x in range(6)} for v in per.values())
        # batches in the global order never go back for a receiver
        for r in (0, 1):
            seq = [b for t, b in zip(s.transfers, got, strict=True) if t.receiver == r]
            assert seq == sorted(seq)
    with pytest.raises(ValueError, match="budget_bytes=0"):
        buckets(s, size, 0)
