"""Record the communication of one training iteration of every rank of a plan, in one process.

Each rank's real :func:`~sailor.megatron_patch.schedule.run_1f1b`, gradient sync and the
iteration's agreement run one rank after another, under a dry
:class:`~sailor.comm.strict.StrictBackend` on ``torch.device("meta")``: no data moves, the
model computes shapes only, and every call is checked against NCCL's local rules and
logged. ``sailor.comm.nccl_replay.replay`` then decides whether the ranks' logs together
deadlock under NCCL. Cheap enough for plans of 8 stages and 16 microbatches in a unit test.

Issues ``Trainer.train_step``'s communication through the functions the engine calls, in its
order, for an iteration with clipping and an evaluation (by default; the flags below):

1. 1F1B (``run_1f1b``) and the gradient sync (``sync_gradients``);
2. the step agreement's world all-reduce of ``2 + world`` float64 values
   (``step_agreement.start_step``; clipping's squares ride in it without a loss scaler);
3. ``control``: the control request's all-reduce MAX beside it (``control.start_agree``, as
   a worker under an agent runs: ``Trainer.control_source``);
4. ``loss_scaler`` with ``clip``: clipping's own all-reduce of the norm of the unscaled
   gradients (``clipping.global_squares``; an iteration without overflow);
5. ``eval_batches`` > 0: evaluation's forward-only pass and its all-reduce
   (``engine.evaluation_sum``).

The optimizer and the host's reads do not communicate and are left out, as are the rare
collectives of a non-finite streak's start (``step_agreement.rank_hosts``) and a save.
``tests/unit/test_dry_run_matches_real.py`` checks the record against a real gloo
iteration's, call by call.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from sailor.comm.api import use_backend
from sailor.comm.nccl_replay import CommOp
from sailor.comm.strict import DryGroup, StrictBackend
from sailor.megatron_patch.clipping import global_squares
from sailor.megatron_patch.control import ControlRequest, start_agree
from sailor.megatron_patch.engine import evaluation_sum
from sailor.megatron_patch.grad_sync import sync_gradients
from sailor.megatron_patch.model import GPTStage
from sailor.megatron_patch.roles import RankRole, role_of
from sailor.megatron_patch.schedule import P2P, run_1f1b
from sailor.megatron_patch.step_agreement import start_step
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
    clip: bool = True,
    loss_scaler: bool = False,
    eval_batches: int = 1,
    control: bool = True,
) -> dict[int, list[CommOp]]:
    """Every rank's checked op log of one iteration of ``plan`` (global rank -> ops).

    The gradient sync, clipping and evaluation run only when ``build_stage`` gives real
    ``GPTStage`` modules (a stand-in stage, which tests use to replay large grids of
    schedules fast, has no layer-keyed parameters to sync and is not a model to evaluate).
    """
    if eval_batches < 0:
        raise ValueError(f"eval_batches={eval_batches}: must be >= 0")
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
        real = isinstance(stage, GPTStage)
        with use_backend(backend):
            schedule(stage, role, p2p, get)
            if real:
                sync_gradients(stage, sync)
            loss = torch.zeros(1, dtype=torch.float64, device=META)
            flag = torch.zeros((), dtype=torch.bool, device=META)
            start_step(loss, None, flag, False, rank, world)
            if control:
                start_agree(ControlRequest(), META, world)
            if real and clip and loss_scaler:
                global_squares(stage, role, META)
            if real and eval_batches:
                evaluation_sum(
                    stage, role, p2p, lambda k: get, eval_batches, 1.0, None, lambda: False
                )
        logs[rank] = backend.ops
    return logs
