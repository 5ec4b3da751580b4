"""Resolves what a ``Launch`` names by reference — its plan and its training config — from etcd.

The controller writes the plan it launches into the desired state (``DesiredState.plan``)
before it sends any Launch of that generation, and the Launch carries only ``plan_id`` and
``plan_sha256``. ``PlanSource.resolve`` returns the inline plan of an older controller's
Launch as is; otherwise it reads the desired state, takes ``plan`` (or ``next_plan``) whose id
matches, and checks the digest, so an agent never starts workers on a plan other than the one
the command named. Plans are cached by id (a few: a re-sent Launch, or another node's agent
in tests, does not read etcd again), and concurrent misses share one read.

The training config (``Launch.training_sha256``, '' for none) is resolved the same way:
``PlanSource.training`` takes ``DesiredState.training`` and checks its digest
(``training_digest``); a read for a plan also keeps the training config it finds, so a launch
reads the desired state once. Configs are cached by digest. Must never import the controller.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable

from pydantic import ValidationError

from sailor.coordination import KeyValue, TemporaryError
from sailor.schemas.commands import Launch, plan_digest, training_digest
from sailor.schemas.plan import Plan
from sailor.schemas.runtime import DesiredState
from sailor.schemas.training import TrainingConfig

__all__ = ["PlanSource", "PlanUnavailableError"]


class PlanUnavailableError(TemporaryError):
    """The named plan (or training config) is not (yet, or any more) in etcd, or its digest
    differs. Refuse the command unapplied: the controller re-sends it, or decides anew."""


class PlanSource:
    """Plans by id, read from the desired-state key and verified against the Launch."""

    def __init__(self, get: Callable[[], Awaitable[KeyValue | None]], keep: int = 4) -> None:
        self._get = get
        self._keep = keep
        self._cache: collections.OrderedDict[str, tuple[str, Plan]] = collections.OrderedDict()
        self._inflight: dict[tuple[str, str], asyncio.Future[Plan]] = {}
        self._trainings: collections.OrderedDict[str, TrainingConfig] = collections.OrderedDict()

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

    async def training(self, cmd: Launch) -> TrainingConfig | None:
        """The training config ``cmd`` names (None when it names none), digest checked."""
        want = cmd.training_sha256
        if not want:
            return None
        hit = self._trainings.get(want)
        if hit is not None:
            return hit
        desired = await self._desired(cmd)
        if desired.training is None:
            raise PlanUnavailableError("no training config in the desired state", want=want[:16])
        digest = self._keep_training(desired.training)
        if digest != want:
            raise PlanUnavailableError(
                "training config digest mismatch", want=want[:16], digest=digest[:16]
            )
        return desired.training

    def _keep_training(self, config: TrainingConfig) -> str:
        digest = training_digest(config)
        self._trainings[digest] = config
        self._trainings.move_to_end(digest)
        while len(self._trainings) > self._keep:
            self._trainings.popitem(last=False)
        return digest

    async def desired(self) -> DesiredState | None:
        """The controller's desired state as etcd holds it now (None: none written yet).
        Raises :class:`PlanUnavailableError` if it does not parse, ``TemporaryError`` if
        etcd cannot be read."""
        kv = await self._get()
        if kv is None:
            return None
        try:
            return DesiredState.model_validate_json(kv.value)
        except ValidationError as exc:
            raise PlanUnavailableError("desired state unreadable", error=str(exc)[:200]) from exc

    async def _desired(self, cmd: Launch) -> DesiredState:
        d = await self.desired()
        if d is None:
            raise PlanUnavailableError("no desired state in etcd", plan_id=cmd.plan_id)
        return d

    async def _fetch(self, cmd: Launch) -> Plan:
        desired = await self._desired(cmd)
        if desired.training is not None and cmd.training_sha256:
            self._keep_training(desired.training)  # the same read serves the launch's config
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
