"""The executor's replans (timeout, replacement), its memory (bounded by generations), and
what it writes to etcd and sends to the agents.

Over a real etcd and NATS, one pair shared by the module (``module_plain_servers``), each
test under a job of its own: the controller's ``EtcdStore`` with a leadership won by
``campaign`` (its lease kept alive by etcd), the real ``NatsCommands``, and :class:`Agents`,
a NATS responder that plays the agents (it acks each command, refuses it, or stays silent).
The planner is the one stand-in: a search the test holds or lets go, since what is tested is
how the executor handles a search's timing, which a real search cannot be made to keep.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from sailor.controller.audit import AuditLog
from sailor.controller.command_sends import KEEP_GENERATIONS
from sailor.controller.decision_types import DecideConfig, Replan, Send
from sailor.controller.executor import Executor
from sailor.controller.planning import DataParallelPlanner, PlanResult
from sailor.controller.replans import REPLAN_RETRY_S
from sailor.coordination import (
    EtcdStore,
    Keys,
    Leadership,
    NatsCommands,
    SystemClock,
    TaskSet,
    campaign,
    close_nats,
    connect_etcd,
    connect_nats,
)
from sailor.localservers import LocalServers
from sailor.schemas.commands import CommandAdapter, Stop
from sailor.schemas.hardware import NodeSpec
from sailor.schemas.plan import Plan
from sailor.schemas.runtime import (
    Accusations,
    CommandAck,
    DesiredState,
    NodeHealth,
    Phase,
    SuspectCheckpoint,
)
from tests.unit.test_controller_plan_deadlines import LLAMA_7B, NOW, even_plan, large_cfg

LEASE_TTL = 3
"""The leader's lease, in seconds: refreshed every second, so a test that waits for a refresh
waits at most that long, and a loaded machine does not let it expire between refreshes."""

_jobs = itertools.count()


class Agents:
    """Plays every agent of a job over NATS: subscribed to the job's command subjects, it
    answers each command with an accepted ack, a refusal (nodes in ``refuse``), or nothing
    (nodes in ``silent``: the request times out), and records the ids it received in order."""

    def __init__(self, servers: LocalServers, keys: Keys) -> None:
        self.servers = servers
        self.keys = keys
        self.refuse: set[str] = set()
        self.silent: set[str] = set()
        self.forged: dict[str, dict[str, str | bool]] = {}  # node -> the ack fields it gets wrong
        self.received: list[str] = []

    async def __aenter__(self) -> Agents:
        self._nc = await connect_nats(self.servers.nats_url, "test-agents")
        self._sub = await self._nc.subscribe(self.keys.command_subjects, cb=self._answer)
        await self._nc.flush()  # subscribed before the first command goes out
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._sub.unsubscribe()
        await close_nats(self._nc)

    async def _answer(self, msg: Any) -> None:
        cmd = CommandAdapter.validate_json(msg.data)
        self.received.append(cmd.command_id)
        if cmd.node_id in self.silent:
            return
        refused = cmd.node_id in self.refuse
        ack = CommandAck(
            command_id=cmd.command_id,
            node_id=cmd.node_id,
            accepted=not refused,
            reason="refused by the test" if refused else "",
        ).model_copy(update=self.forged.get(cmd.node_id, {}))
        await msg.respond(ack.model_dump_json().encode())


class _LeaseClock(SystemClock):
    """The real clock moved on by ``skip`` seconds, for the leader's store and lease: skipped
    past the TTL, the lease's last refresh is too old to be sure of (a leader cut off from
    etcd) until its next refresh, sent and answered by etcd, counts from the moved time."""

    def __init__(self) -> None:
        self.skip = 0.0

    def now(self) -> float:
        return time.time() + self.skip


@dataclass
class Rig:
    """An executor of a leader of its own job, and what it works with."""

    ex: Executor
    audit: AuditLog
    store: EtcdStore
    agents: Agents
    lead: Leadership
    lease_clock: _LeaseClock

    async def desired(self) -> bytes:
        """The desired state as etcd holds it."""
        kv = await self.store.get(self.ex.keys.desired)
        assert kv is not None, "no desired state in etcd"
        return kv.value


@asynccontextmanager
async def executor_on(
    servers: LocalServers, tmp_path: Path, planner: Any, clock: Any = None, **kw: Any
) -> AsyncIterator[Rig]:
    """An executor leading a job of its own on ``servers``: elected, agents answering."""
    keys = Keys(job=f"ex{next(_jobs)}")
    lease_clock = _LeaseClock()
    store = await connect_etcd(servers.etcd_endpoint, clock=lease_clock)
    nc = await connect_nats(servers.nats_url, "test-controller")
    tasks = TaskSet("test-executor")
    audit = AuditLog(tmp_path / "audit.jsonl")
    try:
        lead = await campaign(store, keys.leader, "c1", LEASE_TTL, timeout=10)
        async with Agents(servers, keys) as agents:
            ex = Executor(
                store,
                NatsCommands(nc, keys),
                keys,
                audit,
                lead,
                planner,
                clock or SystemClock(),
                tasks,
                lambda urgent: None,
                **kw,
            )
            try:
                yield Rig(ex, audit, store, agents, lead, lease_clock)
            finally:
                await tasks.close()
                await lead.resign()
    finally:
        audit.close()
        await close_nats(nc)
        await store.close()


class _HeldPlanner:
    """``aplan`` runs until released (or cancelled); records what happened to each call."""

    def __init__(self) -> None:
        self.started: list[tuple[str, ...]] = []
        self.precisions: list[object] = []
        self.cancelled: list[tuple[str, ...]] = []
        self.release: dict[tuple[str, ...], asyncio.Future[PlanResult | Exception]] = {}

    def plan(
        self, nodes: tuple[NodeSpec, ...], previous: Plan | None, precision: object = None
    ) -> PlanResult:
        return DataParallelPlanner("tiny-gpt", 4, global_batch_size=8).plan(nodes, previous)

    async def aplan(
        self, nodes: tuple[NodeSpec, ...], previous: Plan | None, precision: object = None
    ) -> PlanResult:
        ids = tuple(n.node_id for n in nodes)
        self.started.append(ids)
        self.precisions.append(precision)
        fut = self.release[ids] = asyncio.get_running_loop().create_future()
        try:
            out = await fut
        except asyncio.CancelledError:
            self.cancelled.append(ids)
            raise
        if isinstance(out, Exception):
            raise out
        return out


def _node(i: int) -> NodeSpec:
    return NodeSpec(node_id=f"n{i}", gpu_type="A100-40", gpus=1, zone="z-a-1")


def _records(audit: AuditLog, kind: str) -> list[dict[str, Any]]:
    audit.sync()
    lines = audit.path.read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


async def _until(pred: Any, timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not pred():
        assert loop.time() < end, "condition not reached"
        await asyncio.sleep(0.01)


class _Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def now(self) -> float:
        return self.t


async def test_a_timed_out_replan_is_cancelled_and_asked_again(
    module_plain_servers: LocalServers, tmp_path: Path
) -> None:
    planner = _HeldPlanner()
    clock = _Clock()
    async with executor_on(
        module_plain_servers, tmp_path, planner, clock=clock, replan_timeout_s=0.2
    ) as rig:
        ex, audit = rig.ex, rig.audit
        nodes = (_node(1), _node(2))
        assert ex.replans.start(Replan(nodes, None, "join"))
        await _until(lambda: planner.cancelled == [("n1", "n2")])  # the search was stopped
        await _until(lambda: bool(_records(audit, "plan_failed")))
        assert ex.replans.running is None  # so a later pass starts it again
        assert not ex.replans.start(Replan(nodes, None, "join"))  # after its backoff
        clock.t += REPLAN_RETRY_S
        assert ex.replans.start(Replan(nodes, None, "join"))
        await _until(lambda: len(planner.started) == 2)
        planner.release[("n1", "n2")].set_result(planner.plan(nodes, None))
        await _until(lambda: ex.replans.ready is not None)


async def test_a_replaced_replan_is_cancelled_and_cannot_clear_the_newer_one(
    module_plain_servers: LocalServers, tmp_path: Path
) -> None:
    planner = _HeldPlanner()
    async with executor_on(module_plain_servers, tmp_path, planner) as rig:
        ex = rig.ex
        a, b = (_node(1), _node(2)), (_node(1), _node(2), _node(3))
        assert ex.replans.start(Replan(a, None, "join"))
        await _until(lambda: len(planner.started) == 1)
        assert ex.replans.start(Replan(b, None, "join"))
        # the older search is stopped, not left running for the newer one to queue behind
        await _until(lambda: planner.cancelled == [("n1", "n2")])
        assert ex.replans.running == (("n1", "n2", "n3"), None)
        assert not ex.replans.start(Replan(b, None, "join"))  # under way: not started twice
        # the newer one fails: that clears it (and only it)
        await _until(lambda: len(planner.started) == 2)
        planner.release[("n1", "n2", "n3")].set_result(RuntimeError("no plan"))
        await _until(lambda: ex.replans.running is None)


async def test_a_failing_older_replan_leaves_the_newer_one_running(
    module_plain_servers: LocalServers, tmp_path: Path
) -> None:
    """The replaced replan ends in an error (a client may turn a cancel into its own error):
    the newer membership's replan must still count as under way, else it is started twice."""
    gate: dict[int, asyncio.Future[None]] = {}

    class _Planner:
        async def aplan(
            self, nodes: tuple[NodeSpec, ...], previous: Plan | None, precision: object = None
        ) -> PlanResult:
            fut = gate[len(nodes)] = asyncio.get_running_loop().create_future()
            try:
                await fut
            except asyncio.CancelledError:
                raise RuntimeError("search interrupted") from None
            raise RuntimeError("search failed")

        def plan(
            self, nodes: tuple[NodeSpec, ...], previous: Plan | None, precision: object = None
        ) -> PlanResult:
            raise NotImplementedError

    async with executor_on(module_plain_servers, tmp_path, _Planner()) as rig:
        ex = rig.ex
        try:
            assert ex.replans.start(Replan((_node(1),), None, "join"))
            await _until(lambda: 1 in gate)
            assert ex.replans.start(Replan((_node(1), _node(2)), None, "join"))
            await _until(lambda: 2 in gate)
            if not gate[1].done():
                gate[1].set_result(None)  # the replaced search ends, and fails, after all
            await asyncio.sleep(0.1)
            assert ex.replans.running == (("n1", "n2"), None)
        finally:
            for f in gate.values():
                if not f.done():
                    f.set_result(None)


async def test_a_replan_in_another_precision_is_not_swallowed_by_one_under_way(
    module_plain_servers: LocalServers, tmp_path: Path
) -> None:
    """A replan started before the job's precision was fixed (None) for membership M, then
    ``Replan(M, bf16)``: before, the second was taken for the first (keyed by membership
    alone), its precision-free result adopted, dropped by ``launch_next`` and planned
    again. Now the second is a replan of its own and the first is stopped."""
    planner = _HeldPlanner()
    async with executor_on(module_plain_servers, tmp_path, planner) as rig:
        ex = rig.ex
        nodes = (_node(1), _node(2))
        assert ex.replans.start(Replan(nodes, None, "join"))
        await _until(lambda: len(planner.started) == 1)
        assert ex.replans.start(Replan(nodes, None, "join", "bf16"))
        await _until(lambda: planner.cancelled == [("n1", "n2")])
        await _until(lambda: len(planner.started) == 2)
        assert planner.precisions == [None, "bf16"]
        assert not ex.replans.start(Replan(nodes, None, "join", "bf16"))
        res = planner.plan(nodes, None)
        res = PlanResult(res.plan.model_copy(update={"precision": "bf16"}), res.placement, "")
        planner.release[("n1", "n2")].set_result(res)
        await _until(lambda: ex.replans.ready is not None)
        assert ex.replans.ready is not None and ex.replans.ready[0] == (("n1", "n2"), "bf16")
        # adopted over a next plan for the same nodes in another precision
        old = planner.plan(nodes, None).plan.model_copy(update={"precision": "fp16"})
        d = DesiredState(epoch=ex.epoch, next_plan=old, next_membership=("n1", "n2"))
        adopted = ex.replans.adopt(d)
        assert adopted is not None and adopted[0].next_plan == res.plan


async def test_a_failed_replan_backs_off_for_its_membership_and_precision(
    module_plain_servers: LocalServers, tmp_path: Path
) -> None:
    """A search that fails the same way each time (here: no GPU of the pool can run the
    precision asked). Before, every decide pass started it again (an audit record each);
    now the same (membership, precision) waits its backoff, doubled per failure, and the
    reason goes into the desired state for ``sailor status``. Another precision, membership
    or node record tries at once."""
    calls: list[object] = []

    class _Failing:
        async def aplan(
            self, nodes: tuple[NodeSpec, ...], previous: Plan | None, precision: object = None
        ) -> PlanResult:
            calls.append(precision)
            raise ValueError("no GPU available (left out V100-16: no bf16 units)")

        def plan(self, *_a: object) -> PlanResult:
            raise NotImplementedError

    clock = _Clock()
    async with executor_on(module_plain_servers, tmp_path, _Failing(), clock=clock) as rig:
        ex, audit = rig.ex, rig.audit
        nodes = (_node(1), _node(2))
        assert ex.replans.start(Replan(nodes, None, "join", "bf16"))
        await _until(lambda: len(_records(audit, "plan_failed")) == 1)
        for _ in range(5):  # decide passes asking for the same replan
            assert not ex.replans.start(Replan(nodes, None, "join", "bf16"))
        assert len(calls) == 1
        d = DesiredState(epoch=ex.epoch)
        assert ex.replans.adopt(d) is None  # no plan: the reason is the wanted replan's
        noted = ex.replans.failure_shown(d, Replan(nodes, None, "join", "bf16"))
        assert noted is not None and noted[1] == "plan failed"
        assert "no bf16 units" in noted[0].plan_failed and "15 s" in noted[0].plan_failed
        again = ex.replans.failure_shown(noted[0], Replan(nodes, None, "join", "bf16"))
        assert again is None  # once
        clock.t += REPLAN_RETRY_S
        assert ex.replans.start(Replan(nodes, None, "join", "bf16"))  # the backoff is over
        await _until(lambda: len(_records(audit, "plan_failed")) == 2)
        clock.t += REPLAN_RETRY_S
        assert not ex.replans.start(Replan(nodes, None, "join", "bf16"))  # doubled
        assert "failed 2x" in ex.replans.failed[(("n1", "n2"), "bf16")][4]
        assert ex.replans.start(Replan(nodes, None, "join", "fp16"))  # another precision
        await _until(lambda: len(calls) == 3)
        assert ex.replans.start(Replan((_node(3),), None, "join", "bf16"))  # other nodes
        await _until(lambda: len(calls) == 4)
        # the same node id re-registered with other GPUs: a new question, asked at once
        await _until(lambda: len(_records(audit, "plan_failed")) == 4)
        assert not ex.replans.start(Replan((_node(3),), None, "join", "bf16"))
        other = (_node(3).model_copy(update={"gpus": 8}),)
        assert ex.replans.start(Replan(other, None, "join", "bf16"))
        await _until(lambda: len(calls) == 5)


def _stops(epoch: int, gen: int, nodes: list[str]) -> list[Any]:
    return [
        Send(Stop(command_id=f"e{epoch}-g{gen}-stop-{n}", epoch=epoch, node_id=n, at_step=gen))
        for n in nodes
    ]


async def test_acked_and_sent_commands_are_pruned_by_generation(
    module_plain_servers: LocalServers, tmp_path: Path
) -> None:
    planner = DataParallelPlanner("tiny-gpt", 4, global_batch_size=8)
    async with executor_on(module_plain_servers, tmp_path, planner) as rig:
        ex, e = rig.ex, rig.ex.epoch
        nodes = [f"n{i}" for i in range(4)]
        for gen in range(30):
            desired = DesiredState(epoch=e, generation=gen)
            sends = _stops(e, gen, nodes)
            await ex.apply(sends, desired)
            await _until(lambda: ex.sends.inflight == 0)
            ids = {f"e{e}-g{gen}-stop-{n}" for n in nodes}
            assert ids <= ex.sends.acked_view
            # acked commands are not sent again: each reached its agent once
            await ex.apply(sends, desired)
            assert ex.sends.inflight == 0
            assert sorted(rig.agents.received[-len(nodes) :]) == sorted(ids)
        assert len(rig.agents.received) == 30 * len(nodes)
        # only the kept generations are remembered (acked and sent-at: 2 entries per command)
        assert ex.sends.remembered == 2 * len(nodes) * KEEP_GENERATIONS
        assert len(ex.sends.acked_view) == len(nodes) * KEEP_GENERATIONS
        assert f"e{e}-g0-stop-n0" not in ex.sends.acked_view


async def test_a_refused_or_unanswered_command_is_not_acked_and_is_sent_again(
    module_plain_servers: LocalServers, tmp_path: Path
) -> None:
    """An agent that refuses a command (its ack says not accepted) or does not answer
    within ``command_timeout_s``: the command is not counted as acked, and the same id is
    sent again once ``resend_s`` has passed, not before; acked once the agent accepts."""
    planner = DataParallelPlanner("tiny-gpt", 4, global_batch_size=8)
    clock = _Clock()
    async with executor_on(
        module_plain_servers, tmp_path, planner, clock=clock, command_timeout_s=0.3
    ) as rig:
        ex, e, agents = rig.ex, rig.ex.epoch, rig.agents
        agents.refuse, agents.silent = {"n1"}, {"n2"}
        desired = DesiredState(epoch=e, generation=1)
        sends = _stops(e, 1, ["n0", "n1", "n2"])
        ok, refused, silent = (s.command.command_id for s in sends)
        await ex.apply(sends, desired)
        await _until(lambda: ex.sends.inflight == 0)
        assert ex.sends.acked_view == {ok}
        acks = {r["command_id"]: r["accepted"] for r in _records(rig.audit, "ack")}
        assert acks == {ok: True, refused: False}  # the silent one left no ack
        await ex.apply(sends, desired)  # within resend_s: nothing goes out
        assert ex.sends.inflight == 0 and sorted(agents.received) == sorted([ok, refused, silent])
        agents.refuse, agents.silent = set(), set()
        clock.t += ex.sends.resend_s
        await ex.apply(sends, desired)  # the two not acked, sent again under the same ids
        await _until(lambda: ex.sends.inflight == 0)
        assert ex.sends.acked_view == {ok, refused, silent}
        assert sorted(agents.received[3:]) == sorted([refused, silent])


async def test_an_ack_from_another_node_or_of_another_command_is_not_counted(
    module_plain_servers: LocalServers, tmp_path: Path
) -> None:
    """Whoever answers on a node's command subject (an agent whose node id maps to the same
    NATS token, ``gpu.1`` beside ``gpu_1``) must name that node and that command in its
    ack: an ack naming another is audited as rejected and not counted, and the command is
    sent again. Before, any accepted ack counted."""
    planner = DataParallelPlanner("tiny-gpt", 4, global_batch_size=8)
    clock = _Clock()
    async with executor_on(
        module_plain_servers, tmp_path, planner, clock=clock, command_timeout_s=0.3
    ) as rig:
        ex, e, agents = rig.ex, rig.ex.epoch, rig.agents
        agents.forged = {
            "n1": {"node_id": "n1x", "accepted": False, "reason": "addressed to n1"},
            "n2": {"command_id": "another"},
            # the addressed node's refusal of a command it could not parse
            "n3": {"command_id": "?", "accepted": False, "reason": "malformed: bad field"},
        }
        desired = DesiredState(epoch=e, generation=1)
        sends = _stops(e, 1, ["n0", "n1", "n2", "n3"])
        ok, other_node, other_cmd, unparsed = (s.command.command_id for s in sends)
        await ex.apply(sends, desired)
        await _until(lambda: ex.sends.inflight == 0)
        assert ex.sends.acked_view == {ok}
        assert {r["command_id"] for r in _records(rig.audit, "ack")} == {ok, unparsed}
        assert ex.sends.refused_view == {unparsed: "malformed: bad field"}  # n3's own refusal
        rejected = {r["command_id"]: r for r in _records(rig.audit, "ack_rejected")}
        assert set(rejected) == {other_node, other_cmd}
        assert rejected[other_node]["ack_node_id"] == "n1x"
        # what the other node said is on record
        assert (rejected[other_node]["accepted"], rejected[other_node]["reason"]) == (
            False,
            "addressed to n1",
        )
        assert rejected[other_cmd]["ack_command_id"] == "another"
        agents.forged = {}
        clock.t += ex.sends.resend_s
        await ex.apply(sends, desired)  # not acked: sent again, and now acked
        await _until(lambda: ex.sends.inflight == 0)
        assert ex.sends.acked_view == {ok, other_node, other_cmd, unparsed}


async def test_a_command_sent_slowly_goes_out_again_only_after_its_spacing(
    module_plain_servers: LocalServers, tmp_path: Path
) -> None:
    """A Send with ``resend_every`` k (a Launch refused while its node kills workers,
    ``launch.REFUSED_RESEND``): a refused copy goes out again once k x ``resend_s`` has
    passed, not at every ``resend_s``, and is acked once the agent accepts it. Before,
    such a Launch was either re-sent every ``resend_s`` or (``decide`` leaving it out)
    never, until the node's status changed."""
    planner = DataParallelPlanner("tiny-gpt", 4, global_batch_size=8)
    clock = _Clock()
    async with executor_on(module_plain_servers, tmp_path, planner, clock=clock) as rig:
        ex, e, agents = rig.ex, rig.ex.epoch, rig.agents
        agents.refuse = {"n1"}
        desired = DesiredState(epoch=e, generation=1)
        cid = f"e{e}-g1-stop-n1"
        slow = [Send(Stop(command_id=cid, epoch=e, node_id="n1", at_step=1), resend_every=8)]
        await ex.apply(slow, desired)
        await _until(lambda: ex.sends.inflight == 0)
        assert agents.received == [cid] and cid in ex.sends.refused_view
        for _ in range(7):  # seven resend_s later: not yet
            clock.t += ex.sends.resend_s
            await ex.apply(slow, desired)
            assert ex.sends.inflight == 0 and agents.received == [cid]
        agents.refuse = set()
        clock.t += ex.sends.resend_s
        await ex.apply(slow, desired)
        await _until(lambda: ex.sends.inflight == 0)
        assert agents.received == [cid, cid] and ex.sends.acked_view == {cid}


async def test_a_leader_cut_off_from_etcd_sends_nothing_until_it_is_fresh(
    module_plain_servers: LocalServers, tmp_path: Path
) -> None:
    """A lease not refreshed within its TTL may have expired and another leader taken the
    key: its commands wait (same ids) until a refresh answers, instead of reaching agents
    that have not heard from the new leader yet. The lease's clock is moved past its TTL
    (its last refresh is too old to be sure of); etcd's answer to the next refresh makes it
    fresh again."""
    planner = DataParallelPlanner("tiny-gpt", 4, global_batch_size=8)
    async with executor_on(module_plain_servers, tmp_path, planner) as rig:
        ex, e = rig.ex, rig.ex.epoch
        assert rig.lead.fresh
        rig.lease_clock.skip = LEASE_TTL + 1.0
        assert not rig.lead.fresh and rig.lead.held
        desired = DesiredState(epoch=e, generation=1)
        cid = f"e{e}-g1-stop-n0"
        sends: list[Any] = [Send(Stop(command_id=cid, epoch=e, node_id="n0", at_step=3))]
        await ex.apply(sends, desired)
        assert ex.sends.inflight == 0 and cid not in ex.sends.acked_view
        assert _records(rig.audit, "command") == []
        await _until(lambda: rig.lead.fresh, timeout=3 * LEASE_TTL)  # a refresh answered
        await ex.apply(sends, desired)
        await _until(lambda: cid in ex.sends.acked_view)
        assert [r["command_id"] for r in _records(rig.audit, "command")] == [cid]
        assert rig.agents.received == [cid]


async def test_the_desired_state_omits_a_new_field_while_unused(
    module_plain_servers: LocalServers, tmp_path: Path
) -> None:
    """A release's agents and standby refuse fields they do not know: ``bad_checkpoints``
    is written only when a checkpoint was found unreadable, ``drop_steps`` only while a save
    given up on is remembered, ``node_health`` only while a node has a failure record (and
    the phase record names the nodes excluded now), ``accusations`` only while the
    generation has some."""
    planner = DataParallelPlanner("tiny-gpt", 4, global_batch_size=8)
    async with executor_on(module_plain_servers, tmp_path, planner) as rig:
        ex, audit, e = rig.ex, rig.audit, rig.ex.epoch
        await ex.write_desired(DesiredState(epoch=e, generation=2), "test")
        raw = json.loads(await rig.desired())
        assert "bad_checkpoints" not in raw and "node_health" not in raw
        assert "drop_steps" not in raw
        assert "rendezvous_retries" not in raw and "accusations" not in raw
        assert raw["generation"] == 2 and raw["epoch"] == e
        # the generation's accusations (wire version 11): only while there are some
        named = Accusations(generation=2, named={"n1": "n3"})
        await ex.write_desired(DesiredState(epoch=e, generation=2, accusations=named), "t")
        raw = json.loads(await rig.desired())
        assert raw["accusations"] == {"generation": 2, "named": {"n1": "n3"}}
        # aborts in a row of a taken rendezvous port (wire version 9): only while counted
        await ex.write_desired(DesiredState(epoch=e, generation=2, rendezvous_retries=1), "t")
        assert json.loads(await rig.desired())["rendezvous_retries"] == 1
        assert _records(audit, "phase")[-1]["rendezvous_retries"] == 1
        assert "rendezvous_retries" not in _records(audit, "phase")[0]
        await ex.write_desired(DesiredState(epoch=e, bad_checkpoints=(9,)), "test")
        raw = json.loads(await rig.desired())
        assert raw["bad_checkpoints"] == [9] and "node_health" not in raw
        await ex.write_desired(DesiredState(epoch=e, drop_steps=(12, 7)), "test")
        raw = json.loads(await rig.desired())
        assert raw["drop_steps"] == [12, 7]  # the saves given up on, in the phase record too
        assert _records(audit, "phase")[-1]["drop_steps"] == [12, 7]
        until = time.time() + 600
        health = {
            "n1": NodeHealth(failures=1, generation=2),
            "n2": NodeHealth(failures=1, generation=2, exclusions=1, excluded_until=until),
        }
        await ex.write_desired(DesiredState(epoch=e, node_health=health), "test")
        raw = json.loads(await rig.desired())
        assert set(raw["node_health"]) == {"n1", "n2"}
        assert _records(audit, "phase")[-1]["excluded"] == {"n2": until}
        assert "excluded" not in _records(audit, "phase")[0]
        assert "suspect_checkpoint" not in raw
        assert all("suspect_checkpoint" not in r for r in _records(audit, "phase"))
        sus = SuspectCheckpoint(step=30, nodes=("n3",), generation=2)
        await ex.write_desired(DesiredState(epoch=e, suspect_checkpoint=sus), "test")
        raw = json.loads(await rig.desired())
        assert raw["suspect_checkpoint"] == {"step": 30, "nodes": ["n3"], "generation": 2}
        assert _records(audit, "phase")[-1]["suspect_checkpoint"] == raw["suspect_checkpoint"]
        # the nodes an operator readmitted (wire version 6): only while there are some
        assert "forgiven_nodes" not in raw
        await ex.write_desired(DesiredState(epoch=e, generation=2, forgiven_nodes={"n1": 2}), "t")
        assert json.loads(await rig.desired())["forgiven_nodes"] == {"n1": 2}
        # the read failures a clear of marks spent (wire version 6): only the current
        # generation's matter, and a later generation's state writes none
        await ex.write_desired(DesiredState(epoch=e, generation=2, reads_spent_through=2), "t")
        assert json.loads(await rig.desired())["reads_spent_through"] == 2
        await ex.write_desired(DesiredState(epoch=e, generation=3, reads_spent_through=2), "t")
        assert "reads_spent_through" not in json.loads(await rig.desired())


async def test_a_cause_naming_every_node_of_a_large_layout_is_written_shortened(
    module_plain_servers: LocalServers, tmp_path: Path
) -> None:
    """decide builds its states with ``model_copy`` (no validation): an abort that names 120
    lost nodes had a 2,000-character cause, written whole; no reader could parse the state
    back (a new leader refused to lead from it, agents to launch). Written shortened, and a
    state written whole before still reads."""
    planner = DataParallelPlanner("tiny-gpt", 4, global_batch_size=8)
    names = ", ".join(f"node-{i:04d}.zone-a" for i in range(120))
    cause = f"node lost without notice: {names}"
    assert len(cause) > 2000
    async with executor_on(module_plain_servers, tmp_path, planner) as rig:
        long = DesiredState(epoch=rig.ex.epoch, generation=2).model_copy(
            update={"cause": cause, "path_reason": cause}
        )
        await rig.ex.write_desired(long, "test")
        raw = await rig.desired()
        back = DesiredState.model_validate_json(raw)
        assert len(back.cause) <= 1024 and back.cause.startswith("node lost without notice: ")
        assert f"{len(cause)} characters in all" in back.cause
        assert len(json.loads(raw)["cause"]) <= 1024  # what an older reader parses too
        whole = json.loads(raw) | {"cause": cause}
        assert len(DesiredState.model_validate(whole).cause) <= 1024


async def test_the_phase_record_says_which_deadline_and_why(
    module_plain_servers: LocalServers, tmp_path: Path
) -> None:
    """An operator auditing ``checkpoint deadline passed`` reads the length the phase got
    and what it was made of: bytes, throughput, start-up; or the configured setting
    (``controller/plan_deadlines.py``; tests/unit/test_controller_plan_deadlines.py)."""
    from sailor.controller.plan_deadlines import derived_deadlines

    plan, placement = even_plan(LLAMA_7B, 2, 8, ("n1", "n2"), iteration_s=8.0)
    cfg: DecideConfig = large_cfg()
    planner = DataParallelPlanner("tiny-gpt", 4, global_batch_size=8)
    need = derived_deadlines(plan, placement, LLAMA_7B)[Phase.CHECKPOINT].seconds
    async with executor_on(module_plain_servers, tmp_path, planner, decide_cfg=cfg) as rig:
        ex = rig.ex
        state = DesiredState(
            epoch=ex.epoch,
            generation=1,
            phase=Phase.CHECKPOINT,
            phase_since=NOW,
            phase_deadline=NOW + need,
            plan=plan,
            placement=placement,
        )
        await ex.write_desired(state, "reached stop step")
        cut = state.model_copy(update={"phase_deadline": NOW + 100})
        await ex.write_desired(cut, "notice tightened the deadline")
        await ex.write_desired(DesiredState(epoch=ex.epoch, phase=Phase.IDLE), "idle")
        phases = _records(rig.audit, "phase")
        assert phases[0]["deadline_s"] == pytest.approx(need, abs=1e-3)
        assert phases[0]["deadline"] == (
            "derived from plan llama-2-7b-2x8: node n2 writes 40.4 GB at 125 MiB/s x2 + 10 s "
            f"start-up = {need:.0f} s (above deadlines.checkpoint 60 s)"
        )
        assert phases[1]["deadline_s"] == 100
        assert phases[1]["deadline"].endswith(
            "; cut to 100 s by a preemption notice (its deadline - notice_margin_s)"
        )
        assert "deadline" not in phases[2] and "deadline_s" not in phases[2]
        assert DesiredState.model_validate_json(await rig.desired()).phase is Phase.IDLE


async def test_a_failed_searchs_reason_is_shown_only_while_that_replan_is_wanted(
    module_plain_servers: LocalServers, tmp_path: Path
) -> None:
    """``plan_failed`` (``sailor status``: "last failed search") said why the search for
    three nodes failed long after the job wanted another replan, or none (its third node
    left, the job went IDLE): only a launch or an adopted plan cleared it. Now it is the
    reason of the replan the job waits for: gone once that is another one or none, back
    while that same replan is backed off again, written only when it changes."""

    class _Failing:
        async def aplan(
            self, nodes: tuple[NodeSpec, ...], previous: Plan | None, precision: object = None
        ) -> PlanResult:
            raise ValueError("no layout fits n3's memory")

        def plan(self, *_a: object) -> PlanResult:
            raise NotImplementedError

    clock = _Clock()
    async with executor_on(module_plain_servers, tmp_path, _Failing(), clock=clock) as rig:
        ex, audit = rig.ex, rig.audit
        three = Replan((_node(1), _node(2), _node(3)), None, "join", "bf16")
        two = Replan((_node(1), _node(2)), None, "n3 left", "bf16")
        assert ex.replans.start(three)
        await _until(lambda: len(_records(audit, "plan_failed")) == 1)
        d = DesiredState(epoch=ex.epoch)
        shown = ex.replans.failure_shown(d, three)
        assert shown is not None and "no layout fits" in shown[0].plan_failed
        d = shown[0]
        assert ex.replans.failure_shown(d, three) is None  # backed off, still wanted: no write
        # n3 left: the job waits for a replan of two nodes, not for the failed one
        gone = ex.replans.failure_shown(d, two)
        assert gone is not None and gone[0].plan_failed == ""
        assert "no longer wanted" in gone[1]
        # n3 back with the same record while the backoff holds: said again
        again = ex.replans.failure_shown(gone[0], three)
        assert again is not None and again[0].plan_failed == d.plan_failed
        # the same ids, other records (n3 re-registered with more GPUs): asked at once
        other = Replan(
            (_node(1), _node(2), _node(3).model_copy(update={"gpus": 8})), None, "", "bf16"
        )
        assert ex.replans.failure_shown(d, other) is not None
        # no replan wanted at all (every node left: IDLE)
        idle = ex.replans.failure_shown(d, None)
        assert idle is not None and idle[0].plan_failed == "" and "no replan" in idle[1]
        assert ex.replans.failure_shown(idle[0], None) is None
    # a reason a previous leader wrote (no failure on record here) stays while a replan is
    # wanted (its result replaces or clears it) and goes when none is
    async with executor_on(module_plain_servers, tmp_path / "b", _Failing(), clock=clock) as rig:
        inherited = DesiredState(epoch=rig.ex.epoch, plan_failed="replan for 3 nodes failed 1x")
        assert rig.ex.replans.failure_shown(inherited, three) is None
        assert rig.ex.replans.failure_shown(inherited, None) is not None
