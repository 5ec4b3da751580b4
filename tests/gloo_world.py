"""A spawned test rank's gloo world and its engine trainer (tiny-gpt on CPU): what the
engine tests that run real ranks each spelled."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from sailor.megatron_patch.engine import TrainConfig, Trainer
from sailor.megatron_patch.groups import build_process_groups
from sailor.megatron_patch.model import tiny_model
from sailor.megatron_patch.roles import role_of
from sailor.schemas import Plan


def join_gloo(store: str, rank: int, world_size: int, timeout_s: float) -> None:
    """One thread per rank (two cores shared by the ranks) in a gloo world rendezvousing on
    the file ``store``."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )


def tiny_trainer(plan: Plan, rank: int, cfg: TrainConfig, timeout_s: float) -> Trainer:
    """``rank``'s trainer of ``plan`` (its model tiny-gpt-shaped) on the CPU, in the world
    already joined, its process groups built with ``timeout_s``."""
    spec = tiny_model(plan.model, plan.global_batch_size)
    role = role_of(plan, rank)
    groups = build_process_groups(plan, role, spec.tie_embeddings, timeout_s)
    return Trainer(plan, spec, role, groups, cfg, torch.device("cpu"))
