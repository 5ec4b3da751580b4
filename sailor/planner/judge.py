"""Judging the search's allocations: closed-form ranking, then simulation of the best.

:func:`candidates` gives each allocation its closed-form figures; :func:`fast_ok` and
:func:`fast_score` filter and rank them; :func:`judge` turns the best into plans
(:func:`plan_of`), simulates them with :func:`sailor.simulator.simulate` until it has
enough, and ranks the feasible ones by the simulator's figures into a :class:`SearchResult`
(:func:`empty_result` when none is). :func:`objective_score` is the objective as one number
(shared with the baselines); :func:`explain_candidate` says how a plan was built.

Pure: values in, values out (callbacks may be passed). Only plans the simulator says fit in
memory and meet every constraint are ever ranked.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from sailor.planner.allocate import Allocation, to_plan
from sailor.planner.api import Constraints, Objective, RankedPlan, SearchStats
from sailor.planner.fast_estimate import FastFigures, fast_estimate
from sailor.planner.placement import unplaceable
from sailor.planner.scenarios import sync_model
from sailor.planner.template_pool import SearchState
from sailor.planner.templates import PipelineTemplate
from sailor.schemas import Estimate, Plan, Pool
from sailor.simulator import ProfileLookupError

__all__ = [
    "Candidate",
    "SearchResult",
    "candidates",
    "empty_result",
    "explain_candidate",
    "fast_ok",
    "fast_score",
    "judge",
    "objective_score",
    "plan_of",
    "sim_score",
]


@dataclass(frozen=True)
class Candidate:
    """An allocation the search kept, with its figures (simulated if ``estimate`` is set)."""

    alloc: Allocation
    fast: FastFigures
    estimate: Estimate | None = None
    plan: Plan | None = None
    violations: tuple[str, ...] = ()


@dataclass(frozen=True)
class SearchResult:
    """Ranked plans (best first), or none with the reason."""

    plans: tuple[RankedPlan, ...]
    reason: str
    objective: Objective
    constraints: Constraints
    upper_bound_iter_s: float
    candidates: tuple[Candidate, ...]
    stats: SearchStats
    state: SearchState
    pool: Pool
    previous: Plan | None = None
    allocations: tuple[Allocation, ...] = ()
    """The allocation behind each ranked plan (same order): what a replan warm-starts from."""
    left_out: tuple[str, ...] = ()
    """The pool's GPU types left out for the job's precision, one line each with the reason
    (:func:`sailor.planner.job_precision.runnable_pool`); every plan's ``explain`` starts
    with them."""


def objective_score(objective: Objective, thr: float, cost_iter: float, cost_hour: float) -> float:
    """The objective as one number, larger is better (shared with the baselines)."""
    if objective == "throughput":
        return thr
    if objective == "cost":
        return -cost_iter
    return thr / cost_hour if cost_hour > 0 else 0.0


def fast_score(objective: Objective, c: Candidate) -> float:
    return objective_score(
        objective, 1.0 / c.fast.iteration_s, c.fast.cost_per_iter, c.fast.cost_per_hour
    )


def fast_ok(f: FastFigures, c: Constraints, slack: float) -> bool:
    if c.max_cost_per_iter_usd is not None and f.cost_per_iter > c.max_cost_per_iter_usd * slack:
        return False
    if c.max_cost_per_hour_usd is not None and f.cost_per_hour > c.max_cost_per_hour_usd * (
        1 + 1e-9
    ):
        return False
    return not (
        c.min_throughput_iter_s is not None
        and 1.0 / f.iteration_s < c.min_throughput_iter_s / slack
    )


def candidates(state: SearchState, allocs: Sequence[Allocation]) -> list[Candidate]:
    sync = sync_model(state)
    seen: set[tuple[object, ...]] = set()
    out: list[Candidate] = []
    for a in allocs:
        if a.key in seen:
            continue
        seen.add(a.key)
        out.append(Candidate(alloc=a, fast=fast_estimate(a, state.tables, sync, state.pricing)))
    return out


def plan_of(state: SearchState, alloc: Allocation, plan_id: str) -> Plan:
    """``alloc`` as the plan the simulator is given, in the job's precision once it is fixed
    (``Inputs.precision``), else the one its GPU types give the model's request."""
    inputs = state.tables.inputs
    gbs = inputs.model.global_batch_size
    p = to_plan(alloc, inputs.model.name, gbs, plan_id=plan_id, pricing=state.pricing)
    if inputs.precision is not None:
        return p.model_copy(update={"precision": inputs.precision})
    return p.with_precision(inputs.gpu_specs, inputs.model.precision)


def _simulate_candidate(
    state: SearchState,
    c: Candidate,
    constraints: Constraints,
    plan_id: str,
    pool: Pool | None = None,
) -> Candidate:
    """``c`` with its plan, the simulator's estimate and the constraints it breaks (with
    ``pool``: replica groups that would find no node among its nodes are one)."""
    p = plan_of(state, c.alloc, plan_id)
    try:
        est = state.tables.inputs.simulate(p)
    except (ProfileLookupError, KeyError, ValueError) as exc:
        return Candidate(c.alloc, c.fast, None, p, (f"simulator: {exc}",))
    viol = list(constraints.violations(est, c.fast.cost_per_hour))
    if not est.fits_in_memory:
        viol.append(f"peak memory {est.peak_memory_bytes / 2**30:.2f} GiB exceeds a GPU")
    if pool is not None:
        why = unplaceable(p, pool)
        if why is not None:
            viol.append(f"replica groups do not fit the nodes: {why}")
    return Candidate(c.alloc, c.fast, est, p, tuple(viol))


def sim_score(objective: Objective, c: Candidate) -> float:
    assert c.estimate is not None
    return objective_score(
        objective, c.estimate.throughput_iter_s, c.estimate.cost_per_iter_usd, c.fast.cost_per_hour
    )


def judge(
    state: SearchState,
    pool: Pool,
    objective: Objective,
    constraints: Constraints,
    ok: Sequence[Candidate],
    n_cands: int,
    enough: Callable[[Sequence[Candidate], Sequence[Candidate]], bool],
    limit: int,
    moves_of: Callable[[Candidate], tuple[tuple[int, ...], int]],
    previous: Plan | None,
    prefer_less_movement: float,
    top_k: int,
    ub: float,
    stats: SearchStats,
    progress: Callable[[int], None] | None = None,
    done: Callable[[], None] | None = None,
) -> SearchResult:
    """Simulate ``ok`` in order until ``enough`` (at most ``limit``), then rank the feasible
    plans by the simulator's figures (within ``prefer_less_movement`` of the best, by the
    layer replicas they move from ``previous``)."""
    judged: list[Candidate] = []
    feasible: list[Candidate] = []
    idx = 0
    while idx < len(ok) and idx < limit:
        cand = _simulate_candidate(state, ok[idx], constraints, f"sailor-{idx + 1}", pool)
        idx += 1
        judged.append(cand)
        if cand.estimate is not None and not cand.violations:
            feasible.append(cand)
        if progress is not None:
            progress(idx)
        if enough(judged, feasible):
            break
    if done is not None:
        done()
    kept = judged + list(ok[idx:])
    if not feasible:
        if not ok:
            reason = (
                "no allocation meets the constraints by the search's estimate "
                f"({n_cands} allocations looked at)"
            )
        else:
            reasons = sorted({v for c in judged for v in c.violations})
            reason = "no simulated plan is feasible: " + "; ".join(reasons[:5])
        return empty_result(state, pool, objective, constraints, previous, reason, ub, kept)

    feasible.sort(key=lambda c: -sim_score(objective, c))
    moves = {id(c): moves_of(c) for c in feasible}
    if previous is not None and prefer_less_movement > 0:
        top = sim_score(objective, feasible[0])
        span = abs(top) * prefer_less_movement
        close = [c for c in feasible if sim_score(objective, c) >= top - span]
        rest = [c for c in feasible if sim_score(objective, c) < top - span]
        close.sort(key=lambda c: (moves[id(c)][1], -sim_score(objective, c)))
        feasible = close + rest
    ranked: list[RankedPlan] = []
    for r, c in enumerate(feasible[:top_k]):
        assert c.estimate is not None and c.plan is not None
        mv = moves[id(c)]
        ranked.append(
            RankedPlan(
                rank=r + 1,
                plan=c.plan.model_copy(update={"plan_id": f"sailor-{r + 1}"}),
                estimate=c.estimate,
                cost_per_hour_usd=c.fast.cost_per_hour,
                upper_bound_fraction=c.estimate.throughput_iter_s / ub if ub > 0 else 0.0,
                moved_layers=mv[0],
                moved_layer_replicas=mv[1],
                explain=(*state.left_out, *_explain(c, ub)),
            )
        )
    return SearchResult(
        allocations=tuple(c.alloc for c in feasible[:top_k]),
        plans=tuple(ranked),
        reason="",
        objective=objective,
        constraints=constraints,
        upper_bound_iter_s=ub,
        candidates=tuple(kept),
        stats=replace(stats, simulated=len(judged)),
        state=state,
        pool=pool,
        previous=previous,
        left_out=state.left_out,
    )


def empty_result(
    state: SearchState,
    pool: Pool,
    objective: Objective,
    constraints: Constraints,
    previous: Plan | None,
    reason: str,
    ub: float = 0.0,
    cands: Sequence[Candidate] = (),
) -> SearchResult:
    if state.left_out and "left out" not in reason:
        reason += " (" + "; ".join(state.left_out) + ")"
    return SearchResult(
        plans=(),
        reason=reason,
        objective=objective,
        constraints=constraints,
        upper_bound_iter_s=ub,
        candidates=tuple(cands),
        stats=SearchStats(pruned_memory=state.pruned_memory),
        state=state,
        pool=pool,
        previous=previous,
        left_out=state.left_out,
    )


def explain_candidate(c: Candidate, ub: float) -> tuple[str, ...]:
    """How the search built ``c`` and what the simulator said of it (``--explain``)."""
    return _explain(c, ub)


def _explain(c: Candidate, ub: float) -> tuple[str, ...]:
    # Pipelines grouped by template key, in first-seen order, each group described by its
    # last template. A key is looked up once per template object, not once per pipeline:
    # hashing it (its stage kinds are dataclasses) 700 times was ~2 ms of a 512-node replan.
    group_of: dict[int, int] = {}
    number: dict[tuple[object, ...], int] = {}
    groups: list[list[int]] = []
    temps: list[PipelineTemplate] = []
    for t, m in c.alloc.pipelines:
        g = group_of.get(id(t))
        if g is None:
            g = group_of[id(t)] = number.setdefault(t.key, len(number))
            if g == len(groups):
                groups.append([])
                temps.append(t)
        groups[g].append(m)
        temps[g] = t
    lines = [f"allocation: {c.alloc.how}"]
    for t, ms in zip(temps, groups, strict=True):
        stages = ", ".join(
            f"{s.kind.gpu_type} tp{s.kind.tp}@{s.kind.zone} L{s.first_layer}-{s.last_layer}"
            for s in t.stages
        )
        lines.append(
            f"{len(ms)} x pipeline [{stages}] mbs {t.mbs}, microbatches {min(ms)}-{max(ms)}, "
            f"period {t.period_s * 1e3:.1f} ms, fill {t.fill_s * 1e3:.1f} ms"
        )
    e = c.estimate
    if e is not None:
        tb = e.time
        lines.append(
            f"simulated: {e.iteration_time_s:.3f} s/iter = compute {tb.compute_s:.3f} + p2p "
            f"{tb.p2p_s:.3f} + bubble {tb.bubble_s:.3f} + sync {tb.grad_sync_s:.3f} + update "
            f"{tb.update_s:.3f}; search estimate {c.fast.iteration_s:.3f} s"
        )
        if ub > 0:
            lines.append(f"{e.throughput_iter_s / ub:.1%} of the upper bound {ub:.3f} it/s")
    return tuple(lines)
