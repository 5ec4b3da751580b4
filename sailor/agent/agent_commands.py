"""How an agent applies the controller's commands (served on its own NATS subject by
:class:`sailor.agent.daemon.Agent`): a command addressed to another node, or of a lower epoch
than the highest seen, is refused; a higher epoch is persisted (the fence) before its command
is applied; each command id is applied at most once (a repeat gets the first ack back, marked
duplicate); a Launch of the launch its workers run already (``Supervisor.runs``: same
generation, plan, ranks, master, checkpoint; a leader that adopted a LAUNCH after a failover
sends it again under its own ids) is acknowledged, not applied again (that killed the ranks
just started or handed over); once a worker of that launch has exited or the node's failure
is set (``Supervisor.ended``), it is refused with that failure, which the status keeps
(applied again, it restarted the ranks into the dead world's generation and master and
erased the failure); one of an earlier generation than the node's last is refused while
the node's workers live (an idle node applies it: a controller restored from an etcd backup
counts from an older generation); a
Launch reads its plan and training config first (``plan_source``); a command that fails is
refused with its cause, and once the agent is shutting down every command is.
Every refusal is on record twice: its ack and a journal line. No command of a controller of
wire version 4 or later waits for a kill: an Abort is acked once its signals are sent (the
kill's end is in the status: ``killing``, then idle or the OutlivedKill failure), and a
Launch while a kill is under way is refused at once (docs/runtime.md#aborts-and-kills);
every command behind them waited up to the teardown bound before. An older controller's
(``schema_version`` < :data:`_KILLING_VERSION`) Abort and Launch wait for the kill as they
did: it does not read ``killing``, and would take a node whose workers are being killed
for one that is done.

``AgentCommands`` is a part of :class:`~sailor.agent.daemon.Agent` (a mixin over its node,
supervisor, fence, plan source and record of applied commands). Must never import the
controller.
"""

from __future__ import annotations

import asyncio
import collections

import structlog
from pydantic import ValidationError

from sailor.agent.fence import EpochFence
from sailor.agent.killed_groups import WorkerTeardownError
from sailor.agent.plan_source import PlanSource
from sailor.agent.supervisor import Supervisor, SupervisorClosedError
from sailor.coordination import CoordinationError, TemporaryError
from sailor.coordination.etcd_store import EtcdStore
from sailor.schemas.commands import Abort, Checkpoint, CommandAdapter, Launch, Stop
from sailor.schemas.hardware import NodeSpec
from sailor.schemas.runtime import CommandAck

__all__ = ["AgentCommands"]

_log = structlog.get_logger("sailor.agent")

_KILLING_VERSION = 4
"""The wire version from which a controller reads ``AgentStatus.killing``: its Aborts are
acked once their signals are sent and its Launches refused during a kill. One below drops
the field (``schemas._newer``) and, in an in-place TEARDOWN, takes a node reporting
``held`` (what it reports while its workers that did not hold are being killed) as done:
it would send an in-place Launch the agent refuses, and its LAUNCH deadline would charge
the node. So an older controller's Abort is acked once its kill is over, as before."""


class AgentCommands:
    """The command handling of :class:`~sailor.agent.daemon.Agent`."""

    node: NodeSpec
    supervisor: Supervisor
    max_epoch: int
    applied: collections.OrderedDict[str, CommandAck]
    _fence: EpochFence
    _store: EtcdStore | None
    _plans: PlanSource
    _lock: asyncio.Lock
    _closing: bool

    async def _on_command(self, data: bytes) -> bytes:
        async with self._lock:
            if self._closing:  # the workers are gone for good: start none now
                return (
                    self._refuse(_command_id(data), "agent shutting down")
                    .model_dump_json()
                    .encode()
                )
            try:
                ack = await self._apply(data)
            except Exception as exc:  # a command that fails is refused with its cause, on
                # record, not lost in the NATS client's callback (the controller re-sends it)
                _log.exception("command_failed", node=self.node.node_id)
                ack = self._refuse(_command_id(data), f"failed: {type(exc).__name__}: {exc}"[:1000])
            return ack.model_dump_json().encode()

    async def _close_supervisor(self) -> None:
        """Refuse every command from now on, let one being applied end (for at most the
        workers' kill grace: an Abort that holds waits that long), then kill the workers. A
        Launch still going on after that starts no more workers, and the supervisor kills
        those it started: none outlives the agent."""
        self._closing = True
        try:
            async with asyncio.timeout(2 * self.supervisor.kill_grace_s):
                async with self._lock:
                    pass
        except TimeoutError:
            _log.warning("shutdown_during_command", node=self.node.node_id)
        await self.supervisor.close()

    async def _apply(self, data: bytes) -> CommandAck:
        try:
            cmd = CommandAdapter.validate_json(data)
        except ValidationError as exc:
            return self._refuse("?", f"malformed: {str(exc).splitlines()[0][:200]}")
        if cmd.node_id != self.node.node_id:
            return self._refuse(cmd.command_id, f"addressed to {cmd.node_id}")
        if cmd.epoch < self.max_epoch:
            return self._refuse(cmd.command_id, f"stale epoch {cmd.epoch} < {self.max_epoch}")
        if cmd.command_id in self.applied:
            return self.applied[cmd.command_id].model_copy(update={"duplicate": True})
        if cmd.epoch > self.max_epoch:
            unissued = await self._unissued(cmd.epoch)
            if unissued:  # raised to it, the fence would refuse every real leader after
                return self._refuse(cmd.command_id, unissued)
            # durable before the command is applied: a restart must not forget it
            try:
                await asyncio.to_thread(self._fence.raise_to, cmd.epoch)
            except OSError as exc:  # not applied (refused, on record): the controller re-sends
                return self._refuse(cmd.command_id, f"epoch fence not persisted: {exc}"[:1000])
        self.max_epoch = cmd.epoch
        reason = ""
        if isinstance(cmd, Launch):
            running = self.supervisor.generation
            if cmd.generation < running and self.supervisor.live:
                # a controller that missed the later launch must not kill its live workers;
                # an idle node applies it (a controller whose etcd was restored from a
                # backup counts generations from an older number: refused, it could launch
                # nowhere until its count passed every node's). Stale leaders are fenced by
                # the epoch above
                return self._refuse(cmd.command_id, _older(cmd.generation, running))
            if self.supervisor.aborted(cmd):
                return self._refuse(cmd.command_id, _aborted(cmd.generation))
            ended = self.supervisor.ended(cmd)
            if ended:
                # the launch this node ran, whose worker died (or failed): the failure
                # stays this node's, in its status, for the controller to decide on
                return self._refuse(cmd.command_id, _ended(cmd.generation, ended))
            if self.supervisor.runs(cmd):
                # the launch its workers run, sent again under another id (a leader that
                # adopted the LAUNCH after a failover): acknowledged, not applied again
                reason = f"generation {cmd.generation} already running: not applied again"
            elif self.supervisor.kill_under_way and cmd.schema_version >= _KILLING_VERSION:
                # no rank starts on a GPU a killed worker's process may still hold, and the
                # launch does not wait for them here (that held every command to this node
                # up to the teardown bound): refused, not applied; the controller re-sends it.
                # An older controller's waits (Supervisor.launch: the gate), as it did.
                return self._refuse(cmd.command_id, _being_killed(self.supervisor.killing))
            else:
                refused = await self._launch(cmd)
                if refused is not None:
                    return refused
        elif isinstance(cmd, Stop):
            await self.supervisor.stop_at(cmd.at_step)
        elif isinstance(cmd, Checkpoint):
            await self.supervisor.save_at(
                cmd.step, cmd.directory, cmd.prune_below, cmd.periodic, cmd.drop_steps
            )
        if isinstance(cmd, Abort):
            # acked once the signals are sent (a hold: once the workers held or the grace
            # period passed): the kill's end is in the status (``killing``, then idle, or
            # the OutlivedKill failure past the teardown bound), not in this ack. An older
            # controller reads no ``killing``: acked once the kill is over, as before.
            wait = cmd.schema_version < _KILLING_VERSION
            await self.supervisor.abort(hold=cmd.hold, wait=wait)
            if self.supervisor.killing:
                reason = f"signals sent: {_being_killed(self.supervisor.killing)}"
        ack = CommandAck(
            command_id=cmd.command_id,
            node_id=self.node.node_id,
            accepted=True,
            reason=reason,
            epoch_seen=self.max_epoch,
        )
        self.applied[cmd.command_id] = ack
        while len(self.applied) > 10_000:
            self.applied.popitem(last=False)
        self.supervisor.changed.set()
        return ack

    async def _launch(self, cmd: Launch) -> CommandAck | None:
        """Apply ``cmd``: its plan and training config read, its workers started; the
        refusal if it was not applied."""
        try:  # a Launch names its plan; read it from etcd (cached by plan id)
            plan = await self._plans.resolve(cmd)
        except TemporaryError as exc:  # not applied: the controller re-sends it
            return self._refuse(cmd.command_id, f"plan {cmd.plan_id}: {exc}"[:1000])
        try:  # and its training config, by digest (none: the workers' defaults)
            training = await self._plans.training(cmd)
        except TemporaryError as exc:
            return self._refuse(cmd.command_id, f"training config: {exc}"[:1000])
        try:
            await self.supervisor.launch(cmd.model_copy(update={"plan": plan}), training)
        except SupervisorClosedError:  # the agent began shutting down meanwhile
            return self._refuse(cmd.command_id, "agent shutting down")
        except WorkerTeardownError as exc:  # also the status's failure (retry false)
            return self._refuse(cmd.command_id, f"a killed worker holds on: {exc}"[:1000])
        return None

    async def _unissued(self, epoch: int) -> str:
        """Why no leader can have been elected at ``epoch`` ('' when one can): an epoch is
        the leader key's create revision, so a real one is never beyond etcd's current
        revision. A command beyond it (a buggy or hostile message's ``2**62``) is refused
        before it raises the fence, which would otherwise refuse every real leader's
        command from then on. When etcd cannot be asked, the command is refused too (the
        controller sends it again). An agent not connected to etcd serves no commands; one
        driven without a store (``_store`` None: tests that call the handler) is not
        checked."""
        if self._store is None:
            return ""
        try:
            revision = await self._store.revision()
        except CoordinationError as exc:
            return f"epoch {epoch} not checked against etcd's revision ({exc}): not applied"
        if epoch > revision:
            return (
                f"epoch {epoch} is beyond etcd's revision {revision}: no leader was elected "
                f"at it (the fence stays at {self.max_epoch})"
            )
        return ""

    def _refuse(self, command_id: str, reason: str) -> CommandAck:
        """The refusal ack, and a journal line: every refused command is on record twice."""
        _log.warning(
            "command_refused",
            node=self.node.node_id,
            command_id=command_id[:128],
            reason=reason[:300],
            epoch_seen=self.max_epoch,
        )
        return CommandAck(
            command_id=command_id,
            node_id=self.node.node_id,
            accepted=False,
            reason=reason,
            epoch_seen=self.max_epoch,
        )


def _being_killed(groups: int) -> str:
    """Why a Launch waits: the killed workers' processes are not gone yet."""
    return (
        f"workers being killed: {groups} process group(s) not gone yet (the status reports "
        "killing until they are; no rank starts on their GPUs meanwhile)"
    )


def _older(generation: int, running: int) -> str:
    """Why a Launch of an earlier generation than the node's last is refused while its
    workers live."""
    return (
        f"generation {generation} is older than generation {running} launched here, whose "
        "workers live: generations only go up (a Launch from a controller that missed the "
        "later one)"
    )


def _aborted(generation: int) -> str:
    """Why a Launch of the launch whose workers this node aborted (or held) is refused."""
    return (
        f"generation {generation}'s workers were aborted here: their world is gone (a new "
        "world is a new generation; not applied again)"
    )


def _ended(generation: int, why: str) -> str:
    """Why a Launch of the launch this node ran, whose worker died or failed, is refused."""
    return (
        f"generation {generation} was launched here and ended: {why}"[:900]
        + " (not applied again: the failure stays this node's)"
    )


def _command_id(data: bytes) -> str:
    """The command id of a raw command, or "?" (for a refusal's ack)."""
    try:
        return str(CommandAdapter.validate_json(data).command_id)
    except ValidationError:
        return "?"
