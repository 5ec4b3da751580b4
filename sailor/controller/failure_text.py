"""Reading a failure text: what ``AgentStatus.failure`` says about where a failure began.

The failing-node policy (``controller/node_health.py``) counts a failure against the node
it began on, the job, or nobody; what it goes by is read here: the origin (``local``,
``config``, ``peer``, ``rendezvous``: rank 0's rendezvous port taken by another process, or
``unknown`` for a text that is no record) and retry policy of a
worker's error record (``sailor.megatron_patch.errors.failure_record``, the first 2000
characters of its JSON), the guilty rank a peer's record names (``culprit``), its
``error_type: message`` summary, and its signature (the summary
with its numbers left out, so the same error on every rank reads alike). Also which texts
are the checkpoint reader's errors and which a parent-written SIGABRT record (NCCL's
watchdog giving up on a collective).

Pure: functions of the text alone. Must never import the agent, torch or
``megatron_patch`` (the record's keys are read by name).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cached_property
from typing import Literal

__all__ = [
    "AGREED_ERRORS",
    "CAUSE_CHARS",
    "UNREADABLE_CHECKPOINT",
    "FailureCause",
    "Origin",
    "abort_signal",
    "error_type",
    "parse_failure",
    "signature_of",
]

Origin = Literal["local", "peer", "config", "rendezvous", "unknown"]

CAUSE_CHARS = 200
"""Characters of a failure kept in a node's record and quoted in a reason."""

AGREED_ERRORS = ("NonFiniteGradientsError", "LabelOutOfRangeError", "NonFiniteCheckpointError")
"""Error types every rank raises alike by construction, after a collective that agreed on
them: gradients non-finite too many steps in a row (``megatron_patch.nonfinite``), a label
outside the vocabulary in a global batch (``megatron_patch.bad_labels``), a checkpoint step
refused for an inf or NaN weight (``megatron_patch.save_failure``). Deterministic in the
data or the weights, so the job's, however many nodes reported one (a one-node job's too: a
spare meets the same data and gradients)."""

UNREADABLE_CHECKPOINT = ("CorruptCheckpointError", "NoCheckpointError")
"""The checkpoint reader's errors for a step that cannot be loaded (``sailor.checkpoint``):
the abort falls back to another checkpoint; no node and not the job is at fault."""


@dataclass(frozen=True)
class FailureCause:
    """What a failure text says about where the failure began and whether to retry."""

    origin: Origin
    retry: bool
    text: str

    @property
    def own(self) -> bool:
        """The failure began on the node that reported it (anything but a peer's)."""
        return self.origin != "peer"

    @cached_property
    def summary(self) -> str:
        """``error_type: message`` of a record, else the text itself; at most
        ``CAUSE_CHARS`` (worked out only when asked: a peer's is never quoted)."""
        return self._whole[:CAUSE_CHARS]

    @cached_property
    def signature(self) -> str:
        """The whole ``error_type: message`` with its numbers and hex addresses left out,
        then shortened: the same error on every rank has one signature, however wide the
        numbers each names (``Tried to allocate 2.00 GiB`` and ``112.00 GiB``; shortening
        first cut the two at different places)."""
        return signature_of(self._whole)

    @cached_property
    def _whole(self) -> str:
        try:
            data = json.loads(self.text)
        except (ValueError, RecursionError):  # "[[[...": a failure text nested past json's
            data = None  # recursion limit crashed the leader's pass
        if isinstance(data, dict):
            kind = str(data.get("error_type") or data.get("error") or "")
            message = str(data.get("message", ""))
        else:  # cut off, or no record at all
            kind_m, message_m = _ERROR_TYPE.search(self.text), _MESSAGE.search(self.text)
            kind = kind_m.group(1) if kind_m else ""
            message = message_m.group(1) if message_m else ""
        if kind or message:
            return f"{kind}: {message}" if kind else message
        return self.text

    @cached_property
    def culprit(self) -> str:
        """The record's ``culprit`` as written (at most 40 characters; '' when the record
        names none): the global rank a peer's failure says is guilty
        (``megatron_patch.errors.failure_record``). A text, not a rank: the record is what a
        worker wrote, and ``controller/culprits.py`` says what it makes of a value that is no
        rank of the layout."""
        m = _CULPRIT.search(self.text) if self.text.startswith("{") else None
        return m.group(1)[:40] if m else ""

    @property
    def port_taken(self) -> bool:
        """A rank's rendezvous store could not bind its port (another process holds it on
        the node): nobody's fault, a launch on another port succeeds
        (``controller/rendezvous_ports.py``)."""
        return self.origin == "rendezvous"

    @property
    def outlived_kill(self) -> bool:
        """The agent's own report of a killed worker that outlived SIGKILL: it withdraws it
        once the process is gone."""
        return '"OutlivedKill"' in self.text or self.text.startswith("OutlivedKill")

    @property
    def unreadable_checkpoint(self) -> bool:
        """The checkpoint reader's error: handled by falling back, counted against none."""
        return any(e in self.text for e in UNREADABLE_CHECKPOINT)


# Keys of a record as JSON writes them: a quote inside a string value is escaped (\"), so
# these match the record's own keys only, in a whole record and in one cut off alike.
_ORIGIN = re.compile(r'"origin"\s*:\s*"(local|peer|config|rendezvous)"')
_RETRY = re.compile(r'"retry"\s*:\s*(true|false)')
_CULPRIT = re.compile(r'"culprit"\s*:\s*([^,}\s]+)')
_ERROR_TYPE = re.compile(r'"(?:error_type|error)"\s*:\s*"((?:[^"\\]|\\.)*)')
_MESSAGE = re.compile(r'"message"\s*:\s*"((?:[^"\\]|\\.)*)')
_NUMBER = re.compile(r"0[xX][0-9a-fA-F]+|\d+")


def parse_failure(text: str) -> FailureCause:
    """The origin and retry policy of ``AgentStatus.failure``.

    A worker's record is JSON, but the agent keeps only its first 2000 characters, so a long
    traceback cuts it off: the keys are read from the text, whole or not (``failure_record``
    writes ``origin`` and ``retry`` right after ``rank`` and ``step``), without parsing it
    (at an abort of 512 nodes most report a peer's failure, every teardown pass). No record,
    or one without an origin: ``unknown``, retry unless it says ``false``.
    """
    text = text.strip()
    if not text.startswith("{"):
        return FailureCause("unknown", True, text)
    o, r = _ORIGIN.search(text), _RETRY.search(text)
    origin: Origin = o.group(1) if o else "unknown"  # type: ignore[assignment]
    return FailureCause(origin, not (r and r.group(1) == "false"), text)


def signature_of(summary: str) -> str:
    """A cause with its numbers and hex addresses left out, at most ``CAUSE_CHARS``: the
    same error on every rank (each names its own rank, pid, step, size or address) has one
    signature."""
    return _NUMBER.sub("#", summary)[:CAUSE_CHARS]


def error_type(summary: str) -> str:
    """The error type a summary (``error_type: message``) begins with ('' if none)."""
    return summary.split(":", 1)[0] if ":" in summary else ""


def abort_signal(summary: str) -> bool:
    """A parent-written record of a rank killed by SIGABRT (``signal_failure_record``)."""
    return error_type(summary) == "Signal" and "SIGABRT" in summary
