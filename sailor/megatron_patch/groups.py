"""torch.distributed process groups for one rank of a plan.

The thin I/O shell around :mod:`~sailor.megatron_patch.roles` and
:mod:`~sailor.megatron_patch.sync_groups`: it turns their pure descriptions into process
groups. ``new_group`` is collective over the whole world, so every rank creates every group
(TP groups of every replica, then every gradient-sync group) in the same order; groups with
the same rank set are created once and shared. Pipeline p2p uses the default group.

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
    by_ranks: dict[tuple[int, ...], Any] = {}

    def get(ranks: tuple[int, ...]) -> Any:
        key = tuple(sorted(ranks))
        if key not in by_ranks:
            by_ranks[key] = dist.new_group(list(key), timeout=timeout)
        return by_ranks[key]

    tp_group: Any = None
    for pi, p in enumerate(plan.pipelines):
        for si, s in enumerate(p.stages):
            if s.replica.tp > 1:
                pg = get(replica_ranks(plan, pi, si))
                if (pi, si) == (role.pipeline, role.stage):
                    tp_group = pg
    groups = sync_groups(plan, tie_embeddings)
    pgs = [get(g.ranks) for g in groups]
    mine = [(item, pgs[item.group.index]) for item in rank_sync_items(plan, groups, role.rank)]
    return ProcessGroups(
        tp=TPContext(size=role.tp, rank=role.tp_rank, group=tp_group),
        sync=mine,
        num_groups_created=len(by_ranks),
    )
