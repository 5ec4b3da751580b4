"""Admission by NATS token: which registered nodes share a NATS subject token with another.

NATS subject tokens hold no ``.``: a node id becomes its token through ``safe_token``, so
``gpu.1`` and ``gpu_1`` share one command subject and one event subject, and each agent
answers the other's commands (which reply reaches the controller is a race: an agent's
refusal of a command for the other node was recorded as the addressed node's, and resent
for ever). Logins whose tokens clash are refused when certificates are issued and agents
refuse to start beside a clashing registration; a deployment without ``security:``, with
certificates issued before that check, or agents of an older release can still register
such a pair. The controller leaves such nodes out, with the reason naming both, as it does a
node of another runtime (``controller/runtime_admission.py``): audited once, shown by
``sailor status``. One of the pair that the running layout holds stays (its job goes on);
every other member of the pair is left out.

Pure: no I/O, no clock; inputs never modified. Called by ``decide.not_admitted``. Must never
import NATS or etcd clients (``safe_token`` is the pure name rule of ``coordination.names``).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from sailor.coordination.names import safe_token
from sailor.schemas.hardware import NodeSpec

__all__ = ["token_clashes"]


def token_clashes(
    placement: Collection[str], nodes: Mapping[str, NodeSpec], candidates: Collection[str]
) -> dict[str, str]:
    """The ``candidates`` whose NATS token another registered node (of ``nodes``) shares,
    each with the reason; of a group, the first (sorted) that ``placement`` holds is kept."""
    groups: dict[str, list[str]] = {}
    for n in sorted(nodes):
        groups.setdefault(safe_token(n), []).append(n)
    out: dict[str, str] = {}
    for token, group in groups.items():
        if len(group) < 2:
            continue
        placed = [n for n in group if n in placement]
        kept = placed[0] if placed else None
        for n in group:
            if n == kept or n not in candidates:
                continue
            others = ", ".join(repr(o) for o in group if o != n)
            out[n] = (
                f"node id {n!r} shares its NATS token {token!r} with registered node "
                f"{others}: NATS cannot tell their commands and events apart; give every "
                "agent a node id that differs in more than '.' and '_'"
            )
    return out
