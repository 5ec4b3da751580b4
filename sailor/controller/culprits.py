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
(``DesiredState.placement``: node -> global ranks), the *accused*, which is charged with a
failure of its own, :data:`BLAMED`, as if it had reported one.

An accusation is a reporter's word, and any node can write its own failure record: a
hostile node naming an honest rank in every generation it ends got that rank's node
charged each time, itself never, until the honest node was excluded. So an accusation
alone never costs the accused more than it costs the accuser:

- **Corroborated**: reporters on at least :data:`MIN_ACCUSERS` distinct nodes other than
  the accused name ranks of it in the same generation. The honest case: a rank that sends
  garbage in an ``all_gather_object`` is received by every other rank, so every other node
  reports it. The accused is charged, its accusers are not.
- **Confirmed by the accused**: the accused node reported a failure of its own in the
  generation (a rank that died mid-send): that one is counted against it, as before, and
  the accusers are not charged.
- **A dispute**: one accuser alone. Its evidence and the accused's are symmetric (nothing
  tells an honest receiver of garbage from a liar), so both are charged: the accused with
  :data:`BLAMED`, the accuser with :data:`DISPUTED`. A liar pays for each accusation what
  its victim pays, and cannot get an honest node excluded before itself (their counts and
  backoffs run together); one naming a new victim each generation is counted every
  generation, each victim once. A reporter's accusation is its first of the generation;
  another naming another node is ignored with a note (else one failure bought a charge
  on every node). An honest lone receiver pays too: the price of not knowing; with a
  point-to-point object send or a two-node layout every accusation is a dispute, and the
  garbage sender is still excluded, with the reporter, at the policy's count (both come
  back after their backoff: where only the two of them can run the job, it runs on
  probation until the same dispute excludes both again, twice as long).
- Weighed over the whole generation, not one ``decide`` pass: the controller aborts at
  the first failure it sees, and the other receivers' reports come in at later passes
  (the Abort clears a status's failure). The accusations seen so far are kept in the
  desired state (``DesiredState.accusations``, so a new leader inherits them and a
  replay of the audit log reproduces them), and a dispute charge whose accusation is
  corroborated later (or confirmed by the accused's own failure) is taken back
  (``node_health.take_back``), as a node counted before its peers' reports came in is.
- A node that accuses one of its own ranks is charged once, as the accused.
- A dispute where the accuser or the accused cannot be charged (an operator forgave its
  failures of the generation: ``sailor node readmit``) charges nobody (noted); the
  accusation still counts towards corroboration.
- A culprit is read from a ``peer`` record only (a record of the node's own failure
  charges that node, whatever else it names).
- A culprit that is no rank of the layout (negative, not an integer, past the last rank:
  a forged or corrupted record) is ignored, with a note naming the reporter and the value
  (the note reaches the decision's reason, and so the audit log); never an error.
- A node whose own failure is reported keeps that one (it is counted once a generation),
  unless it is a SIGABRT: that rank's watchdog may fire after its peers failed of its
  bytes, and a SIGABRT alone is charged to nobody (nor does it confirm an accusation).
- What this still rests on: :data:`MIN_ACCUSERS` hostile nodes that agree can frame an
  honest one, as they can fail a job together. And the bytes carry no signature: a ring
  all-gather relays each rank's block through the ranks between it and each receiver, so a
  hostile relay can alter an honest rank's bytes on their way, and the honest receivers
  downstream then name that rank, corroborating each other.

Why a dispute charges both rather than nobody: recorded but uncharged, a lone accusation
left a garbage sender that only one node receives from (a two-node layout, a point-to-point
send) in every layout for ever, and its honest receiver failing each time; and a count of
such accusations across generations is still one node's word. Charging both keeps the rule
level: the policy's count and backoff exclude the pair, and a leader inherits the charges
like any other. A lone accuser is the common honest case only where nobody else could see
the bytes, and then nothing else can tell who is lying.

Pure: no I/O, no clock, inputs never modified. Must never import the agent, torch or
``megatron_patch`` (the record's keys are read by name, ``controller/failure_text.py``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from sailor.controller.failure_text import FailureCause, abort_signal

__all__ = ["BLAMED", "DISPUTED", "MIN_ACCUSERS", "Blame", "blame", "rank_of"]

BLAMED = "PeerBlamed"
"""Error type of the cause a node is charged with when a rank it ran is named as guilty by
a peer's failure (:func:`blame`); about that node's process, however many report it."""

DISPUTED = "BlameDisputed"
"""Error type of the cause a node is charged with when its failure named another node's
rank as guilty and no other node corroborated it (:func:`blame`): the accuser's share of
the dispute."""

MIN_ACCUSERS = 2
"""Distinct nodes, other than the accused, whose reports make an accusation corroborated:
one more than a single hostile node can write."""

_RANK = re.compile(r"\d{1,10}")


@dataclass(frozen=True)
class Blame:
    """The nodes charged by the generation's accusations and the sentences that say so."""

    causes: dict[str, FailureCause] = field(default_factory=dict)
    """node -> the failure it is charged with (a record of origin ``local``): an accused
    (:data:`BLAMED`) or a lone accuser (:data:`DISPUTED`)."""
    notes: list[str] = field(default_factory=list)
    """One sentence per accusation ignored (naming the reporter and the value) or charging
    nobody. The cause of a node charged names the rank, the reporter and what
    it reported (``summary``)."""
    named: dict[str, str] = field(default_factory=dict)
    """The generation's accusations: the earlier passes' and this one's, reporter -> the
    accused node (``DesiredState.accusations``)."""
    corroborated: frozenset[str] = frozenset()
    """Reporters whose accusation is corroborated (or confirmed by the accused's own
    failure): a :data:`DISPUTED` count of theirs of the generation is taken back."""


def rank_of(culprit: str, ranks: int) -> int | None:
    """The rank a record's ``culprit`` text names when it is one of the layout's ``ranks``
    (0 .. ranks-1); None when it is not (negative, not an integer, out of range)."""
    if not _RANK.fullmatch(culprit):
        return None
    rank = int(culprit)
    return rank if rank < ranks else None


def _charged(error: str, message: str) -> FailureCause:
    """A cause of the node's own (origin ``local``, retried) with ``error: message``."""
    record = {"origin": "local", "retry": True, "error_type": error, "message": message}
    return FailureCause("local", True, json.dumps(record))


def blame(
    placement: Mapping[str, tuple[int, ...]],
    causes: Mapping[str, FailureCause],
    earlier: Mapping[str, str] | None = None,
    own: Collection[str] = (),
    spared: Collection[str] = (),
) -> Blame:
    """The nodes of ``placement`` (node -> global ranks) charged by the accusations of a
    generation, each with the cause it is charged with (module docstring).

    ``causes``: node -> its failure reported now (the ``peer`` ones name their culprit).
    ``earlier``: the generation's accusations of earlier passes, reporter -> accused node.
    ``own``: nodes a failure of their own was counted against earlier in the generation
    (those of ``causes``, but a SIGABRT, count too). ``spared``: nodes whose failures of
    the generation are not counted (an operator forgave them)."""
    node_of = {r: n for n, ranks in placement.items() for r in ranks}
    # a layout's ranks are 0 .. N-1; a rank missing from the placement is no rank either
    ranks = max(node_of, default=-1) + 1
    named = dict(earlier or {})
    now: dict[str, tuple[int, FailureCause]] = {}  # this pass's accusations: rank, record
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
        if reporter not in placement:  # never a caller's: its failures are the placed nodes'
            continue
        first = named.setdefault(reporter, node)
        if first != node:
            notes.append(
                f"culprit {rank} ({node}) named by {reporter} ignored: it named a rank of "
                f"{first} earlier in the generation (one accusation a reporter)"
            )
            continue
        now[reporter] = (rank, c)
    confirmed = set(own) | {n for n, c in causes.items() if c.own and not abort_signal(c.summary)}
    out: dict[str, FailureCause] = {}
    cleared: set[str] = set()
    by_accused: dict[str, list[str]] = {}  # accused -> its accusers (itself too), by id
    for reporter in sorted(named):
        by_accused.setdefault(named[reporter], []).append(reporter)
    for accused in sorted(by_accused):
        accusers = [r for r in by_accused[accused] if r != accused]
        current = [r for r in by_accused[accused] if r in now]
        if accused in confirmed:  # its own failure is counted, and bears the accusers out
            cleared |= set(accusers)
            continue
        # a node naming a rank of its own is charged on its own word, once
        by_itself = named.get(accused) == accused
        if by_itself or len(accusers) >= MIN_ACCUSERS:
            cleared |= set(accusers)
            if current:
                rank, c = now[current[0]]
                message = f"rank {rank} named guilty by {current[0]}: {c.summary}"
                out.setdefault(accused, _charged(BLAMED, message))
            continue
        if not current:  # seen in an earlier pass: charged (or spared) then
            continue
        rank, c = now[current[0]]
        (accuser,) = accusers  # named by another node: one, or it is corroborated
        if accuser in spared or accused in spared:  # one of the two cannot be charged
            whose = accuser if accuser in spared else accused
            notes.append(
                f"rank {rank} ({accused}) named guilty by {accuser} alone charges nobody: "
                f"{whose}'s failures of the generation are forgiven"
            )
            continue
        message = (
            f"rank {rank} named guilty by {accuser} alone ({accuser} charged too, "
            f"uncorroborated): {c.summary}"
        )
        out.setdefault(accused, _charged(BLAMED, message))
        message = f"named rank {rank} of {accused} guilty, no other node corroborates it: "
        out.setdefault(accuser, _charged(DISPUTED, message + c.summary))
    return Blame(out, notes, named, frozenset(cleared))
