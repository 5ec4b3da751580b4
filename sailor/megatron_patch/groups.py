"""torch.distributed process groups for one rank of a plan.

The thin I/O shell around :mod:`~sailor.megatron_patch.roles` and
:mod:`~sailor.megatron_patch.sync_groups`: it turns their pure descriptions into process
groups. ``new_group`` is collective over the whole world, so every rank creates every group
the layout lists (``process_groups.engine_group_ranks``: TP groups of every replica, then
every gradient-sync group, each rank set once) in the same order. Pipeline p2p uses the
default group. The simulator counts each rank's communicators from the same list.

Nothing here decides anything: change the layout in the pure modules, not here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from sailor.megatron_patch.roles import RankRole, replica_ranks
from sailor.megatron_patch.sync_groups import SyncItem, rank_sync_items, sync_groups
from sailor.megatron_patch.tp_layers import TPContext
from sailor.schemas.plan import Plan
from sailor.simulator.process_groups import engine_group_ranks

__all__ = ["ProcessGroups", "build_process_groups"]


@dataclass
class ProcessGroups:
    """This rank's groups: its TP context and its gradient-sync groups in order."""

    tp: TPContext
    sync: list[tuple[SyncItem, Any]] = field(default_factory=list)
    """(what this rank contributes, process group) in the global group order."""
    num_groups_created: int = 0


def build_process_groups(
    plan: Plan, role: RankRole, tie_embeddings: bool, timeout_s: float
) -> ProcessGroups:
    """Create every group of ``plan`` (collective: all ranks must call it) and keep ours.

    Requires ``torch.distributed`` to be initialised with the plan's world size.
    """
    world = dist.get_world_size()
    if world != role.world_size:
        raise ValueError(f"world size {world} != plan world size {role.world_size}")
    timeout = timedelta(seconds=timeout_s)
    by_ranks = {
        ranks: dist.new_group(list(ranks), timeout=timeout)
        for ranks in engine_group_ranks(plan, tie_embeddings)
    }
    tp_group: Any = (
        by_ranks[replica_ranks(plan, role.pipeline, role.stage)] if role.tp > 1 else None
    )
    groups = sync_groups(plan, tie_embeddings)
    mine = [
        (item, by_ranks[tuple(sorted(item.group.ranks))])
        for item in rank_sync_items(plan, groups, role.rank)
    ]
    return ProcessGroups(
        tp=TPContext(size=role.tp, rank=role.tp_rank, group=tp_group),
        sync=mine,
        num_groups_created=len(by_ranks),
    )
