"""The transfer schedule of an in-place relayout: a pure function of (old plan, survivors,
new plan).

At an in-place reconfiguration some ranks of the old world survive with their
state at step S intact ("holders"); each is a rank of the new world too. For every layer of
every new rank's stage this module decides where its state (weights, both AdamW moments)
comes from:

- **kept**: the rank held that layer in the old plan with the same TP degree and TP rank:
  its shards are already the right ones;
- **received**: from one *complete* surviving old replica group holding the layer (all of
  its TP ranks are holders): the receiver gets every TP shard (old TP-rank order),
  concatenates them along the parameter's TP dim and slices its own shard. Sources are
  spread over the surviving replicas (a group the receiver is itself part of first: its own
  shard then needs no message; else round-robin per layer), so that no single replica
  sends every copy;
- **checkpoint**: no complete surviving group holds it: read from the committed
  checkpoint (only those layers).

The schedule is by layer: every key of a layer (``"{layer}.{param}"``, see ``state``) has
the owners of its layer. With tied embeddings both copies are ordinary keys of their
layers (``0.wte.weight`` of layer 0, ``{L+1}.lm_head.weight`` of the head), each moved
with its own layer. :attr:`Schedule.transfers` is in one global order (receiver, layer),
the order in which every rank posts its part of the ``batch_isend_irecv`` of each bucket,
so that each pair of ranks posts matching sends and receives in the same order (NCCL's
rule). :func:`buckets` splits that order so that no rank receives more than a byte budget
per batch (every receive buffer of a batch is live until it completes): each receiver's
transfers, in order, fill its buckets 0, 1, ...; bucket ``k`` of every receiver goes in
the ``k``-th batch. Ranks run the batches in that order, so a rank waits only on peers
at the same batch or later: no cycle.

This module must never import torch or do I/O: every rank computes the same schedule.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from sailor.schemas.plan import Plan, RankPlace

__all__ = [
    "RankSchedule",
    "Schedule",
    "Transfer",
    "batch_peak",
    "buckets",
    "exchange_transients",
    "kept_layers",
    "schedule",
]


@dataclass(frozen=True)
class Transfer:
    """One layer moved to one new rank from one complete old replica group."""

    receiver: int
    """New rank that receives."""
    layer: int
    sources: tuple[int, ...]
    """New ranks holding the layer's TP shards, in old TP-rank order (may include the
    receiver itself: that shard is copied locally)."""


@dataclass(frozen=True)
class RankSchedule:
    """Where one new rank's layers come from."""

    rank: int
    kept: tuple[int, ...]
    received: tuple[int, ...]
    checkpoint: tuple[int, ...]


@dataclass(frozen=True)
class Schedule:
    """Every new rank's sources and the global transfer order."""

    ranks: tuple[RankSchedule, ...]
    transfers: tuple[Transfer, ...]

    def of(self, rank: int) -> RankSchedule:
        return self.ranks[rank]

    def sends_of(self, rank: int) -> tuple[Transfer, ...]:
        """Transfers ``rank`` sends a shard of (to another rank), in the global order."""
        return tuple(t for t in self.transfers if rank in t.sources and t.receiver != rank)


def _check_holders(old: Plan | None, new: Plan, holders: Mapping[int, int]) -> None:
    if holders and old is None:
        raise ValueError(f"holders {dict(holders)} without an old plan")
    n_old = len(old.ranks()) if old is not None else 0
    n_new = len(new.ranks())
    for r, o in holders.items():
        if not 0 <= r < n_new:
            raise ValueError(f"holder new rank {r} outside the new world of {n_new}")
        if not 0 <= o < n_old:
            raise ValueError(f"holder old rank {o} (new rank {r}) outside the old world of {n_old}")
    if len(set(holders.values())) != len(holders):
        raise ValueError(f"two new ranks hold the same old rank: {dict(holders)}")
    if old is not None and old.num_layers != new.num_layers:
        raise ValueError(f"old plan has {old.num_layers} layers, new plan {new.num_layers}")


def _complete_groups(
    table: tuple[RankPlace, ...], survivors: Mapping[int, int]
) -> dict[int, list[tuple[int, ...]]]:
    """Per layer: the complete surviving old replica groups (``table``: the old plan's
    :meth:`~sailor.schemas.plan.Plan.rank_table`), as new ranks in TP order."""
    out: dict[int, list[tuple[int, ...]]] = {}
    for first, place in enumerate(table):
        if place.tp_rank != 0:
            continue
        ranks = range(first, first + place.tp)
        if not all(o in survivors for o in ranks):
            continue
        as_new = tuple(survivors[o] for o in ranks)
        for layer in place.layers:
            out.setdefault(layer, []).append(as_new)
    return out


def _kept(old_place: RankPlace | None, new_place: RankPlace, layer: int) -> bool:
    return (
        old_place is not None
        and layer in old_place.layers
        and old_place.tp == new_place.tp
        and old_place.tp_rank == new_place.tp_rank
    )


def kept_layers(old_place: RankPlace, new_place: RankPlace) -> int:
    """The layers of ``new_place``'s stage a worker of ``old_place`` keeps if it takes that
    rank (the ``kept`` of :func:`schedule`: held at the same TP degree and TP rank)."""
    if old_place.tp != new_place.tp or old_place.tp_rank != new_place.tp_rank:
        return 0
    lo = max(old_place.first_layer, new_place.first_layer)
    return max(0, min(old_place.last_layer, new_place.last_layer) - lo + 1)


def schedule(old: Plan | None, holders: Mapping[int, int], new: Plan) -> Schedule:
    """The transfer schedule of a relayout from ``old`` to ``new``.

    ``holders`` maps each new rank whose state at the relayout step is intact (an unbroken
    holder at that step) to its rank in ``old``; every other new rank (fresh, broken, or
    behind) contributes nothing. With no holders every layer comes from the checkpoint.
    """
    _check_holders(old, new, holders)
    survivors = {o: r for r, o in holders.items()}
    # each plan's ranks placed once: a place looked up per rank walked the plan each time
    # (4,096 ranks: ~15 s inside the controller's LAUNCH decision)
    old_table = old.rank_table() if old is not None else ()
    groups = _complete_groups(old_table, survivors)
    spread: dict[int, int] = {}
    ranks: list[RankSchedule] = []
    transfers: list[Transfer] = []
    for r, place in enumerate(new.rank_table()):
        old_place = old_table[holders[r]] if r in holders else None
        kept: list[int] = []
        received: list[int] = []
        ckpt: list[int] = []
        for layer in place.layers:
            if _kept(old_place, place, layer):
                kept.append(layer)
                continue
            cands = groups.get(layer, [])
            if not cands:
                ckpt.append(layer)
                continue
            own = [g for g in cands if r in g]
            if own:
                src = own[0]
            else:
                i = spread.get(layer, 0)
                spread[layer] = i + 1
                src = cands[i % len(cands)]
            received.append(layer)
            transfers.append(Transfer(receiver=r, layer=layer, sources=src))
        ranks.append(RankSchedule(r, tuple(kept), tuple(received), tuple(ckpt)))
    return Schedule(tuple(ranks), tuple(transfers))


def buckets(
    sched: Schedule,
    layer_bytes: Callable[[int], int],
    budget_bytes: int,
    staged_sends: bool = False,
) -> tuple[int, ...]:
    """The batch of each of ``sched.transfers`` (same order): a receiver's transfers go in
    order into its batches 0, 1, ..., a new one whenever the next layer
    (``layer_bytes(layer)``: what the receiver takes in for it) would take the batch past
    ``budget_bytes``; a layer larger than the budget has a batch of its own.

    ``staged_sends``: the senders' held shards are off the device (offloaded to the host),
    so each shard a rank sends in a batch is first copied to its device, once per batch
    however many receivers take it. A source's shard of a layer (``layer_bytes`` over its
    group's TP degree) then counts against the source's own budget in that batch, shared with
    what it receives there; a transfer goes to the first batch, from its receiver's current
    one, where every rank taking part has room (or holds nothing yet). Without it the
    answer is the receivers' alone. Every rank computes the same answer from the same
    inputs; any such split is free of cycles, since every rank runs its batches in order."""
    if budget_bytes <= 0:
        raise ValueError(f"budget_bytes={budget_bytes}: must be > 0")
    used: dict[tuple[int, int], int] = {}  # (rank, batch) -> bytes it holds in that batch
    staged: set[tuple[int, int, int]] = set()  # (source, batch, layer) already on its device
    current: dict[int, int] = {}  # receiver -> its current batch
    out: list[int] = []
    for t in sched.transfers:
        size = layer_bytes(t.layer)
        share = _shard_bytes(t, size)
        senders = [s for s in t.sources if s != t.receiver] if staged_sends else []
        b = current.get(t.receiver, 0)
        while True:
            need = {t.receiver: size}
            for s in senders:
                if (s, b, t.layer) not in staged:
                    need[s] = need.get(s, 0) + share
            if all(
                used.get((r, b), 0) == 0 or used[(r, b)] + n <= budget_bytes
                for r, n in need.items()
            ):
                break
            b += 1
        for r, n in need.items():
            used[(r, b)] = used.get((r, b), 0) + n
        staged.update((s, b, t.layer) for s in senders)
        current[t.receiver] = b
        out.append(b)
    return tuple(out)


def _shard_bytes(t: Transfer, layer_bytes: int) -> int:
    """What one source of ``t`` stages to send: its old TP shard of the layer (rounded up),
    the same in the split and in the peak that reads it."""
    return -(-layer_bytes // len(t.sources))


def batch_peak(
    sched: Schedule,
    layer_bytes: Callable[[int], int],
    batches: tuple[int, ...],
    rank: int,
    count_sends: bool,
) -> int:
    """The most bytes ``rank`` holds in one of ``batches`` (:func:`buckets`' answer): what it
    receives there, plus with ``count_sends`` its staged shards (each layer once per batch,
    as the exchange stages them). A layer larger than the budget is in it whole."""
    held: dict[int, int] = {}
    staged: set[tuple[int, int]] = set()
    for t, b in zip(sched.transfers, batches, strict=True):
        size = layer_bytes(t.layer)
        if t.receiver == rank:
            held[b] = held.get(b, 0) + size
        elif count_sends and rank in t.sources and (b, t.layer) not in staged:
            staged.add((b, t.layer))
            held[b] = held.get(b, 0) + _shard_bytes(t, size)
    return max(held.values(), default=0)


def exchange_transients(
    sched: Schedule, layer_bytes: Callable[[int], int], budget_bytes: int, rank: int
) -> tuple[int, int]:
    """``rank``'s exchange transients, bytes: (held stage kept on the device, held stage on
    the host). Kept: its largest batch's receives, in either split (whether the world stages
    sends depends on the other ranks); on the host: its largest batch's receives and staged
    sends in the staged split. Both plus, where a received layer comes from several old TP
    shards, that layer whole (the full tensor of the key being gathered)."""
    plain = buckets(sched, layer_bytes, budget_bytes)
    staged = buckets(sched, layer_bytes, budget_bytes, staged_sends=True)
    gather = max(
        (
            layer_bytes(t.layer)
            for t in sched.transfers
            if t.receiver == rank and len(t.sources) > 1
        ),
        default=0,
    )
    keep = max(
        batch_peak(sched, layer_bytes, plain, rank, count_sends=False),
        batch_peak(sched, layer_bytes, staged, rank, count_sends=False),
    )
    off = batch_peak(sched, layer_bytes, staged, rank, count_sends=True)
    return keep + gather, off + gather
