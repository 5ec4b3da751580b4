"""Base classes shared by every schema: frozen, strict, described.

Every model forbids unknown fields and is immutable, so a value handed to the pure core
(simulator, planner, the controller's decision function) cannot be changed under it.
Wire messages (events, commands, manifests) additionally carry a schema version.
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from sailor.schemas._newer import drop_unknown

__all__ = ["SCHEMA_VERSION", "Frozen", "WireMessage", "field_error"]

SCHEMA_VERSION = 11
"""Version of the wire format this release writes. A release that adds a field to a wire
message (with a default) raises it; a reader validates a message of a newer version after
dropping the fields it does not know (``_newer``), and refuses versions below 1.
2: ``DesiredState.node_health``; ``NodeSpec`` (``nodes/<id>``) became versioned.
3: ``DesiredState.job_health``, ``forgiven_through``, ``phase_epoch``, ``suspect_checkpoint``
and ``deadline_stretch``; ``NodeHealth.signature`` and ``origin`` (added after 2 without
raising it: a reader of version 2 refused a state that held one).
4: ``AgentStatus.killing``; ``DesiredState.lost_nodes`` and ``sigabrt_reports``;
``NodeHealth.step``; ``TrainingConfig.nonfinite`` (hashed into the training digest only away
from its default); the message ``ClearBadRequest``.
5: ``DesiredState.agreed_health`` and ``launch_waited`` (each written only when not empty):
a release of version 4 was out, and it refuses a state of its own version that holds an
unknown field.
``NodeSpec.runtime`` (the node's torch build, NCCL version and the Sailor release its
workers run; a version-4 controller drops it and places nodes of any NCCL and release
together) and ``NodeFacts.arch_list`` (in ``NodeJoined``);
``DesiredState.job_precision`` (written only once set), ``DesiredState.plan_failed``
(written only when a replan failed) and
``TrainingConfig.allow_precision_change`` (hashed into the training digest only away from
its default).
6: ``DesiredState.in_place_reads`` (an in-place launch's checkpoint reads per node) and
``forgiven_nodes`` (the nodes an operator readmitted, per generation), each written only
when not empty, and ``reads_spent_through`` (written only during the generation it
names): a release of version 5
was out. ``GPUCalibration.communicator_bytes``
and ``communicators_covered``, ``GPUPrior.communicator_bytes`` and ``communicators_covered``,
``DeploymentStructure.process_groups`` (in a ``CalibrationRecord``'s calibration): a reader
of version 5 refuses a record of its own version that holds them.
7: ``DesiredState.periodic`` (the controller's periodic checkpoint, written only once one
was asked for; its ``directory``, the checkpoint root the save in flight was asked to),
``Checkpoint.periodic``, ``CommitRecord.periodic`` and ``AgentStatus.save_failed_step`` and
``save_failure`` (a periodic save that failed is reported, not fatal): a release of version
6 was out. ``ClearBadRequest.repoint`` (a release-6 leader drops it and clears the marks
only; ``sailor checkpoint clear-bad --repoint`` reads the records back and says so).
8: ``Checkpoint.drop_steps`` (the steps of saves the controller gave up on: once the save
commits, the committer also deletes those of them it saw committed when its save began) and
``DesiredState.drop_steps`` (the controller's list, kept across leaders): a release-7 agent
drops the first and its workers delete below ``prune_below`` only, as before; a release-7
controller sends none, which a release-8 agent takes as before; a release-7 leader drops
the second and writes its state without it (those steps stay on disk, as before).
9: ``DesiredState.rendezvous_retries`` (launches aborted in a row because rank 0's
rendezvous port was taken; written only when not 0): a release-8 standby that takes over
drops it and treats the next such abort as release 8 did (a failure of the in-place path).
Also ``CheckpointManifest.data`` (the identity of the data a checkpoint was trained on) and
``TrainingConfig.allow_data_change`` (hashed into the training digest only away from its
default): a release-8 worker drops the first and resumes without comparing the data, as
before; a release-8 agent drops the second, and refuses a Launch whose config sets it (its
digest differs), so no worker runs without the operator's override.
10: ``WorkerFailed.culprit`` and ``AgentStatus.culprit`` (the global rank a peer's failure
names as guilty; -1: none): a release-9 controller drops them and does not read the key
``culprit`` of the failure record in ``AgentStatus.failure`` either, so the culprit's node
goes uncharged, as before (the reporter is not charged); a release-9 agent sends none,
which a release-10 controller takes as -1.
11: ``DesiredState.accusations`` (who named whom guilty in the current generation, written
only when not empty): a release-10 standby that takes over drops it and charges the node a
peer's failure names by that report alone, as release 10 did (the reporter uncharged).
Also ``GPUCalibration.efficiency_link_gbps`` and ``GPUPrior.efficiency_link_gbps`` (the peak
of the links the efficiencies were read on; in a ``CalibrationRecord``'s calibration): a
release-10 controller drops them and takes each efficiency on every link as read, as
before."""

_log = logging.getLogger("sailor.schemas")
_dropped_seen: set[tuple[str, int, tuple[str, ...]]] = set()


class Frozen(BaseModel):
    """Immutable, strict base model."""

    # allow_inf_nan=False: JSON has no infinity or NaN (pydantic writes them as null, which
    # no reader accepts back), and no schema field means either.
    model_config = ConfigDict(
        frozen=True, extra="forbid", validate_default=True, allow_inf_nan=False
    )


class WireMessage(Frozen):
    """A message that crosses a process boundary (NATS, etcd, files)."""

    schema_version: int = Field(
        default=SCHEMA_VERSION,
        description="Version of the wire schema this message was written with.",
    )

    @model_validator(mode="before")
    @classmethod
    def _from_a_newer_release(cls, data: Any) -> Any:
        """A message of a newer version loses the fields this release does not know (a
        rolling upgrade's newer writer) and becomes one of this release's version; logged
        once per message type, version and fields."""
        if not isinstance(data, dict):
            return data
        version = data.get("schema_version")
        if isinstance(version, bool) or not isinstance(version, int):
            return data
        if version <= SCHEMA_VERSION:
            return data
        pruned, dropped = drop_unknown(cls, data)
        key = (cls.__name__, version, tuple(dropped))
        if dropped and key not in _dropped_seen:
            if len(_dropped_seen) >= 1024:  # a long-running daemon: bounded, logs again
                _dropped_seen.clear()
            _dropped_seen.add(key)
            _log.warning(
                "%s of schema_version %d (this release writes %d): ignoring fields it does "
                "not know: %s",
                cls.__name__,
                version,
                SCHEMA_VERSION,
                ", ".join(dropped),
            )
        # what was read is this release's view of the message: written back, it says so
        return pruned | {"schema_version": SCHEMA_VERSION}

    def model_post_init(self, context: Any, /) -> None:
        if self.schema_version < 1:
            raise ValueError(
                f"schema_version={self.schema_version} is not supported (versions start at 1)"
            )


def field_error(field: str, value: object, why: str) -> ValueError:
    """A ValueError that names the offending field and value."""
    return ValueError(f"{field}={value!r}: {why}")
