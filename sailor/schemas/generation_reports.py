"""What the nodes of one generation reported, kept across the controller's passes.

An Abort clears an agent's failure, so a report seen in one pass is gone by the next; the
rules that judge a generation's failures (``controller/node_health.py``,
``controller/culprits.py``) count every report of it, whichever pass it came in. Each
record here holds one kind of report (:class:`SigabrtReports`, :class:`Accusations`) for
one generation, and is empty (generation -1) or names both its generation and what was
reported: :class:`GenerationReports` checks that once for both. Values only: no I/O.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Self

from pydantic import Field, model_validator

from sailor.schemas._base import Frozen, field_error

__all__ = [
    "MAX_NODE_LIST",
    "Accusations",
    "GenerationReports",
    "SigabrtReports",
    "sorted_node_ids",
]

MAX_NODE_LIST = 4096
"""Most node ids a list of the desired state about one generation holds (``lost_nodes``,
``SigabrtReports.nodes``, ``Accusations.named``): more than any layout places (the
benchmarks go to 512 nodes), so nothing is cut in practice, and a bound all the same on
what one etcd value carries."""


def sorted_node_ids(field: str, nodes: tuple[str, ...]) -> None:
    """Raise (naming ``field`` and the list) unless ``nodes`` are node ids, sorted, without
    repeats."""
    if list(nodes) != sorted(set(nodes)):
        raise field_error(field, list(nodes), "must be sorted, without repeats")
    if any(not n for n in nodes):
        raise field_error(field, list(nodes), "an empty node id")


class GenerationReports(Frozen):
    """One generation's reports of one kind: ``generation`` (each subclass's field, with its
    own description) and the field :attr:`reported` names, both set or neither (the empty
    record, generation -1). The check's error names ``generation``, its value and what was
    reported."""

    reported: ClassVar[str]
    """The field holding the reports (a tuple or a dict of node ids)."""
    noun: ClassVar[str]
    """What the reports are, in the error (``reports``, ``accusations``)."""

    @model_validator(mode="after")
    def _all_or_nothing(self) -> Self:
        generation: int = getattr(self, "generation")  # noqa: B009 (each subclass's field)
        held: Any = getattr(self, self.reported)
        if (generation < 0) != (not held):
            shown = dict(held) if isinstance(held, dict) else list(held)
            raise field_error(
                "generation",
                generation,
                f"{self.noun} name their generation and nodes ({shown}), the empty record "
                "(generation -1) neither",
            )
        return self


class SigabrtReports(GenerationReports):
    """The placed nodes whose workers of one generation reported a SIGABRT (NCCL's
    watchdog giving up on a collective) since its abort (``DesiredState.sigabrt_reports``):
    an Abort clears an agent's failure, so a report seen in one pass is gone by the next,
    and the hang rule (``controller/node_health.py``: only SIGABRTs, from at least two
    nodes and more than half of the placed ones) counts every report of the generation,
    whichever pass it came in. The empty record (generation -1): none."""

    reported: ClassVar[str] = "nodes"
    noun: ClassVar[str] = "reports"

    generation: int = Field(
        default=-1, ge=-1, description="Generation the reports are of; -1: none."
    )
    nodes: tuple[str, ...] = Field(
        default=(),
        max_length=MAX_NODE_LIST,
        description="Placed nodes (sorted) that reported a SIGABRT of that generation.",
    )
    cause: str = Field(
        default="", max_length=256, description="The first SIGABRT's summary, as reported."
    )

    @model_validator(mode="after")
    def _sorted(self) -> Self:
        sorted_node_ids("nodes", self.nodes)
        return self


class Accusations(GenerationReports):
    """Who named whom guilty in one generation (``DesiredState.accusations``): each placed
    node whose ``peer`` failure named a culprit rank, and the node that ran that rank
    (``controller/culprits.py``). An accused node is charged alone only once reporters on
    two nodes other than it named it (or its own failure was reported); the reports come
    in over several passes (the abort comes at the first, and an Abort clears an agent's
    failure), so those seen are kept here. The empty record (generation -1): none."""

    reported: ClassVar[str] = "named"
    noun: ClassVar[str] = "accusations"

    generation: int = Field(
        default=-1, ge=-1, description="Generation the accusations are of; -1: none."
    )
    named: dict[Annotated[str, Field(min_length=1)], Annotated[str, Field(min_length=1)]] = Field(
        default_factory=dict,
        max_length=MAX_NODE_LIST,
        description="Reporting node -> the node that ran the rank its first accusation of "
        "the generation named (one accusation a reporter, a generation).",
    )
