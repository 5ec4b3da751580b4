"""Planning in a warm worker process, so that a replan does not share the loop's GIL.

``ProcessPlanner`` keeps one spawned worker process that builds the controller's planner once
(from the controller config) and keeps it across calls, so the planner's warm state — the last
search's cost tables, templates and plan, which ``replan`` starts from — lives in the worker
and never crosses the pipe.

What crosses it is kept small, because at 512 nodes pickling the node specs, the previous plan
and the result cost as much as the replan itself (~10 ms each way per plan of 340 pipelines,
plus the garbage collections that unpickling thousands of objects sets off):

* the worker keeps the node specs of the last call and the plans it was last given or
  returned; a call sends the node ids, only the specs the worker does not hold (or that
  changed), and the previous plan by id when the worker holds it;
* the result comes back as the plan's JSON (pydantic writes it in ~2 ms; a pickle took
  ~9 ms) and is validated on this side.

The worker collects garbage between calls, never inside one: automatic collection is off in
the worker, and the parent queues a collection (:func:`_collect`) behind every call. At 512
nodes the planner's warm state is ~140,000 objects, so a full collection that the allocation
counters started inside a replan took 80-100 ms of a ~55 ms replan, every second call; and a
replan leaves no cyclic garbage (0 objects freed over 12 replans), so what survives a
collection is frozen (``gc.freeze``) and the next one scans only what was made since (5 ms).
Every ``_FULL_EVERY``-th collection unfreezes first, so a cycle that does appear is freed.

The parent mirrors what the worker holds; when the two disagree (a call cancelled or failed
half-way, a worker restarted) the worker refuses with :class:`StaleWorkerStateError` and the call
is sent again in full. A worker that dies is replaced on the next call (its warm state is
lost: the next plan is a full search). A call cancelled while the worker runs it (the
executor's replan timeout, or a newer replan replacing it) kills the worker (:meth:`kill`):
a search cannot be interrupted inside the worker, and left running it would hold the pool's
one worker while every later call queued behind it.

Online calibration's fitted calibration (``set_calibration``) goes with every call and is
applied by the worker when it differs from the one it holds (its next plan then searches
afresh).

Never used by tests that inject their own ``Planner``: only ``planner_process: true`` with a
config-built planner goes here.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import multiprocessing as mp
import os
import threading
import time
from concurrent.futures import BrokenExecutor, Future, ProcessPoolExecutor
from dataclasses import dataclass

from sailor.controller.config import ControllerConfig
from sailor.controller.planning.api import Planner, PlanResult
from sailor.controller.planning.in_process import planner_from_config, planner_reach_of
from sailor.planner.reach import PlannerReach
from sailor.schemas.calibration import Calibration
from sailor.schemas.hardware import NodeSpec
from sailor.schemas.plan import Plan
from sailor.schemas.precision import Precision

__all__ = ["ProcessPlanner", "StaleWorkerStateError"]


class StaleWorkerStateError(RuntimeError):
    """The call names a node or plan the worker does not hold: send it again in full."""


@dataclass(frozen=True)
class _Call:
    """One planning request as it crosses the pipe."""

    ids: tuple[str, ...]
    """Node ids, in the caller's order."""
    specs: tuple[NodeSpec, ...]
    """Specs of the nodes the worker does not hold yet (or holds in another version)."""
    previous_id: str | None
    """Plan id of the previous plan when the worker holds it (``previous`` is then None)."""
    previous: Plan | None
    reset: bool
    """Drop everything held before applying this call."""
    calibration: str | None = None
    """The calibration to plan with (JSON; online calibration), None: the config's. Sent with
    every call (a few kB): a restarted worker gets it too."""
    precision: Precision | None = None
    """The job's precision (``Planner.plan``), None: not fixed yet."""


# --- the worker process's side ---------------------------------------------------------------

_planner: Planner | None = None  # the worker process's planner (one per worker)
_calibration: str | None = None  # the calibration JSON the worker's planner plans with
_nodes: dict[str, NodeSpec] = {}  # node specs of the last call
_plans: dict[str, Plan] = {}  # the last call's previous plan and result, by plan id
_collections = 0  # collections run by _collect

_FULL_EVERY = 20
"""Every this many collections, the frozen objects are scanned too (a full collection, ~80 ms
at 512 nodes, between calls): bounds what a cycle among them could hold on to."""


def _init(config_json: str) -> None:
    global _planner
    _watch_parent(os.getppid())
    _planner = planner_from_config(ControllerConfig.model_validate_json(config_json))
    gc.disable()  # collections run between calls (_collect), not inside them


def _collect() -> int:
    """Collect garbage between calls, then freeze what survived; objects freed."""
    global _collections
    _collections += 1
    if _collections % _FULL_EVERY == 0:
        gc.unfreeze()
    freed = gc.collect()
    gc.freeze()
    return freed


def _watch_parent(parent: int, period_s: float = 1.0) -> None:
    """Exit when the controller is gone (SIGKILL): the pool's queue never tells a worker."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(period_s)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _ping() -> bool:
    return _planner is not None


def _plan(call: _Call) -> tuple[str, dict[str, tuple[int, ...]], str]:
    """Plan in the worker: (the plan's JSON, placement, reason)."""
    global _nodes, _plans, _calibration
    if _planner is None:  # the initializer failed; the pool reports that as a broken pool
        raise RuntimeError("planner worker not initialised")
    if call.calibration is not None and call.calibration != _calibration:
        setter = getattr(_planner, "set_calibration", None)
        if setter is not None:
            setter(Calibration.model_validate_json(call.calibration))
        _calibration = call.calibration
    if call.reset:
        _nodes, _plans = {}, {}
    known = _nodes
    known.update((n.node_id, n) for n in call.specs)
    try:
        nodes = tuple(known[i] for i in call.ids)
    except KeyError as exc:
        raise StaleWorkerStateError(
            f"node {exc.args[0]!r} not held by the planner worker"
        ) from None
    previous = call.previous
    if call.previous_id is not None:
        previous = _plans.get(call.previous_id)
        if previous is None:
            raise StaleWorkerStateError(f"plan {call.previous_id!r} not held by the planner worker")
    _nodes = {n.node_id: n for n in nodes}
    _plans = {previous.plan_id: previous} if previous is not None and previous.plan_id else {}
    res = _planner.plan(nodes, previous, call.precision)
    if res.plan.plan_id:
        _plans[res.plan.plan_id] = res.plan
    return res.plan.model_dump_json(), res.placement, res.reason


# --- the controller's side -------------------------------------------------------------------


class ProcessPlanner:
    """``aplan`` runs the config's planner in one warm worker process."""

    def __init__(self, config: ControllerConfig) -> None:
        self._config_json = config.model_dump_json()
        self._pool: ProcessPoolExecutor | None = None
        # what the worker holds after the calls sent so far (it runs them in order)
        self._nodes: dict[str, NodeSpec] = {}
        self._plans: set[str] = set()
        self._reset = True
        self._sent = 0  # calls submitted; a result updates the mirror only if it is the last
        self._calibration: str | None = None

    def reach(self) -> PlannerReach | None:
        """What the worker's planner can use (``SailorPlanner.reach``), read here from the
        same config: the worker builds its planner from it."""
        return planner_reach_of(ControllerConfig.model_validate_json(self._config_json))

    def set_calibration(self, calibration: Calibration) -> None:
        """Plan with ``calibration`` from the next call on (sent along with every call)."""
        self._calibration = calibration.model_dump_json()

    def _ensure(self) -> ProcessPoolExecutor:
        if self._pool is None:
            # spawn, not fork: the controller already runs grpc and asyncio threads
            self._pool = ProcessPoolExecutor(
                max_workers=1,
                mp_context=mp.get_context("spawn"),
                initializer=_init,
                initargs=(self._config_json,),
            )
            self._forget()
        return self._pool

    def _forget(self) -> None:
        self._nodes, self._plans, self._reset = {}, set(), True

    def _call(
        self,
        nodes: tuple[NodeSpec, ...],
        previous: Plan | None,
        full: bool,
        precision: Precision | None = None,
    ) -> _Call:
        """The request for ``nodes``, leaving out what the worker holds (all of it if ``full``)."""
        if full:
            self._forget()
        held = self._nodes
        specs = tuple(n for n in nodes if (h := held.get(n.node_id)) is not n and h != n)
        pid = previous.plan_id if previous is not None else ""
        by_id = bool(pid) and pid in self._plans
        call = _Call(
            ids=tuple(n.node_id for n in nodes),
            specs=specs,
            previous_id=pid if by_id else None,
            previous=None if by_id else previous,
            reset=self._reset,
            calibration=self._calibration,
            precision=precision,
        )
        self._nodes = {n.node_id: n for n in nodes}
        self._plans = {pid} if pid else set()
        self._reset = False
        self._sent += 1
        return call

    def _result(self, seq: int, out: tuple[str, dict[str, tuple[int, ...]], str]) -> PlanResult:
        plan_json, placement, reason = out
        plan = Plan.model_validate_json(plan_json)
        if seq == self._sent and plan.plan_id:
            self._plans.add(plan.plan_id)
        return PlanResult(plan, placement, reason)

    async def warm_up(self) -> None:
        """Start the worker and build its planner now, not on the first event."""
        pool = self._ensure()
        await asyncio.get_running_loop().run_in_executor(pool, _ping)
        self._collect_after(pool)  # the worker's imports and planner inputs, frozen

    async def aplan(
        self, nodes: tuple[NodeSpec, ...], previous: Plan | None, precision: Precision | None = None
    ) -> PlanResult:
        loop = asyncio.get_running_loop()
        for full in (False, True):
            pool = self._ensure()
            call = self._call(nodes, previous, full, precision)
            seq = self._sent
            try:
                out = await loop.run_in_executor(pool, _plan, call)
            except StaleWorkerStateError:
                continue  # the mirror was wrong: once more, in full
            except BrokenExecutor:
                self.close()  # the worker died; the next call starts a fresh one
                raise
            except asyncio.CancelledError:
                self.kill()  # the search would run on in the worker: stop it
                raise
            except BaseException:  # failed half-way: the next call goes in full
                self._forget()
                raise
            self._collect_after(pool)
            return await asyncio.to_thread(self._result, seq, out)
        raise StaleWorkerStateError("planner worker refused a full call")

    @staticmethod
    def _collect_after(pool: ProcessPoolExecutor) -> None:
        """Queue the worker's garbage collection behind the call that just returned."""
        with contextlib.suppress(BrokenExecutor, RuntimeError):  # a dead or closed pool
            pool.submit(_collect)

    def plan(
        self, nodes: tuple[NodeSpec, ...], previous: Plan | None, precision: Precision | None = None
    ) -> PlanResult:
        """Blocking form (the ``Planner`` protocol)."""
        for full in (False, True):
            pool = self._ensure()
            call = self._call(nodes, previous, full, precision)
            seq = self._sent
            fut: Future[tuple[str, dict[str, tuple[int, ...]], str]] = pool.submit(_plan, call)
            try:
                out = fut.result()
                self._collect_after(pool)
                return self._result(seq, out)
            except StaleWorkerStateError:
                continue
            except BaseException:
                self._forget()
                raise
        raise StaleWorkerStateError("planner worker refused a full call")

    def kill(self) -> None:
        """Terminate the worker now (a search under way included); the next call starts a
        fresh one. The search is pure computation: there is nothing to clean up."""
        pool, self._pool = self._pool, None
        self._forget()
        if pool is None:
            return
        for p in dict(getattr(pool, "_processes", None) or {}).values():
            with contextlib.suppress(Exception):
                p.terminate()
        pool.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        self._forget()
