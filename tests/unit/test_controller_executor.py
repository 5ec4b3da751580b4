"""The executor's replans (timeout, replacement) and its memory (bounded by generations).

In process, with stand-ins for etcd and NATS: a store that records guarded writes, a command
channel that acks every command, a planner whose search the test holds or lets go.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

from sailor.controller.audit import AuditLog
from sailor.controller.decision_types import Replan, Send
from sailor.controller.executor import KEEP_GENERATIONS, REPLAN_RETRY_S, Executor
from sailor.controller.planning import DataParallelPlanner, PlanResult
from sailor.coordination import Keys, SystemClock, TaskSet
from sailor.schemas.commands import Stop
from sailor.schemas.hardware import NodeSpec
from sailor.schemas.plan import Plan
from sailor.schemas.runtime import CommandAck, DesiredState, NodeHealth, SuspectCheckpoint


class _Store:
    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    async def put_guarded(self, key: str, value: bytes, guard: str, epoch: int) -> int:
        self.data[key] = value
        return 1


class _Commands:
    async def request(self, node_id: str, data: bytes, timeout: float) -> bytes:
        cid = json.loads(data)["command_id"]
        return CommandAck(command_id=cid, node_id=node_id, accepted=True).model_dump_json().encode()


class _Lead:
    epoch = 7
    held = True
    fresh = True


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


def make_executor(
    tmp_path: Path, planner: Any, clock: Any = None, **kw: Any
) -> tuple[Executor, TaskSet, AuditLog]:
    """An executor over stand-ins for etcd's guarded put, the agents' acks and the lease."""
    tasks = TaskSet("test-executor")
    audit = AuditLog(tmp_path / "audit.jsonl")
    ex = Executor(
        _Store(),  # type: ignore[arg-type]
        _Commands(),  # type: ignore[arg-type]
        Keys(job="ex"),
        audit,
        _Lead(),  # type: ignore[arg-type]
        planner,
        clock or SystemClock(),
        tasks,
        lambda urgent: None,
        **kw,
    )
    return ex, tasks, audit


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


async def test_a_timed_out_replan_is_cancelled_and_asked_again(tmp_path: Path) -> None:
    planner = _HeldPlanner()
    clock = _Clock()
    ex, tasks, audit = make_executor(tmp_path, planner, clock=clock, replan_timeout_s=0.2)
    try:
        nodes = (_node(1), _node(2))
        assert ex._start_replan(Replan(nodes, None, "join"))
        await _until(lambda: planner.cancelled == [("n1", "n2")])  # the search was stopped
        await _until(lambda: bool(_records(audit, "plan_failed")))
        assert ex._replanning is None  # so a later pass starts it again
        assert not ex._start_replan(Replan(nodes, None, "join"))  # after its backoff
        clock.t += REPLAN_RETRY_S
        assert ex._start_replan(Replan(nodes, None, "join"))
        await _until(lambda: len(planner.started) == 2)
        planner.release[("n1", "n2")].set_result(planner.plan(nodes, None))
        await _until(lambda: ex.plan_ready is not None)
    finally:
        await tasks.close()
        audit.close()


async def test_a_replaced_replan_is_cancelled_and_cannot_clear_the_newer_one(
    tmp_path: Path,
) -> None:
    planner = _HeldPlanner()
    ex, tasks, audit = make_executor(tmp_path, planner)
    try:
        a, b = (_node(1), _node(2)), (_node(1), _node(2), _node(3))
        assert ex._start_replan(Replan(a, None, "join"))
        await _until(lambda: len(planner.started) == 1)
        assert ex._start_replan(Replan(b, None, "join"))
        # the older search is stopped, not left running for the newer one to queue behind
        await _until(lambda: planner.cancelled == [("n1", "n2")])
        assert ex._replanning == (("n1", "n2", "n3"), None)
        assert not ex._start_replan(Replan(b, None, "join"))  # under way: not started twice
        # the newer one fails: that clears it (and only it)
        await _until(lambda: len(planner.started) == 2)
        planner.release[("n1", "n2", "n3")].set_result(RuntimeError("no plan"))
        await _until(lambda: ex._replanning is None)
    finally:
        await tasks.close()
        audit.close()


async def test_a_failing_older_replan_leaves_the_newer_one_running(tmp_path: Path) -> None:
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

    ex, tasks, audit = make_executor(tmp_path, _Planner())
    try:
        assert ex._start_replan(Replan((_node(1),), None, "join"))
        await _until(lambda: 1 in gate)
        assert ex._start_replan(Replan((_node(1), _node(2)), None, "join"))
        await _until(lambda: 2 in gate)
        if not gate[1].done():
            gate[1].set_result(None)  # the replaced search ends, and fails, after all
        await asyncio.sleep(0.1)
        assert ex._replanning == (("n1", "n2"), None)
    finally:
        for f in gate.values():
            if not f.done():
                f.set_result(None)
        await tasks.close()
        audit.close()


async def test_a_replan_in_another_precision_is_not_swallowed_by_one_under_way(
    tmp_path: Path,
) -> None:
    """A replan started before the job's precision was fixed (None) for membership M, then
    ``Replan(M, bf16)``: before, the second was taken for the first (keyed by membership
    alone), its precision-free result adopted, dropped by ``launch_next`` and planned
    again. Now the second is a replan of its own and the first is stopped."""
    planner = _HeldPlanner()
    ex, tasks, audit = make_executor(tmp_path, planner)
    try:
        nodes = (_node(1), _node(2))
        assert ex._start_replan(Replan(nodes, None, "join"))
        await _until(lambda: len(planner.started) == 1)
        assert ex._start_replan(Replan(nodes, None, "join", "bf16"))
        await _until(lambda: planner.cancelled == [("n1", "n2")])
        await _until(lambda: len(planner.started) == 2)
        assert planner.precisions == [None, "bf16"]
        assert not ex._start_replan(Replan(nodes, None, "join", "bf16"))
        res = planner.plan(nodes, None)
        res = PlanResult(res.plan.model_copy(update={"precision": "bf16"}), res.placement, "")
        planner.release[("n1", "n2")].set_result(res)
        await _until(lambda: ex.plan_ready is not None)
        assert ex.plan_ready is not None and ex.plan_ready[0] == (("n1", "n2"), "bf16")
        # adopted over a next plan for the same nodes in another precision
        old = planner.plan(nodes, None).plan.model_copy(update={"precision": "fp16"})
        d = DesiredState(epoch=7, next_plan=old, next_membership=("n1", "n2"))
        adopted = ex.adopt_plan(d)
        assert adopted is not None and adopted[0].next_plan == res.plan
    finally:
        await tasks.close()
        audit.close()


async def test_a_failed_replan_backs_off_for_its_membership_and_precision(tmp_path: Path) -> None:
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
    ex, tasks, audit = make_executor(tmp_path, _Failing(), clock=clock)
    try:
        nodes = (_node(1), _node(2))
        assert ex._start_replan(Replan(nodes, None, "join", "bf16"))
        await _until(lambda: len(_records(audit, "plan_failed")) == 1)
        for _ in range(5):  # decide passes asking for the same replan
            assert not ex._start_replan(Replan(nodes, None, "join", "bf16"))
        assert len(calls) == 1
        d = DesiredState(epoch=7)
        assert ex.adopt_plan(d) is None  # no plan: the reason is the wanted replan's
        noted = ex.failure_shown(d, Replan(nodes, None, "join", "bf16"))
        assert noted is not None and noted[1] == "plan failed"
        assert "no bf16 units" in noted[0].plan_failed and "15 s" in noted[0].plan_failed
        assert ex.failure_shown(noted[0], Replan(nodes, None, "join", "bf16")) is None  # once
        clock.t += REPLAN_RETRY_S
        assert ex._start_replan(Replan(nodes, None, "join", "bf16"))  # the backoff is over
        await _until(lambda: len(_records(audit, "plan_failed")) == 2)
        clock.t += REPLAN_RETRY_S
        assert not ex._start_replan(Replan(nodes, None, "join", "bf16"))  # doubled
        assert "failed 2x" in ex._failed[(("n1", "n2"), "bf16")][4]
        assert ex._start_replan(Replan(nodes, None, "join", "fp16"))  # another precision
        await _until(lambda: len(calls) == 3)
        assert ex._start_replan(Replan((_node(3),), None, "join", "bf16"))  # other nodes
        await _until(lambda: len(calls) == 4)
        # the same node id re-registered with other GPUs: a new question, asked at once
        await _until(lambda: len(_records(audit, "plan_failed")) == 4)
        assert not ex._start_replan(Replan((_node(3),), None, "join", "bf16"))
        other = (_node(3).model_copy(update={"gpus": 8}),)
        assert ex._start_replan(Replan(other, None, "join", "bf16"))
        await _until(lambda: len(calls) == 5)
    finally:
        await tasks.close()
        audit.close()


async def test_acked_and_sent_commands_are_pruned_by_generation(tmp_path: Path) -> None:
    ex, tasks, audit = make_executor(
        tmp_path, DataParallelPlanner("tiny-gpt", 4, global_batch_size=8)
    )
    try:
        nodes = [f"n{i}" for i in range(4)]
        for gen in range(30):
            desired = DesiredState(epoch=7, generation=gen)
            sends: list[Any] = [
                Send(Stop(command_id=f"e7-g{gen}-stop-{n}", epoch=7, node_id=n, at_step=gen))
                for n in nodes
            ]
            await ex.apply(sends, desired)
            await _until(lambda: ex.inflight == 0)
            assert {f"e7-g{gen}-stop-{n}" for n in nodes} <= ex.acked_view
            # acked commands are not sent again
            await ex.apply(sends, desired)
            assert ex.inflight == 0
        # only the kept generations are remembered (acked and sent-at: 2 entries per command)
        assert ex.remembered == 2 * len(nodes) * KEEP_GENERATIONS
        assert len(ex.acked_view) == len(nodes) * KEEP_GENERATIONS
        assert "e7-g0-stop-n0" not in ex.acked_view
    finally:
        await tasks.close()
        audit.close()


async def test_a_leader_cut_off_from_etcd_sends_nothing_until_it_is_fresh(tmp_path: Path) -> None:
    """A lease not refreshed within its TTL may have expired and another leader taken the
    key: its commands wait (same ids) until a refresh answers, instead of reaching agents
    that have not heard from the new leader yet."""
    ex, tasks, audit = make_executor(
        tmp_path, DataParallelPlanner("tiny-gpt", 4, global_batch_size=8)
    )
    try:
        ex.lead.fresh = False  # type: ignore[misc]
        desired = DesiredState(epoch=7, generation=1)
        sends: list[Any] = [
            Send(Stop(command_id="e7-g1-stop-n0", epoch=7, node_id="n0", at_step=3))
        ]
        await ex.apply(sends, desired)
        assert ex.inflight == 0 and "e7-g1-stop-n0" not in ex.acked_view
        assert _records(audit, "command") == []
        ex.lead.fresh = True  # type: ignore[misc]
        await ex.apply(sends, desired)
        await _until(lambda: "e7-g1-stop-n0" in ex.acked_view)
        assert [r["command_id"] for r in _records(audit, "command")] == ["e7-g1-stop-n0"]
    finally:
        await tasks.close()
        audit.close()


async def test_the_desired_state_omits_a_new_field_while_unused(tmp_path: Path) -> None:
    """A release's agents and standby refuse fields they do not know: ``bad_checkpoints``
    is written only when a checkpoint was found unreadable, ``node_health`` only while a
    node has a failure record (and the phase record names the nodes excluded now)."""
    ex, tasks, audit = make_executor(
        tmp_path, DataParallelPlanner("tiny-gpt", 4, global_batch_size=8)
    )
    try:
        await ex.write_desired(DesiredState(epoch=7, generation=2), "test")
        raw = json.loads(ex.store.data[ex.keys.desired])  # type: ignore[attr-defined]
        assert "bad_checkpoints" not in raw and "node_health" not in raw
        assert raw["generation"] == 2
        await ex.write_desired(DesiredState(epoch=7, bad_checkpoints=(9,)), "test")
        raw = json.loads(ex.store.data[ex.keys.desired])  # type: ignore[attr-defined]
        assert raw["bad_checkpoints"] == [9] and "node_health" not in raw
        until = time.time() + 600
        health = {
            "n1": NodeHealth(failures=1, generation=2),
            "n2": NodeHealth(failures=1, generation=2, exclusions=1, excluded_until=until),
        }
        await ex.write_desired(DesiredState(epoch=7, node_health=health), "test")
        raw = json.loads(ex.store.data[ex.keys.desired])  # type: ignore[attr-defined]
        assert set(raw["node_health"]) == {"n1", "n2"}
        assert _records(audit, "phase")[-1]["excluded"] == {"n2": until}
        assert "excluded" not in _records(audit, "phase")[0]
        assert "suspect_checkpoint" not in raw
        assert all("suspect_checkpoint" not in r for r in _records(audit, "phase"))
        sus = SuspectCheckpoint(step=30, nodes=("n3",), generation=2)
        await ex.write_desired(DesiredState(epoch=7, suspect_checkpoint=sus), "test")
        raw = json.loads(ex.store.data[ex.keys.desired])  # type: ignore[attr-defined]
        assert raw["suspect_checkpoint"] == {"step": 30, "nodes": ["n3"], "generation": 2}
        assert _records(audit, "phase")[-1]["suspect_checkpoint"] == raw["suspect_checkpoint"]
    finally:
        await tasks.close()
        audit.close()


async def test_a_cause_naming_every_node_of_a_large_layout_is_written_shortened(
    tmp_path: Path,
) -> None:
    """decide builds its states with ``model_copy`` (no validation): an abort that names 120
    lost nodes had a 2,000-character cause, written whole; no reader could parse the state
    back (a new leader refused to lead from it, agents to launch). Written shortened, and a
    state written whole before still reads."""
    ex, tasks, audit = make_executor(
        tmp_path, DataParallelPlanner("tiny-gpt", 4, global_batch_size=8)
    )
    names = ", ".join(f"node-{i:04d}.zone-a" for i in range(120))
    cause = f"node lost without notice: {names}"
    assert len(cause) > 2000
    try:
        long = DesiredState(epoch=7, generation=2).model_copy(
            update={"cause": cause, "path_reason": cause}
        )
        await ex.write_desired(long, "test")
        raw = ex.store.data[ex.keys.desired]  # type: ignore[attr-defined]
        back = DesiredState.model_validate_json(raw)
        assert len(back.cause) <= 1024 and back.cause.startswith("node lost without notice: ")
        assert f"{len(cause)} characters in all" in back.cause
        assert len(json.loads(raw)["cause"]) <= 1024  # what an older reader parses too
        whole = json.loads(raw) | {"cause": cause}
        assert len(DesiredState.model_validate(whole).cause) <= 1024
    finally:
        await tasks.close()
        audit.close()


async def test_a_failed_searchs_reason_is_shown_only_while_that_replan_is_wanted(
    tmp_path: Path,
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
    ex, tasks, audit = make_executor(tmp_path, _Failing(), clock=clock)
    try:
        three = Replan((_node(1), _node(2), _node(3)), None, "join", "bf16")
        two = Replan((_node(1), _node(2)), None, "n3 left", "bf16")
        assert ex._start_replan(three)
        await _until(lambda: len(_records(audit, "plan_failed")) == 1)
        d = DesiredState(epoch=7)
        shown = ex.failure_shown(d, three)
        assert shown is not None and "no layout fits" in shown[0].plan_failed
        d = shown[0]
        assert ex.failure_shown(d, three) is None  # backed off, still wanted: no write
        # n3 left: the job waits for a replan of two nodes, not for the failed one
        gone = ex.failure_shown(d, two)
        assert gone is not None and gone[0].plan_failed == ""
        assert "no longer wanted" in gone[1]
        # n3 back with the same record while the backoff holds: said again
        again = ex.failure_shown(gone[0], three)
        assert again is not None and again[0].plan_failed == d.plan_failed
        # the same ids, other records (n3 re-registered with more GPUs): asked at once
        other = Replan(
            (_node(1), _node(2), _node(3).model_copy(update={"gpus": 8})), None, "", "bf16"
        )
        assert ex.failure_shown(d, other) is not None
        # no replan wanted at all (every node left: IDLE)
        idle = ex.failure_shown(d, None)
        assert idle is not None and idle[0].plan_failed == "" and "no replan" in idle[1]
        assert ex.failure_shown(idle[0], None) is None
        # a reason a previous leader wrote (no failure on record here) stays while a replan
        # is wanted (its result replaces or clears it) and goes when none is
        fresh, tasks2, audit2 = make_executor(tmp_path / "b", _Failing(), clock=clock)
        try:
            inherited = DesiredState(epoch=8, plan_failed="replan for 3 nodes failed 1x")
            assert fresh.failure_shown(inherited, three) is None
            assert fresh.failure_shown(inherited, None) is not None
        finally:
            await tasks2.close()
            audit2.close()
    finally:
        await tasks.close()
        audit.close()
