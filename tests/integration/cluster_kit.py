"""Controllers and agents of one job on the test's servers, started in the test's event loop.

:class:`Cluster` is what the runtime tests (test_runtime_*, the abort-ack, clear-bad and
node-check tests, the chaos fuzz) drive: real ``Controller`` and ``Agent`` daemons over the
secure servers of ``conftest``, workers the light ``toy_trainer`` (real subprocesses that
speak the worker protocol) unless a file sets its own. conftest's ``cluster`` fixture is
one with the defaults; a file that needs another sets what differs (``ctl_update``,
``worker``, ``in_place``, ...) in a ``cluster`` fixture of its own. :func:`until` polls a
condition with a deadline. :func:`event_stream` creates a job's event stream, for a test
whose agents run without a controller. Never starts servers: the fixtures do.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Self

import pytest

from sailor.agent.agent_config import AgentConfig, CheckSettings, WatcherConfig
from sailor.agent.daemon import Agent
from sailor.agent.worker_argv import TOY_TRAINER_ARGV
from sailor.controller.audit import check, read_records
from sailor.controller.config import ControllerConfig
from sailor.controller.daemon import Controller
from sailor.controller.phases import PhaseDeadlines
from sailor.coordination import Keys, NatsEventBus, close_nats, connect_nats
from sailor.localservers import LocalServers
from sailor.schemas.hardware import NodeSpec
from sailor.schemas.runtime import Phase

__all__ = ["WORKER", "Cluster", "event_stream", "until"]

WORKER = (*TOY_TRAINER_ARGV, "--step-s", "0.15")
"""The toy trainer at 0.15 s a step: a few steps a second, each scenario takes seconds."""


class Cluster:
    """Controllers and agents of one job on ``servers``, in this event loop; an async
    context manager that stops them all at its end (``close``).

    What a test file changes is set on the instance before the first start: ``worker`` (the
    argv), ``ctl_update`` (fields of every controller's config), ``in_place`` and
    ``warm_spares``, ``debounce_s``.
    """

    def __init__(self, tmp: Path, servers: LocalServers, job: str = "t") -> None:
        self.tmp = tmp
        self.servers = servers
        self.security = servers.security
        self.job = job
        self.nats_url = servers.nats_url
        self.etcd = servers.etcd_endpoint
        self.worker: tuple[str, ...] = WORKER
        self.debounce_s = 0.2
        self.in_place = False  # ControllerConfig.in_place
        self.warm_spares = 0  # AgentConfig.warm_spares
        self.ctl_update: dict[str, Any] = {}  # over ctl_config's fields, for every controller
        self.controllers: dict[str, tuple[Controller, asyncio.Task[None]]] = {}
        self.agents: dict[str, tuple[Agent, asyncio.Task[None]]] = {}

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def ctl_config(self, name: str) -> ControllerConfig:
        cfg = ControllerConfig(
            job=self.job,
            identity=name,
            nats_url=self.nats_url,
            etcd_endpoint=self.etcd,
            audit_log=self.tmp / f"audit-{name}.jsonl",
            checkpoint_dir=str(self.tmp / "ckpt"),
            # the product's default, as the agents': these controllers share the test's event
            # loop, and at 1 s a leader's lease expired under load mid-CHECKPOINT (a new term,
            # the save given up, a join resumed from the commit before it)
            lease_ttl_s=2,
            debounce_s=self.debounce_s,
            resync_s=0.5,
            stop_ahead_steps=3,
            notice_margin_s=1.0,
            deadlines=PhaseDeadlines(quiesce=15, checkpoint=15, launch=10, load=30, verify=30),
            global_batch_size=8,
            # toy trainers train no real model: the stand-in planner uses every node, which
            # the protocol assertions below rely on
            planner="data_parallel",
            security=self.security(name),
            in_place=self.in_place,
        )
        return cfg.model_copy(update=self.ctl_update) if self.ctl_update else cfg

    def start_controller(self, name: str) -> Controller:
        ctl = Controller(self.ctl_config(name))
        self.controllers[name] = (ctl, asyncio.create_task(ctl.run(), name=f"test-ctl-{name}"))
        return ctl

    def start_agent(self, node_id: str, gpu: str = "A100-40", watch_file: bool = False) -> Agent:
        watchers = (
            (WatcherConfig(kind="file", target=str(self.tmp / f"preempt-{node_id}")),)
            if watch_file
            else ()
        )
        cfg = AgentConfig(
            job=self.job,
            node=NodeSpec(node_id=node_id, gpu_type=gpu, gpus=1, zone="z-a-1", address="127.0.0.1"),
            nats_url=self.nats_url,
            etcd_endpoint=self.etcd,
            # the product's default: these agents share the test's event loop, and under a
            # loaded host (two pytest workers, load 8) a 1 s lease expired mid-test (a node
            # "lost without notice" and re-registered, an extra generation)
            lease_ttl_s=2,
            work_dir=self.tmp / "agents",
            worker_argv=self.worker,
            watchers=watchers,
            watch_poll_s=0.2,
            security=self.security(node_id),
            # toy trainers stand in for the GPUs on this CPU host: no GPU check (a GPU node
            # without a GPU would refuse to join)
            check=CheckSettings(mode="off"),
            warm_spares=self.warm_spares,
        )
        agent = Agent(cfg)
        self.agents[node_id] = (agent, asyncio.create_task(agent.run(), name=f"test-{node_id}"))
        return agent

    async def stop_agent(self, node_id: str, crash: bool = False) -> None:
        agent, task = self.agents.pop(node_id)
        if crash:
            await agent.crash()
        agent.stopping.set()
        await asyncio.wait_for(task, 15)

    async def stop_controller(self, name: str, crash: bool = False) -> None:
        ctl, task = self.controllers.pop(name)
        if crash:
            task.cancel()
            # bounded, with where it hangs: a controller that outlived its cancel held a CI
            # run until pytest-timeout's 600 s, and said nothing of where it was
            done, _ = await asyncio.wait({task}, timeout=30)
            if not done:
                where = io.StringIO()
                task.print_stack(file=where)
                raise AssertionError(
                    f"controller {name} still runs 30 s after its cancel:\n{where.getvalue()}"
                )
            with pytest.raises(asyncio.CancelledError):
                await task
            ctl.audit.close()
            return
        ctl.stopping.set()
        ctl.wake()
        await asyncio.wait_for(task, 15)

    async def close(self) -> None:
        for n in list(self.agents):
            await self.stop_agent(n)
        for c in list(self.controllers):
            await self.stop_controller(c)

    def leader(self) -> Controller:
        for ctl, _ in self.controllers.values():
            if ctl.leadership is not None:
                return ctl
        raise AssertionError("no leader")

    async def wait_phase(self, phase: Phase, timeout: float, after_gen: int = -1) -> Controller:
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while loop.time() < end:
            for ctl, _ in self.controllers.values():
                d = ctl.desired
                if ctl.leadership and d and d.phase is phase and d.generation > after_gen:
                    return ctl
            await asyncio.sleep(0.05)
        states = {
            n: (c.desired.phase, c.desired.cause)
            for n, (c, _) in self.controllers.items()
            if c.desired
        }
        raise AssertionError(f"phase {phase} not reached in {timeout}s: {states}")

    async def wait_step(
        self, ctl: Controller, node_ids: list[str], step: int, timeout: float
    ) -> None:
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while loop.time() < end:
            if all(self.agents[n][0].supervisor.step >= step for n in node_ids):
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"step {step} not reached")

    async def audit(self, settle_s: float = 3.0) -> None:
        """The audit of every controller's log holds. Records are buffered until the next
        group commit, and a phase record follows the etcd write the test may have seen
        first: the running controllers' logs are flushed and, while a check fails, read
        again for up to ``settle_s``."""
        end = time.monotonic() + settle_s
        while True:
            for ctl, _task in self.controllers.values():
                with contextlib.suppress(ValueError, OSError):  # a stopped one closed it
                    ctl.audit.sync()
            rep = check(read_records(sorted(self.tmp.glob("audit-*.jsonl"))))
            if rep.ok or time.monotonic() > end:
                break
            await asyncio.sleep(0.1)
        assert rep.ok, rep.violations


async def until(pred: Callable[[], object], timeout: float, what: str) -> None:
    """Wait until ``pred()`` is true, polling every 50 ms; fail naming ``what`` after
    ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not pred():
        assert loop.time() < end, f"{what} not within {timeout} s"
        await asyncio.sleep(0.05)


async def event_stream(servers: LocalServers, job: str, identity: str = "c1") -> None:
    """Create ``job``'s event stream as its controller does (with ``identity``'s login).

    For a test whose agents run without a controller: there an agent's join (and, at its
    stop, its leave) finds no stream, and each is retried 20 times 0.25 s apart (~5 s)
    before the agent goes on: time spent on nothing the test checks."""
    nc = await connect_nats(
        servers.nats_url, f"{identity}-stream", security=servers.security(identity)
    )
    try:
        await NatsEventBus(nc, Keys(job=job), durable="unused").ensure_stream()
    finally:
        await close_nats(nc)
