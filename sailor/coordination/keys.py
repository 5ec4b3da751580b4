"""Names of every etcd key and NATS subject the runtime uses, in one place.

etcd (all under ``/sailor/<job>/``)::

    leader            controller id, bound to the leader's lease; epoch = its create revision
    desired           DesiredState (plan, phase, generation), written only by the leader (guarded)
    nodes/<id>        NodeSpec, bound to the agent's lease (expiry = the node left)
    status/<id>       AgentStatus, bound to the agent's lease
    notices/<id>      NoticeRecord: a preemption notice seen for a node (guarded)
    ckpt/<step>       CommitRecord: a checkpoint committed by every shard (guarded)
    calibration/current         CalibrationPointer: the current fitted calibration (guarded)
    calibration/versions/<n>    CalibrationRecord: fitted calibration version n (guarded)
    readmit/<id>, clear-bad/<id>  operators' requests, deleted by the leader that applies them
    asked/<kind>/<id>  empty witness of a request written, bound to its command's lease
    taken/<kind>/<id>  empty mark of a leader's transaction that took a request without a
                       desired state, bound to the leader's lease; deleted once settled
    event-stream      EventStreamState: the event stream could not be placed (guarded, bound
                      to the leader's lease)

NATS::

    sailor.<job>.events.<source>.<kind>   JetStream stream SAILOR_<JOB>_EVENTS (``stream``; dedup by
                                 Nats-Msg-Id); <source> is the publishing node's id, so a NATS
                                 permission can let an agent publish only its own node's events
    sailor.<job>.cmd.<node id>   commands to one agent, request/reply (the reply is the ack)
"""

from __future__ import annotations

from pydantic import Field, field_validator

from sailor.coordination.names import check_job, safe_token
from sailor.schemas._base import Frozen

__all__ = ["Keys", "event_subject_source", "safe_token"]


def event_subject_source(subject: str, job: str | None = None) -> str | None:
    """The ``<source>`` of ``sailor.<job>.events.<source>.<kind>`` (of ``job`` if given), or
    None when ``subject`` is not an event subject."""
    parts = subject.split(".")
    if len(parts) != 5 or parts[0] != "sailor" or parts[2] != "events":
        return None
    if job is not None and parts[1] != safe_token(job):
        return None
    return parts[3]


class Keys(Frozen):
    """Key and subject names for one job."""

    job: str = Field(
        min_length=1,
        max_length=64,
        description="Job name: letters, digits, '.', '_' and '-' (``names.JOB_PATTERN``).",
    )

    @field_validator("job")
    @classmethod
    def _job_name(cls, v: str) -> str:
        return check_job(v)

    @property
    def root(self) -> str:
        return f"/sailor/{self.job}/"

    @property
    def leader(self) -> str:
        return self.root + "leader"

    @property
    def desired(self) -> str:
        return self.root + "desired"

    @property
    def nodes(self) -> str:
        return self.root + "nodes/"

    def node(self, node_id: str) -> str:
        return self.nodes + node_id

    @property
    def statuses(self) -> str:
        return self.root + "status/"

    def status(self, node_id: str) -> str:
        return self.statuses + node_id

    @property
    def notices(self) -> str:
        return self.root + "notices/"

    def notice(self, node_id: str) -> str:
        return self.notices + node_id

    @property
    def checkpoints(self) -> str:
        return self.root + "ckpt/"

    def checkpoint(self, step: int) -> str:
        # zero-padded so that a prefix listing comes back in step order
        return f"{self.checkpoints}{step:012d}"

    @property
    def readmits(self) -> str:
        """Operators' readmit requests (``ReadmitRequest``, ``sailor node readmit``), one key
        each. Under the job's root, which controllers (and root) may write and agents may
        not (``sailor certs etcd-rbac``): an agent cannot readmit itself."""
        return self.root + "readmit/"

    def readmit(self, request_id: str) -> str:
        return self.readmits + request_id

    @property
    def clear_bads(self) -> str:
        """Operators' requests to clear bad checkpoint marks (``ClearBadRequest``, ``sailor
        checkpoint clear-bad``), one key each; written as the readmit requests are."""
        return self.root + "clear-bad/"

    def clear_bad(self, request_id: str) -> str:
        return self.clear_bads + request_id

    @property
    def asked(self) -> str:
        """Witnesses of the operators' requests: an empty key per request, written with it
        in one transaction and bound to the command's lease, never mirrored by the leader
        (which deletes the request when it applies it). A command whose write lost its
        answer (etcd restarted after the commit) learns from it that the write committed,
        whether or not a leader took the request since."""
        return self.root + "asked/"

    def asked_witness(self, request_key: str) -> str:
        """The witness of the request at ``request_key`` (``asked/readmit/<id>``)."""
        if not request_key.startswith(self.root):
            raise ValueError(f"request key {request_key!r} is not under {self.root!r}")
        return self.asked + request_key.removeprefix(self.root)

    @property
    def takens(self) -> str:
        """Marks of the leader's takes (``Executor._take``, ``Executor.write_desired``): a
        key per request taken, holding the epoch that took it and the request's audit record
        (``controller/take_marks.py``), written in the transaction that deletes the request
        and bound to no lease. A take whose answer was lost is known committed by its mark,
        not by the request's key being gone (its command's withdrawal deletes the key
        alike), also by the next leader when the term ended first."""
        return self.root + "taken/"

    def taken(self, request_key: str) -> str:
        """The mark of the take of the request at ``request_key`` (``taken/readmit/<id>``)."""
        if not request_key.startswith(self.root):
            raise ValueError(f"request key {request_key!r} is not under {self.root!r}")
        return self.takens + request_key.removeprefix(self.root)

    @property
    def calibration(self) -> str:
        """Pointer to the current online-calibration version."""
        return self.root + "calibration/current"

    @property
    def calibrations(self) -> str:
        return self.root + "calibration/versions/"

    def calibration_version(self, version: int) -> str:
        # zero-padded so that a prefix listing comes back in version order
        return f"{self.calibrations}{version:08d}"

    @property
    def event_stream(self) -> str:
        """The leader's ``EventStreamState`` (written only after a failed placement)."""
        return self.root + "event-stream"

    @property
    def event_stream_shortage(self) -> str:
        """The start of a shortage of NATS servers for the event stream, as an
        ``EventStreamState`` (not placed): written unleased by the leader whose term it
        began in, read by each new leader at its first failed placement (its episode counts
        from there), deleted at a term's first placement. Bound to a lease, as
        ``event_stream`` is, a shortage through leader changes that came more often than
        ``event_stream_deadline_s`` was never reported overdue."""
        return self.root + "event-stream-shortage"

    @property
    def stream(self) -> str:
        """The event stream's name, one per job name: ``SAILOR_<JOB>_EVENTS`` (upper case)
        for a name without upper-case letters, as every release named it; a name with one
        keeps its case after ``SAILOR-`` (``x_y`` and ``X_Y`` would both be ``SAILOR_X_Y``).
        NATS stream names are case-sensitive."""
        if self.job == self.job.lower():
            return self.legacy_stream
        return f"SAILOR-{self.job}_EVENTS"

    @property
    def legacy_stream(self) -> str:
        """The name releases before the job-name check gave this job's stream (the
        upper-cased name); ``NatsEventBus.ensure_stream`` adopts a stream of that name that
        carries this job's subjects (a job with an upper-case letter, upgraded)."""
        return f"SAILOR_{safe_token(self.job).upper()}_EVENTS"

    @property
    def event_subjects(self) -> str:
        return f"sailor.{safe_token(self.job)}.events.>"

    def event_subject(self, kind: str, source: str = "_") -> str:
        """Subject of one event; ``source`` is the publishing node ("_": not a node)."""
        return f"sailor.{safe_token(self.job)}.events.{safe_token(source)}.{safe_token(kind)}"

    def event_source(self, subject: str) -> str | None:
        """The ``<source>`` token of one of this job's event subjects; None for another subject.

        The publisher's NATS permission covers only its own node's subjects, so this token is
        who sent the event; the controller requires it to be the node the event is about.
        """
        return event_subject_source(subject, self.job)

    def source_event_subjects(self, source: str) -> str:
        """Every event subject one node may publish on (a NATS permission)."""
        return f"sailor.{safe_token(self.job)}.events.{safe_token(source)}.>"

    @property
    def command_subjects(self) -> str:
        """Every node's command subject (the controller's publish permission)."""
        return f"sailor.{safe_token(self.job)}.cmd.*"

    def command_subject(self, node_id: str) -> str:
        return f"sailor.{safe_token(self.job)}.cmd.{safe_token(node_id)}"
