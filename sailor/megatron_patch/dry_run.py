"""Record the communication of one training iteration of every rank of a plan, in one process.

Each rank's real :func:`~sailor.megatron_patch.schedule.run_1f1b`, gradient sync and the
iteration's agreement run one rank after another, under a dry
:class:`~sailor.comm.strict.StrictBackend` on ``torch.device("meta")``: no data moves, the
model computes shapes only, and every call is checked against NCCL's local rules and
logged. ``sailor.comm.nccl_replay.replay`` then decides whether the ranks' logs together
deadlock under NCCL. Cheap enough for plans of 8 stages and 16 microbatches in a unit test.

Mirrors ``Trainer.train_step``'s communication (1F1B, ``sync_gradients``, the agreement's
world all-reduce of ``2 + world`` float64 values: ``step_agreement``); the optimizer and the
loss read do not communicate and are left out, as are the fp16 path's clipping all-reduce
and evaluation's, which run on every rank alike after it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from sailor.comm.api import use_backend
from sailor.comm.nccl_replay import CommOp
from sailor.comm.strict import DryGroup, StrictBackend
from sailor.megatron_patch.grad_sync import sync_gradients
from sailor.megatron_patch.model import GPTStage
from sailor.megatron_patch.roles import RankRole, role_of
from sailor.megatron_patch.schedule import P2P, run_1f1b
from sailor.megatron_patch.sync_groups import rank_sync_items, sync_groups
from sailor.megatron_patch.tp_layers import TPContext, set_tp_dim, tp_dim_of
from sailor.schemas.model import ModelSpec
from sailor.schemas.plan import Plan

__all__ = ["META", "BuildStage", "RunIteration", "record_iteration"]

META = torch.device("meta")

RunIteration = Callable[
    [GPTStage, RankRole, P2P, Callable[[int], tuple[torch.Tensor, torch.Tensor]]], None
]
"""What one rank runs for the record (default: ``run_1f1b``); tests swap in other schedules."""

BuildStage = Callable[[ModelSpec, RankRole, TPContext], GPTStage]
"""The stage module of one rank (default: the real ``GPTStage`` on meta)."""


def _default_schedule(
    stage: GPTStage,
    role: RankRole,
    p2p: P2P,
    get: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
) -> None:
    run_1f1b(stage, role, p2p, get, 1.0)


def _stage_on_meta(spec: ModelSpec, role: RankRole, tp: TPContext) -> GPTStage:
    stage = GPTStage(
        spec, role.first_layer, role.last_layer, tp=tp, recompute=role.recompute, seed=0
    )
    dims = {name: tp_dim_of(p) for name, p in stage.named_parameters()}
    stage.to(META)
    # A move to meta makes new Parameter objects (no shallow copy from CPU): the TP
    # dimension recorded on each one must be carried over.
    for name, p in stage.named_parameters():
        set_tp_dim(p, dims[name])
    return stage


def record_iteration(
    plan: Plan,
    spec: ModelSpec,
    *,
    schedule: RunIteration = _default_schedule,
    build_stage: BuildStage = _stage_on_meta,
    wire_dtype: torch.dtype = torch.float32,
) -> dict[int, list[CommOp]]:
    """Every rank's checked op log of one iteration of ``plan`` (global rank -> ops).

    The gradient sync runs only when ``build_stage`` gives real ``GPTStage`` modules (a
    stand-in stage, which tests use to replay large grids of schedules fast, has no
    layer-keyed parameters to sync).
    """
    world = len(plan.ranks())
    groups = sync_groups(plan, spec.tie_embeddings)
    logs: dict[int, list[CommOp]] = {}
    for rank in range(world):
        role = role_of(plan, rank)
        tp = TPContext(
            size=role.tp,
            rank=role.tp_rank,
            group=DryGroup(role.tp_group) if role.tp > 1 else None,
        )
        stage = build_stage(spec, role, tp)
        shape = (role.microbatch_size, spec.seq_length, spec.hidden_size)
        p2p = P2P(role, shape, META, wire_dtype=wire_dtype, tp_group=tp.group)
        tokens = torch.zeros((role.microbatch_size, spec.seq_length), dtype=torch.long, device=META)

        def get(mb: int, tokens: torch.Tensor = tokens) -> tuple[torch.Tensor, torch.Tensor]:
            return tokens, tokens

        sync = [
            (item, DryGroup(tuple(sorted(groups[item.group.index].ranks))))
            for item in rank_sync_items(plan, groups, rank)
        ]
        backend = StrictBackend(rank, META, world)
        with use_backend(backend):
            schedule(stage, role, p2p, get)
            if isinstance(stage, GPTStage):
                sync_gradients(stage, sync)
            agreement = torch.zeros(2 + world, dtype=torch.float64, device=META)
            backend.all_reduce(agreement, "sum", None)
        logs[rank] = backend.ops
    return logs
