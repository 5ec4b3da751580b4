"""Failures nobody can be blamed for count against the job, with its backoff.

Two kinds, each relaunched at full rate forever before (no node and not the job was
charged): only parent-written SIGABRT records reported (NCCL's watchdog giving up on a
collective that hung everywhere: a dead NIC, NCCL's ports blocked), and a LOAD or VERIFY
deadline no placed node got past (stretched to its cap first: ``launch.py``). Every test
here failed on that code."""

from __future__ import annotations

import json

from sailor.controller.failing_nodes import stalled
from sailor.controller.forgetting import trained
from sailor.controller.node_health import (
    ExclusionPolicy,
    charge,
    held,
    stall,
)
from sailor.megatron_patch.errors import signal_failure_record
from sailor.schemas.runtime import DesiredState, NodeHealth, Phase

POLICY = ExclusionPolicy(failures=3, exclude_s=100, max_exclude_s=300)
IDS = ("n1", "n2", "n3", "n4")


def _d(gen: int, placed: int = 4, **kw: object) -> DesiredState:
    placement = {f"n{i}": (i - 1,) for i in range(1, placed + 1)}
    return DesiredState(epoch=1, generation=gen, placement=placement, **kw)  # type: ignore[arg-type]


def _abrt(rank: int) -> str:
    """What a node whose rank NCCL's watchdog aborted reports: the parent's record."""
    return json.dumps(signal_failure_record(rank, -6, 12))


def _every_rank_aborted() -> dict[str, str]:
    return {n: _abrt(i) for i, n in enumerate(IDS)}


def _own(msg: str = "CUDA error: uncorrectable ECC error encountered") -> str:
    return json.dumps(
        {"origin": "local", "retry": True, "error_type": "RuntimeError", "message": msg}
    )


def test_only_sigabrts_on_most_placed_nodes_count_against_the_job_once() -> None:
    c = charge(_d(5), {f"n{i}": _abrt(i) for i in (1, 2, 3)}, 10.0, POLICY)
    assert c.health == {}
    assert (c.job.failures, c.job.generation, c.job.excluded_until) == (1, 5, 0.0)
    assert c.job.cause.startswith("Signal: rank 1 killed") and "SIGABRT" in c.job.cause
    assert "not counted against n1, n2, n3: only SIGABRTs" in c.notes[0]
    assert c.notes[-1].startswith("counted against the job (failure 1 in a row): only SIGABRTs")
    assert "by 3 of the 4 placed node(s) (n1, n2, n3)" in c.notes[-1]
    assert "the node at fault is not known" in c.notes[-1]
    # the generation counts once: the teardown's passes see the same reports (or more)
    again = charge(_d(5, job_health=c.job), {f"n{i}": _abrt(i) for i in (1, 2, 3, 4)}, 11.0, POLICY)
    assert again.job == c.job and again.health == {}


def test_the_threshold_is_the_alike_rules() -> None:
    """At least JOB_WIDE_MIN_NODES (2) nodes and more than half of the placed ones."""
    one = charge(_d(5), {"n1": _abrt(0)}, 10.0, POLICY)
    assert one.job == NodeHealth() and one.health == {}
    half = charge(_d(5), {"n1": _abrt(0), "n2": _abrt(1)}, 10.0, POLICY)
    assert half.job == NodeHealth() and half.health == {}
    most = charge(_d(5, placed=3), {"n1": _abrt(0), "n2": _abrt(1)}, 10.0, POLICY)
    assert most.job.failures == 1 and most.health == {}
    # with another node's own error it is that node's, as before, never the job's
    mixed = charge(
        _d(5), {"n1": _abrt(0), "n2": _abrt(1), "n3": _abrt(2), "n4": _own()}, 10.0, POLICY
    )
    assert set(mixed.health) == {"n4"} and mixed.job == NodeHealth()


def test_a_one_node_jobs_only_sigabrt_is_its_nodes() -> None:
    """One node's failure is its own, even in a one-node layout (``JOB_WIDE_MIN_NODES``):
    the node is counted, so the planner can move the job to a spare (review: the job was
    charged and held, never moved off a bad node)."""
    c = charge(_d(5, placed=1), {"n1": _abrt(0)}, 10.0, POLICY)
    assert set(c.health) == {"n1"} and c.health["n1"].failures == 1 and c.job == NodeHealth()


def test_sigabrts_after_a_placed_node_was_lost_count_against_nobody() -> None:
    c = charge(_d(5), {f"n{i}": _abrt(i) for i in (1, 2, 3)}, 10.0, POLICY, lost=("n4",))
    assert c.health == {} and c.job == NodeHealth()
    assert "not counted against n1, n2, n3: SIGABRT after the loss of n4" in c.notes[0]


def test_a_nodes_own_failure_reported_later_takes_the_jobs_count_back() -> None:
    """The SIGABRTs were the watchdog giving up on that node's rank: it is charged, and the
    job's count (and the exclusion that count set) is taken back, for good in that
    generation."""
    before = NodeHealth(failures=2, generation=4, cause="Signal: rank # killed by SIGABRT")
    sigs = {f"n{i}": _abrt(i) for i in (1, 2, 3)}
    c = charge(_d(5, job_health=before), sigs, 10.0, POLICY)
    assert c.job.failures == 3 and held(c.job, 10.0) and c.job.exclusions == 1
    late = charge(_d(5, job_health=c.job), {"n1": _abrt(1), "n4": _own()}, 11.0, POLICY)
    assert set(late.health) == {"n4"} and late.health["n4"].failures == 1
    assert (late.job.failures, late.job.exclusions, late.job.excluded_until) == (2, 0, 0.0)
    assert late.job.generation == -1 and not held(late.job, 11.0)
    assert "taken back from the job: n4 reported a failure of its own" in " ".join(late.notes)
    # the SIGABRTs still reported later count against nobody: n4's record is the evidence
    d = _d(5, job_health=late.job, node_health=late.health)
    still = charge(d, sigs, 12.0, POLICY)
    assert still.job == late.job and still.health == late.health
    # a count with nothing before it leaves no record
    fresh = charge(_d(5), sigs, 10.0, POLICY).job
    assert charge(_d(5, job_health=fresh), {"n4": _own()}, 11.0, POLICY).job == NodeHealth()


def test_three_hung_generations_in_a_row_hold_the_job_and_one_that_trains_resets_it() -> None:
    job = NodeHealth()
    for gen in (5, 6, 7):
        c = charge(_d(gen, job_health=job), _every_rank_aborted(), 10.0, POLICY)
        job = c.job
        assert c.health == {} and job.failures == gen - 4
    assert held(job, 109.0) and not held(job, 110.0) and job.exclusions == 1
    assert c.notes[-1].startswith("held the job until") and "3 consecutive failures" in c.notes[-1]
    _, job = trained({}, job, IDS)
    assert job.failures == 0 and job.exclusions == 1  # the backoff stays
    c = charge(_d(8, job_health=job), _every_rank_aborted(), 500.0, POLICY)
    assert c.job.failures == 1 and not held(c.job, 500.0)


def test_a_stalled_generation_counts_against_the_job_once_with_the_policys_backoff() -> None:
    job = NodeHealth()
    for gen in (5, 6, 7):
        what = "none of the 4 placed node(s) had its workers running"
        job, note = stall(_d(gen), job, what, 10.0, POLICY)
        assert job.generation == gen and job.cause.startswith("DeadlineMissed: none of the 4")
        assert stall(_d(gen), job, "again", 11.0, POLICY) == (job, "")
        assert stall(_d(gen, forgiven_through=gen), NodeHealth(), what, 11.0, POLICY) == (
            NodeHealth(),
            "",
        )
    assert held(job, 109.0) and note.startswith("held the job until")
    assert trained({}, job, IDS)[1].failures == 0


def test_stalled_is_every_node_short_and_all_or_none_of_them_late() -> None:
    d = _d(5, phase=Phase.LOAD, phase_since=880.0, phase_deadline=1000.0, load_step=10)
    want = (
        "none of the 4 placed node(s) had its workers running by the load deadline "
        "(120 s, deadlines.load)"
    )
    assert stalled(d, IDS, IDS) == want  # every one late
    assert stalled(d, (), IDS) == want  # none late, none through (all still starting)
    assert stalled(d, ("n2",), IDS) == ""  # n2 is to blame: it is charged, not the job
    assert stalled(d, (), IDS[1:]) == ""  # n1 got through
    v = d.model_copy(update={"phase": Phase.VERIFY})
    assert "reported a step past 10 by the verify deadline (120 s, deadlines.verify)" in (
        stalled(v, (), IDS)
    )
    s = v.model_copy(update={"deadline_stretch": {"verify": 4}, "phase_since": 520.0})
    assert "by the verify deadline (480 s, deadlines.verify x4)" in stalled(s, (), IDS)
    # never at LAUNCH: no ack at all is the command bus's or the controller's fault
    launch = d.model_copy(update={"phase": Phase.LAUNCH, "phase_since": 980.0})
    assert stalled(launch, IDS, IDS) == ""
    # one node: late, it is charged itself; short only (still starting), a stall
    one = _d(5, placed=1, phase=Phase.LOAD, phase_since=880.0, phase_deadline=1000.0)
    assert stalled(one, ("n1",), ("n1",)) == ""
    assert stalled(one, (), ("n1",)).startswith("none of the 1 placed node(s)")


def test_a_readmitted_node_stays_placed_in_the_count_of_a_hang() -> None:
    """A readmitted node's SIGABRT of the generation is no evidence against the job, and
    the node still counts among the placed ones: a hang is charged when more than half of
    the placed nodes, none of them readmitted, report only SIGABRTs. A two-node job with
    one node readmitted is never charged a hang in that generation (one node's failure is
    never the job's); the next generation, with nothing forgiven, is. Counting only the
    nodes not readmitted would charge two of four on the word of half the layout, in a
    generation whose failures the operator forgave (decided so: a hang charged late costs
    one more relaunch, a hang charged wrongly holds the job)."""
    sigs = {"n1": _abrt(0), "n2": _abrt(1)}
    two = charge(_d(5, placed=2, forgiven_nodes={"n1": 5}), sigs, 10.0, POLICY)
    assert two.job == NodeHealth() and two.health == {}
    after = charge(_d(6, placed=2), sigs, 20.0, POLICY)
    assert after.job.failures == 1 and after.job.generation == 6 and after.health == {}
    half = charge(_d(5, forgiven_nodes={"n1": 5, "n2": 5}), _every_rank_aborted(), 10.0, POLICY)
    assert half.job == NodeHealth() and half.health == {}
    most = charge(_d(5, forgiven_nodes={"n1": 5}), _every_rank_aborted(), 10.0, POLICY)
    assert most.job.failures == 1 and "by 3 of the 4 placed node(s)" in most.notes[-1]
