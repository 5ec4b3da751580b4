"""Charging the guilty rank's node: a peer's failure that names the rank that caused it.

A rank that receives bytes from a peer's object collective that do not decode, an
oversized size or an object of the wrong shape fails with ``PeerObjectError`` naming the
*sending* rank (``sailor.comm.codec``). Its record says ``origin: "peer"``, so its own
node is not charged (``controller/node_health.py``), and it names the sender as
``culprit`` (its global rank; ``sailor.megatron_patch.errors.failure_record``; an in-place
worker that holds the broken world instead names it in its held line, and its agent's
status in ``AgentStatus.culprit``: ``failing_nodes.held_reports``). Without
this module nobody was charged: a hostile or corrupted rank that sends garbage to every
peer stayed in every next layout while its honest peers failed, generation after
generation. Here the culprit rank is mapped to the node that ran it in the generation
(``DesiredState.placement``: node -> global ranks) and that node is charged with a
failure of its own, :data:`BLAMED`, as if it had reported one; the reporter is not.

- A culprit is read from a ``peer`` record only (a record of the node's own failure
  charges that node, whatever else it names).
- A culprit that is no rank of the layout (negative, not an integer, past the last rank:
  a forged or corrupted record) is ignored, with a note naming the reporter and the value
  (the note reaches the decision's reason, and so the audit log); never an error.
- A node whose own failure is reported keeps that one (it is counted once a generation),
  unless it is a SIGABRT: that rank's watchdog may fire after its peers failed of its
  bytes, and a SIGABRT alone is charged to nobody.
- Several reporters naming ranks of one node charge it once (the first reporter by id).
- What this rests on is the reporter's word: a hostile reporter can name an honest rank,
  once a generation (a node reports one failure), and its failure ends that generation.

Pure: no I/O, no clock, inputs never modified. Must never import the agent, torch or
``megatron_patch`` (the record's keys are read by name, ``controller/failure_text.py``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from sailor.controller.failure_text import FailureCause, abort_signal

__all__ = ["BLAMED", "Blame", "blame", "rank_of"]

BLAMED = "PeerBlamed"
"""Error type of the cause a node is charged with when a rank it ran is named as guilty by
a peer's failure (:func:`blame`); about that node's process, however many report it."""

_RANK = re.compile(r"\d{1,10}")


@dataclass(frozen=True)
class Blame:
    """The nodes charged for their ranks' fault and the sentences that say so."""

    causes: dict[str, FailureCause] = field(default_factory=dict)
    """culprit node -> the failure it is charged with (a record of origin ``local``)."""
    notes: list[str] = field(default_factory=list)
    """One sentence per culprit ignored (naming the reporter and the value). The cause of a
    node charged names the rank, the reporter and what it reported (``summary``)."""


def rank_of(culprit: str, ranks: int) -> int | None:
    """The rank a record's ``culprit`` text names when it is one of the layout's ``ranks``
    (0 .. ranks-1); None when it is not (negative, not an integer, out of range)."""
    if not _RANK.fullmatch(culprit):
        return None
    rank = int(culprit)
    return rank if rank < ranks else None


def blame(placement: Mapping[str, tuple[int, ...]], causes: Mapping[str, FailureCause]) -> Blame:
    """The nodes of ``placement`` (node -> global ranks) that ran a rank a ``peer`` failure
    of ``causes`` (node -> its reported failure) names as its culprit, each with the cause
    it is charged with (module docstring)."""
    node_of = {r: n for n, ranks in placement.items() for r in ranks}
    # a layout's ranks are 0 .. N-1; a rank missing from the placement is no rank either
    ranks = max(node_of, default=-1) + 1
    out: dict[str, FailureCause] = {}
    notes: list[str] = []
    for reporter in sorted(causes):
        c = causes[reporter]
        if c.origin != "peer" or not c.culprit:
            continue
        rank = rank_of(c.culprit, ranks)
        node = node_of.get(rank) if rank is not None else None
        if rank is None or node is None:
            notes.append(
                f"culprit {c.culprit!r} named by {reporter} ignored: not a rank of the layout "
                f"(0..{ranks - 1})"
            )
            continue
        own = causes.get(node)
        if node in out or (own is not None and own.own and not abort_signal(own.summary)):
            continue
        message = f"rank {rank} named guilty by {reporter}: {c.summary}"
        record = {"origin": "local", "retry": True, "error_type": BLAMED, "message": message}
        out[node] = FailureCause("local", True, json.dumps(record))
    return Blame(out, notes)
