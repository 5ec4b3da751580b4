"""The controller's commands to agents: sent in the background, acked, refused, bounded.

Commands are sent concurrently in background tasks, each waiting a bounded time for its ack;
the executor's ``apply`` does not wait for them, so a finished plan is adopted on the next
pass rather than after the slowest ack of a fan-out to every placed node. A command not acked
is simply decided again on a later pass (never two copies in flight; re-sent at most every
``resend_s``). The ``command`` records of a fan-out are made durable with one fsync before
the first request goes out, and an ack counts (``acked_view``) only once its record is
durable. An agent's refusal is kept too (``refused_view``: the command's last one, until an
ack accepts it), for ``decide``: a Launch refused while its node kills workers is sent again
slowly (``Send.resend_every``) until the kill is over, and the LAUNCH deadline's abort names
each refusal.

Memory is bounded by generations, not by the leadership term: the ids of acked and sent
commands are kept per generation (of the desired state when sent), and only the current and
the previous generation are kept (``KEEP_GENERATIONS``); a command of an older generation is
never decided again (benchmarks/runtime_soak.py: flat over 10,000 reconfigurations).
"""

from __future__ import annotations

from collections.abc import Callable

import structlog

from sailor.controller.audit import AuditLog
from sailor.controller.decision_types import Send
from sailor.coordination import Clock, NatsCommands, TaskSet, TemporaryError
from sailor.schemas.commands import CommandAdapter
from sailor.schemas.runtime import CommandAck

__all__ = ["KEEP_GENERATIONS", "CommandSends"]

_log = structlog.get_logger("sailor.controller")

KEEP_GENERATIONS = 2
"""Generations whose sent and acked command ids are kept: the current one, and the one before
(a Send decided in the pass that moved to a new generation is filed under the new one, so
this is a margin, not a need)."""


class CommandSends:
    """One leadership term's commands: in flight, sent when, acked, refused."""

    def __init__(
        self,
        commands: NatsCommands,
        audit: AuditLog,
        clock: Clock,
        tasks: TaskSet,
        wake: Callable[[bool], None],
        timeout_s: float = 1.0,
        resend_s: float = 0.5,
    ) -> None:
        self.commands = commands
        self.audit = audit
        self.clock = clock
        self.tasks = tasks
        self.wake = wake
        self.timeout_s = timeout_s
        self.resend_s = resend_s
        self._acked: set[str] = set()
        self._acked_view: frozenset[str] | None = None
        self._refused: dict[str, str] = {}  # command id -> its agent's last refusal
        self._refused_view: dict[str, str] | None = None
        self._sent_at: dict[str, float] = {}
        # generation (of the desired state when sent) -> the ids sent then: what to prune
        self._by_generation: dict[int, list[str]] = {}
        self._generation = 0
        self._inflight: set[str] = set()

    def prune(self, generation: int) -> None:
        """Forget the commands of generations older than ``KEEP_GENERATIONS`` back."""
        if generation <= self._generation:
            return
        self._generation = generation
        floor = generation - KEEP_GENERATIONS + 1
        for g in [g for g in self._by_generation if g < floor]:
            for cid in self._by_generation.pop(g):
                self._acked.discard(cid)
                self._sent_at.pop(cid, None)
                self._refused.pop(cid, None)
        self._acked_view = None
        self._refused_view = None

    @property
    def acked_view(self) -> frozenset[str]:
        """The kept generations' acked ids, frozen for ``Observed``: rebuilt at most once per
        pass after acks came in (not per ack), and only from the kept generations (a
        generation's commands: a few per node), never from every command of the term."""
        if self._acked_view is None:
            self._acked_view = frozenset(self._acked)
        return self._acked_view

    @property
    def refused_view(self) -> dict[str, str]:
        """The kept generations' commands whose agent refused them, with its last reason,
        until an ack accepts them (for ``Observed.refused``: a copy, rebuilt at most once
        per pass after a refusal or acceptance came in)."""
        if self._refused_view is None:
            self._refused_view = dict(self._refused)
        return self._refused_view

    @property
    def remembered(self) -> int:
        """Command ids held (acked, sent-at and refused entries): bounded by the kept
        generations."""
        return len(self._acked) + len(self._sent_at) + len(self._refused)

    @property
    def inflight(self) -> int:
        """Commands sent and not yet answered (or timed out)."""
        return len(self._inflight)

    def due(self, sends: list[Send]) -> list[Send]:
        """The sends to make now: not in flight, not acked, and not sent less than
        ``resend_every`` x ``resend_s`` ago (``Send.resend_every``)."""
        now = self.clock.now()

        def due(cid: str, every: int) -> bool:
            if cid in self._inflight or cid in self._acked:
                return False
            return now - self._sent_at.get(cid, -1e9) >= every * self.resend_s

        return [s for s in sends if due(s.command.command_id, s.resend_every)]

    async def send(self, due: list[Send]) -> None:
        """Record each of ``due`` (one fsync for the fan-out, before any request) and send
        them in the background."""
        now = self.clock.now()
        ids = self._by_generation.setdefault(self._generation, [])
        for s in due:
            cmd = s.command
            self._inflight.add(cmd.command_id)
            if cmd.command_id not in self._sent_at:
                ids.append(cmd.command_id)
            self._sent_at[cmd.command_id] = now
            self.audit.write(
                "command",
                now,
                epoch=cmd.epoch,
                command_id=cmd.command_id,
                command=cmd.kind,
                node_id=cmd.node_id,
                plan_id=cmd.plan_id,
            )
        await self.audit.durable()  # one fsync for the fan-out, before any request
        for s in due:
            self._spawn(s)

    def _spawn(self, action: Send) -> None:
        cid = action.command.command_id

        async def run() -> None:
            try:
                await self._send(action)
            finally:
                self._inflight.discard(cid)
                # one pass when a fan-out is fully answered, not one per ack
                if not self._inflight:
                    self.wake(True)

        self.tasks.spawn(f"cmd-{cid}", run())

    async def _send(self, action: Send) -> None:
        """Request (its ``command`` record is already durable) and record the ack."""
        cmd = action.command
        try:
            raw = await self.commands.request(
                cmd.node_id, CommandAdapter.dump_json(cmd), self.timeout_s
            )
            ack = CommandAck.model_validate_json(raw)
        except TemporaryError as exc:
            _log.info("command_unacked", command_id=cmd.command_id, error=str(exc))
            return
        except ValueError as exc:
            self.audit.write(
                "ack_rejected", self.clock.now(), command_id=cmd.command_id, error=str(exc)[:300]
            )
            return
        # The one reply that names no command: the addressed node's refusal of a command it
        # could not parse (``"?"``, ``agent_commands._apply``). A reply is to this request
        # alone (its own inbox) and names this node: this node refused this command, and
        # its reason ("malformed: ...") is what decide and an abort's cause must see.
        unparsed = ack.command_id == "?" and not ack.accepted and ack.node_id == cmd.node_id
        if (ack.command_id != cmd.command_id and not unparsed) or ack.node_id != cmd.node_id:
            # an ack of another command, or from another node (one that shares this node's
            # command subject): never counted; every release's agent sends both as asked
            self.audit.write(
                "ack_rejected",
                self.clock.now(),
                command_id=cmd.command_id,
                node_id=cmd.node_id,
                ack_command_id=ack.command_id[:128],
                ack_node_id=ack.node_id[:128],
                accepted=ack.accepted,
                reason=ack.reason[:300],
                error="the ack names another command or node",
            )
            return
        self.audit.write(
            "ack",
            self.clock.now(),
            epoch=cmd.epoch,
            command_id=cmd.command_id,
            node_id=cmd.node_id,
            accepted=ack.accepted,
            duplicate=ack.duplicate,
            reason=ack.reason,
        )
        if not ack.accepted:  # decide reads why (a kill under way: not re-sent until over)
            kept = cmd.command_id in self._sent_at  # else its generation was pruned meanwhile
            if kept and self._refused.get(cmd.command_id) != ack.reason:
                self._refused[cmd.command_id] = ack.reason
                self._refused_view = None
            return
        await self.audit.durable()  # group commit with the other acks of the fan-out
        if cmd.command_id in self._sent_at:  # else its generation was pruned meanwhile
            self._acked.add(cmd.command_id)
            self._acked_view = None
            if self._refused.pop(cmd.command_id, None) is not None:
                self._refused_view = None
