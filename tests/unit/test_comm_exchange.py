"""The in-place relayout's exchange of every rank, recorded dry and replayed under NCCL's rules.

Each new rank runs the real :func:`~sailor.megatron_patch.in_place.exchange` one after
another under a dry :class:`~sailor.comm.strict.StrictBackend` on ``meta``: every send and
receive is checked at the call (on the rank's device, contiguous, a dtype NCCL has) and
logged, and ``nccl_replay`` then checks the ranks' logs together (each pair's sends and
receives in the same order with the same sizes, no batch waiting on a later one). The held
stages sit in host memory (``cpu``), as after an offload or on a rank that moved GPUs:
a held shard sent or installed without its move to the rank's device is refused.

The real gloo worker runs the exchange under the strict layer too
(``tests/integration/test_in_place_worker.py``), for a few layouts and on ``cpu``, where
the device check cannot tell host memory from the rank's device; here every kind of change
(TP degree up and down, uneven splits, pipelines added and lost, partial survivors, small
batch budgets, staged sends) is replayed in a unit test.
"""

from __future__ import annotations

import functools
import random

import pytest
import torch

from sailor.comm.api import use_backend
from sailor.comm.nccl_replay import CommOp, replay
from sailor.comm.strict import DryGroup, StrictBackend
from sailor.megatron_patch.engine import TrainConfig, Trainer
from sailor.megatron_patch.groups import ProcessGroups
from sailor.megatron_patch.in_place import exchange, exchange_layer_bytes
from sailor.megatron_patch.model import tiny_model
from sailor.megatron_patch.relayout import Schedule, schedule
from sailor.megatron_patch.roles import role_of
from sailor.megatron_patch.tp_layers import TPContext
from sailor.schemas.plan import Pipeline, Plan, ReplicaGroup, Stage

META = torch.device("meta")
CPU = torch.device("cpu")
_LAYERS = 6  # tiny models: embedding, 4 blocks, head
_SEEDS = 12


def _pipeline(rng: random.Random, tps: tuple[int, ...]) -> Pipeline:
    n = rng.randint(1, 3)
    cuts = sorted(rng.sample(range(1, _LAYERS), n - 1))
    bounds = zip([0, *cuts], [c - 1 for c in cuts] + [_LAYERS - 1], strict=True)
    return Pipeline(
        stages=tuple(
            Stage(
                first_layer=a,
                last_layer=b,
                replica=ReplicaGroup(
                    gpu_type="A100", zone="z", tp=rng.choice(tps), gpus_per_node=4
                ),
            )
            for a, b in bounds
        ),
        microbatch_size=1,
        num_microbatches=2,
    )


def _plan(rng: random.Random, model: str, tps: tuple[int, ...]) -> Plan:
    pipes = tuple(_pipeline(rng, tps) for _ in range(rng.randint(1, 2)))
    return Plan(model=model, global_batch_size=sum(p.samples for p in pipes), pipelines=pipes)


def _trainer(plan: Plan, rank: int, device: torch.device, empty: bool) -> Trainer:
    role = role_of(plan, rank)
    group = DryGroup(role.tp_group) if role.tp > 1 else None
    tp = TPContext(size=role.tp, rank=role.tp_rank, group=group)
    spec = tiny_model(plan.model, plan.global_batch_size)
    return Trainer(plan, spec, role, ProcessGroups(tp=tp), TrainConfig(), device, empty=empty)


@functools.cache
def _record(seed: int) -> tuple[dict[int, list[CommOp]], Schedule, Plan, int]:
    """Every new rank's exchange log of one random relayout, and its schedule."""
    rng = random.Random(seed)
    model = rng.choice(["tiny-gpt", "tiny-llama"])
    tps = (1, 2, 4) if model == "tiny-gpt" else (1, 2)  # tiny-llama: 2 KV heads
    old, new = _plan(rng, model, tps), _plan(rng, model, tps)
    n_old, n_new = len(old.ranks()), len(new.ranks())
    k = rng.randint(1, min(n_old, n_new))
    holders = dict(zip(rng.sample(range(n_new), k), rng.sample(range(n_old), k), strict=True))
    adam_step = rng.choice([0, 3])
    bucket = rng.choice([1 << 30, 20_000, 1])  # one batch; a few; a layer per batch
    staged = rng.random() < 0.5
    sched = schedule(old, holders, new)
    logs: dict[int, list[CommOp]] = {}
    for rank in range(n_new):
        held = None
        if rank in holders:
            held = _trainer(old, holders[rank], CPU, empty=False)
            if adam_step:
                for p in held.stage.parameters():
                    held.optimizer.state[p] = {
                        "step": torch.tensor(float(adam_step)),
                        "exp_avg": torch.zeros_like(p),
                        "exp_avg_sq": torch.zeros_like(p),
                    }
        fresh = _trainer(new, rank, META, empty=True)
        backend = StrictBackend(rank, META, n_new)
        with use_backend(backend):
            exchange(fresh, held, sched, adam_step, META, bucket_bytes=bucket, staged_sends=staged)
        logs[rank] = backend.ops
    return logs, sched, new, adam_step


@pytest.mark.parametrize("seed", range(_SEEDS), ids=lambda s: f"seed{s}")
def test_exchange_of_every_rank_passes_the_replay(seed: int) -> None:
    logs, sched, _new, _step = _record(seed)
    res = replay(logs)
    assert res.ok, res.message
    p2p = [op for ops in logs.values() for op in ops if op.kind in ("send", "recv")]
    assert {op.device for op in p2p} <= {"meta"}
    assert {op.dtype for op in p2p} <= {"torch.float32"}
    remote = [t for t in sched.transfers if set(t.sources) - {t.receiver}]
    assert bool(p2p) == bool(remote)


def test_the_grid_moves_state_between_tp_degrees() -> None:
    """The seeds above are not all trivial: messages cross, in several batches, and some
    layers are gathered from several old TP shards."""
    sends, batches, gathered = 0, 0, 0
    for seed in range(_SEEDS):
        logs, sched, _new, _step = _record(seed)
        sends += sum(op.kind == "send" for ops in logs.values() for op in ops)
        batches = max(
            batches, *(len({op.batch for op in ops if op.batch >= 0}) for ops in logs.values())
        )
        gathered += sum(len(t.sources) > 1 for t in sched.transfers)
    assert sends > 100 and batches > 2 and gathered > 0


def test_a_receiver_takes_no_more_than_the_batch_budget_counts() -> None:
    """A receiver takes each layer once: its TP-sharded parameters one shard per old TP rank,
    its replicated ones (norms, biases, position embeddings) one copy, old TP rank 0's.
    Before, every old TP rank sent its copy of a replicated parameter, t times what
    ``exchange_layer_bytes`` (the batches' budget) counts for the layer."""
    over = []
    for seed in range(_SEEDS):
        logs, sched, new, adam_step = _record(seed)
        of = exchange_layer_bytes(tiny_model(new.model, new.global_batch_size), adam_step)
        for rank, ops in logs.items():
            got = sum(4 * op.numel for op in ops if op.kind == "recv")
            counted = sum(
                of(t.layer)
                for t in sched.transfers
                if t.receiver == rank and set(t.sources) - {rank}
            )
            if got > counted:
                over.append((seed, rank, got, counted))
    assert not over, over
