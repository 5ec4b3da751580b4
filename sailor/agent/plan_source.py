"""Resolves the plan a ``Launch`` names by reference: read once from etcd, cached by plan id.

The controller writes the plan it launches into the desired state (``DesiredState.plan``)
before it sends any Launch of that generation, and the Launch carries only ``plan_id`` and
``plan_sha256``. ``PlanSource.resolve`` returns the inline plan of an older controller's
Launch as is; otherwise it reads the desired state, takes ``plan`` (or ``next_plan``) whose id
matches, and checks the digest, so an agent never starts workers on a plan other than the one
the command named. Plans are cached by id (a few: a re-sent Launch, or another node's agent
in tests, does not read etcd again), and concurrent misses share one read. Must never
import the controller.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable

from pydantic import ValidationError

from sailor.coordination import KeyValue, TemporaryError
from sailor.schemas.commands import Launch, plan_digest
from sailor.schemas.plan import Plan
from sailor.schemas.runtime import DesiredState

__all__ = ["PlanSource", "PlanUnavailableError"]


class PlanUnavailableError(TemporaryError):
    """The named plan is not (yet, or any more) in etcd, or its digest differs. Refuse the
    command unapplied: the controller re-sends it, or decides anew."""


class PlanSource:
    """Plans by id, read from the desired-state key and verified against the Launch."""

    def __init__(self, get: Callable[[], Awaitable[KeyValue | None]], keep: int = 4) -> None:
        self._get = get
        self._keep = keep
        self._cache: collections.OrderedDict[str, tuple[str, Plan]] = collections.OrderedDict()
        self._inflight: dict[tuple[str, str], asyncio.Future[Plan]] = {}

    async def resolve(self, cmd: Launch) -> Plan:
        if cmd.plan is not None:
            return cmd.plan
        hit = self._cache.get(cmd.plan_id)
        if hit is not None and hit[0] == cmd.plan_sha256:
            return hit[1]
        key = (cmd.plan_id, cmd.plan_sha256)
        shared = self._inflight.get(key)
        if shared is not None:  # one read and one parse for every Launch that misses at once
            return await asyncio.shield(shared)
        fut: asyncio.Future[Plan] = asyncio.get_running_loop().create_future()
        self._inflight[key] = fut
        try:
            fut.set_result(await self._fetch(cmd))
        except BaseException as exc:
            fut.set_exception(exc)
            fut.exception()  # marked retrieved: the callers sharing it re-raise it themselves
        finally:
            del self._inflight[key]
        return fut.result()

    async def _fetch(self, cmd: Launch) -> Plan:
        kv = await self._get()
        if kv is None:
            raise PlanUnavailableError("no desired state in etcd", plan_id=cmd.plan_id)
        try:
            desired = DesiredState.model_validate_json(kv.value)
        except ValidationError as exc:
            raise PlanUnavailableError("desired state unreadable", error=str(exc)[:200]) from exc
        for plan in (desired.plan, desired.next_plan):
            if plan is not None and plan.plan_id == cmd.plan_id:
                digest = plan_digest(plan)
                if digest != cmd.plan_sha256:
                    raise PlanUnavailableError(
                        "plan digest mismatch", plan_id=cmd.plan_id, digest=digest[:16]
                    )
                self._cache[cmd.plan_id] = (digest, plan)
                while len(self._cache) > self._keep:
                    self._cache.popitem(last=False)
                return plan
        raise PlanUnavailableError("plan not in the desired state", plan_id=cmd.plan_id)
