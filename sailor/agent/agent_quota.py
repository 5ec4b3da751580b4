"""The agent's side of its workers' CPU quota (``AgentConfig.cpu_quota``; the cgroup itself
is ``cpu_quota.CpuQuota``): how the workers come under it (at exec through the shell prefix,
or once each reports ready, the quota lifted during an in-place handover), the quota as the
kernel holds it (for the status record), a change at run time (``set_cpu_quota``), and the
step timings dropped when it changes (they measured another speed).

``AgentCpuQuota`` is a part of :class:`sailor.agent.daemon.Agent` (a mixin over the agent's
config, node, supervisor and ``quota``). Must never import the controller.
"""

from __future__ import annotations

import asyncio

import structlog

from sailor.agent.agent_config import AgentConfig
from sailor.agent.cpu_quota import CpuQuota, QuotaState
from sailor.agent.supervisor import Supervisor
from sailor.schemas.hardware import NodeSpec

__all__ = [
    "UNSEEN",
    "AgentCpuQuota",
]

_log = structlog.get_logger("sailor.agent")


UNSEEN = object()
"""No quota read yet (the first reading is no change)."""


class AgentCpuQuota:
    """The CPU quota of :class:`~sailor.agent.daemon.Agent`'s workers."""

    cfg: AgentConfig
    node: NodeSpec
    supervisor: Supervisor
    quota: CpuQuota | None
    _quota_seen: QuotaState | object

    def _attach_workers(self) -> None:
        """Workers join the quota's cgroup at exec (the shell prefix) or once ready (the
        supervisor's ``on_ready`` moves the pid in: all its threads, the gloo ones too; an
        in-place relayout lifts the quota until its workers are ready again)."""
        if self.quota is None:
            return
        if self.cfg.cpu_quota_from == "exec":
            self.supervisor.exec_prefix = self.quota.exec_prefix
            return
        quota = self.quota

        sup = self.supervisor

        async def join(pid: int) -> None:
            try:
                await asyncio.to_thread(quota.adopt, (pid,))
                if all(w.started for w in sup.workers):  # a relayout's lift ends
                    await asyncio.to_thread(quota.resume)
            except OSError as exc:  # the worker trains on, unthrottled: say so
                _log.warning("cpu_quota_join_failed", pid=pid, error=str(exc))

        async def lift() -> None:
            try:
                await asyncio.to_thread(quota.suspend)
            except OSError as exc:
                _log.warning("cpu_quota_lift_failed", error=str(exc))

        sup.on_ready = join
        sup.on_handover = lift

    def cpu_quota(self) -> QuotaState:
        """The workers' CPU quota as the kernel holds it: cores, 'unavailable' or None."""
        return None if self.quota is None else self.quota.state()

    async def set_cpu_quota(self, cores: float | None) -> QuotaState:
        """Change the CPU quota of this node's workers now (None: lift it); returns the new
        state. A node started without a quota gets its cgroup now, and its running workers
        are moved into it (processes they started themselves are not). Where no writable
        cpu controller exists this warns and changes nothing (``'unavailable'``)."""
        if self.quota is None:
            self.quota = await asyncio.to_thread(
                CpuQuota.start,
                self.cfg.job,
                self.node.node_id,
                cores,
                period_us=self.cfg.cpu_quota_period_us,
            )
            self._attach_workers()
            await asyncio.to_thread(self.quota.adopt, self.supervisor.pids())
        else:
            await asyncio.to_thread(self.quota.set, cores)
        self.supervisor.changed.set()
        return self.quota.state()

    def _follow_quota(self) -> None:
        """A quota changed (here or from outside: the kernel's value is read) changes the
        workers' speed: the step timings measured before it are dropped."""
        now = self.cpu_quota()
        if now != self._quota_seen:
            if self._quota_seen is not UNSEEN:
                _log.info("cpu_quota_changed", node=self.node.node_id, cores=now)
                self.supervisor.restart_timings()
            self._quota_seen = now
