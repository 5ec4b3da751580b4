"""Planning in a warm worker process, so that a replan does not share the loop's GIL.

``ProcessPlanner`` keeps one spawned worker process that builds the controller's planner once
(from the controller config) and keeps it across calls, so the planner's warm state — the last
search's cost tables, templates and plan, which ``replan`` starts from — lives in the worker.
Each call ships the usable nodes and the previous plan (a few hundred kB at 2,048 nodes) and
gets a ``PlanResult`` back.

Why a process: in a thread the search (pure Python) holds the GIL against the controller's
event loop; at 512 nodes a 0.12–0.2 s replan took 0.26–0.75 s in the thread, and the loop's
etcd and NATS work stalled meanwhile (docs/runtime.md, figures). A worker that dies is
replaced on the next call (its warm state is lost: the next plan is a full search).

Never used by tests that inject their own ``Planner``: only ``planner_process: true`` with a
config-built planner goes here.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
from concurrent.futures import BrokenExecutor, ProcessPoolExecutor

from sailor.controller.config import ControllerConfig
from sailor.controller.planning import Planner, PlanResult
from sailor.schemas.hardware import NodeSpec
from sailor.schemas.plan import Plan

__all__ = ["ProcessPlanner"]

_planner: Planner | None = None  # the worker process's planner (one per worker)


def _init(config_json: str) -> None:
    global _planner
    from sailor.controller.sailor_planner import planner_from_config

    _planner = planner_from_config(ControllerConfig.model_validate_json(config_json))


def _ping() -> bool:
    return _planner is not None


def _plan(nodes: tuple[NodeSpec, ...], previous: Plan | None) -> PlanResult:
    if _planner is None:  # the initializer failed; the pool reports that as a broken pool
        raise RuntimeError("planner worker not initialised")
    return _planner.plan(nodes, previous)


class ProcessPlanner:
    """``aplan`` runs the config's planner in one warm worker process."""

    def __init__(self, config: ControllerConfig) -> None:
        self._config_json = config.model_dump_json()
        self._pool: ProcessPoolExecutor | None = None

    def _ensure(self) -> ProcessPoolExecutor:
        if self._pool is None:
            # spawn, not fork: the controller already runs grpc and asyncio threads
            self._pool = ProcessPoolExecutor(
                max_workers=1,
                mp_context=mp.get_context("spawn"),
                initializer=_init,
                initargs=(self._config_json,),
            )
        return self._pool

    async def warm_up(self) -> None:
        """Start the worker and build its planner now, not on the first event."""
        await asyncio.get_running_loop().run_in_executor(self._ensure(), _ping)

    async def aplan(self, nodes: tuple[NodeSpec, ...], previous: Plan | None) -> PlanResult:
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._ensure(), _plan, nodes, previous)
        except BrokenExecutor:
            self.close()  # the worker died; the next call starts a fresh one
            raise

    def plan(self, nodes: tuple[NodeSpec, ...], previous: Plan | None) -> PlanResult:
        """Blocking form (the ``Planner`` protocol)."""
        return self._ensure().submit(_plan, nodes, previous).result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
