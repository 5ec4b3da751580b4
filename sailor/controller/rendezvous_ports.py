"""A generation's rendezvous port taken on rank 0's node: nobody's fault, try the next port.

Generation g's workers rendezvous at rank 0's node, port ``base_port + g % 1000``
(``launch._master``). Only the base is checked, when the controller's config is read: any
other process on that node may hold g's port (a test's server, another job's store, a
client's source port below the ephemeral range). Rank 0's ``TCPStore`` then cannot bind it
and the rank fails at once with ``EADDRINUSE``; its record says ``origin="rendezvous"``
(``megatron_patch.errors.classify``, ``failure_text.FailureCause.port_taken``). That is no
failure of the node, of a peer, or of the in-place path: the next generation rendezvous on
the next port, and it almost always binds. So an abort whose only own failures are taken
ports (:func:`port_taken`) charges nobody (``node_health.charge`` leaves such a failure out
while :func:`forgiven`), leaves the in-place path as it was (no fallback to the restart
path) and counts itself in ``DesiredState.rendezvous_retries``; the next launch, at the
next generation, says why (:func:`launch_note`). Bounded: past :data:`RENDEZVOUS_RETRIES`
such aborts in a row, the node cannot host a rendezvous on any of as many ports (something
there takes them all): the failure is then the node's own, counted against it like any
other, and the in-place path falls back as for any failure. Any other abort, and a
generation that runs, resets the count.

Why not check the port first: the agent can bind and close it, but another process can take
it between that check and the store's bind, and the store's own bind already fails within
milliseconds of the worker's start, with the port and errno in its message; the cost was in
how the failure was read (a peer's, a failed in-place path), not in noticing it.

Pure: no I/O, no clock. Must never import ``decide.py`` or its phase modules (they import
this one).
"""

from __future__ import annotations

from collections.abc import Mapping

from sailor.controller.failure_text import parse_failure
from sailor.schemas.runtime import DesiredState

__all__ = [
    "RENDEZVOUS_RETRIES",
    "abort_note",
    "forgiven",
    "launch_note",
    "port_taken",
    "retries_after",
]

RENDEZVOUS_RETRIES = 3
"""Launches aborted in a row by a taken rendezvous port that are nobody's fault. One is a
port some process happened to hold; three in a row on three different ports is a node whose
ports are taken as fast as they are tried (a port scanner's or another job's range) or that
cannot listen at all: the node's, from the fourth on."""


def port_taken(failures: Mapping[str, str]) -> list[str]:
    """The nodes (sorted) whose failure (node -> ``AgentStatus.failure``) is a taken
    rendezvous port, when no other node's failure is its own (peers' failures aside): an
    abort these explain. [] otherwise."""
    causes = {n: parse_failure(t) for n, t in failures.items()}
    taken = sorted(n for n, c in causes.items() if c.port_taken)
    if not taken or any(c.own and not c.port_taken for c in causes.values()):
        return []
    return taken


def retries_after(d: DesiredState, taken: list[str]) -> int:
    """``DesiredState.rendezvous_retries`` after an abort of ``d``'s generation whose taken
    ports are ``taken`` (:func:`port_taken`): one more, or 0 for an abort of another cause."""
    return d.rendezvous_retries + 1 if taken else 0


def forgiven(d: DesiredState) -> bool:
    """Whether a taken-port failure of ``d``'s generation is nobody's fault: within the
    bound of such aborts in a row (a state whose count is 0, an abort of other causes,
    forgives one too: a taken port is never a node's own until the bound is passed)."""
    return d.rendezvous_retries <= RENDEZVOUS_RETRIES


def abort_note(d: DesiredState, taken: list[str], tries: int) -> str:
    """The abort reason's note for an abort explained by taken ports ('' for none)."""
    if not taken:
        return ""
    port = d.master.rsplit(":", 1)[-1] if d.master else "?"
    nodes = ", ".join(taken)
    if tries <= RENDEZVOUS_RETRIES:
        return (
            f"rendezvous port {port} taken on {nodes} by another process: not counted against "
            f"it, the next generation rendezvous on the next port ({tries} of "
            f"{RENDEZVOUS_RETRIES} in a row)"
        )
    return (
        f"rendezvous port taken on {nodes} at {tries} launches in a row (the last {port}): "
        "counted against it from now on"
    )


def launch_note(d: DesiredState) -> str:
    """What a launch after ``d`` (a TEARDOWN) adds to its ``path_reason``: the previous
    generation's taken port, when its abort was for that ('' otherwise)."""
    if not d.aborted or d.rendezvous_retries == 0 or d.rendezvous_retries > RENDEZVOUS_RETRIES:
        return ""
    port = d.master.rsplit(":", 1)[-1] if d.master else "?"
    return (
        f"generation {d.generation}'s rendezvous port {port} was taken: relaunched on the "
        f"next port ({d.rendezvous_retries} of {RENDEZVOUS_RETRIES})"
    )
