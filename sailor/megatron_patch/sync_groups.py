"""Gradient-sync groups of a plan: which ranks all-reduce which slice of which layer.

The layout is pure and lives with the rest of the engine's group layout in
:mod:`sailor.simulator.process_groups` (the simulator prices the engine's communicators from
it); this module keeps the engine's import path.
"""

from __future__ import annotations

from sailor.simulator.process_groups import (
    SyncGroup,
    SyncItem,
    SyncKind,
    rank_sync_items,
    sync_groups,
)

__all__ = ["SyncGroup", "SyncItem", "SyncKind", "rank_sync_items", "sync_groups"]
