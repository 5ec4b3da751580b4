"""GPU memory of NCCL communicators, counted per communicator (sailor.simulator.communicators).

The engine's count comes from the layout its group builder creates groups from: checked here
against ``build_process_groups`` on real gloo ranks. A rank's memory grows with its count,
the interval widens with the range of bytes per communicator, and a plan that fitted while
the term was missing no longer does, with the term in its breakdown.
"""

from __future__ import annotations

import importlib
import json
import statistics
from pathlib import Path

import pytest

from sailor.schemas import Calibration, ConstantRange, GPUCalibration
from sailor.schemas.plan import Pipeline, Plan, ReplicaGroup, Stage
from sailor.simulator.communicators import megatron_deepspeed_communicators, stage_communicators
from sailor.simulator.memory import stage_memory
from sailor.simulator.process_groups import engine_communicators, engine_group_ranks
from sailor.simulator.uncertainty import corners, simulate_interval
from tests.unit.test_simulator_simulate import MODEL, PRICES, PROFILES, SPECS, _network, _sim

GB = 1_000_000_000


def _stage(a: int, b: int, tp: int = 1, gpu: str = "A") -> Stage:
    return Stage(
        first_layer=a,
        last_layer=b,
        replica=ReplicaGroup(gpu_type=gpu, zone="z-a", tp=tp, gpus_per_node=4),
    )


def _plan(*pipes: list[Stage], layers: int = 6, model: str = "tiny-gpt") -> Plan:
    pipelines = tuple(
        Pipeline(stages=tuple(p), microbatch_size=1, num_microbatches=2) for p in pipes
    )
    return Plan(
        model=model, global_batch_size=sum(p.samples for p in pipelines), pipelines=pipelines
    )


# 4 ranks: pipeline 0 is one TP-2 stage (ranks 0, 1); pipeline 1 two TP-1 stages (ranks 2, 3).
# Two layer segments held at mixed TP: chunk and replicated groups per segment, tied groups.
MIXED = _plan([_stage(0, 5, tp=2)], [_stage(0, 2), _stage(3, 5)])


def test_engine_count_per_rank_homogeneous_tp_and_heterogeneous() -> None:
    dp = _plan([_stage(0, 5)], [_stage(0, 5)])
    assert engine_communicators(dp, tie_embeddings=True) == (2, 2)  # world + data-parallel
    tp = _plan([_stage(0, 5, tp=4)])
    assert engine_communicators(tp, tie_embeddings=True) == (2, 2, 2, 2)  # world + TP
    dptp = _plan([_stage(0, 5, tp=2)], [_stage(0, 5, tp=2)])
    assert engine_communicators(dptp, tie_embeddings=True) == (3, 3, 3, 3)  # + chunk group
    # rank 0: world, its TP group, per segment a chunk group and a replicated group, one
    # tied group: 7; rank 2 (first segment only): world, two chunk groups, the replicated
    # group, two tied groups: 6
    assert engine_communicators(MIXED, tie_embeddings=True) == (7, 7, 6, 6)
    assert engine_communicators(MIXED, tie_embeddings=False) == (6, 6, 4, 4)
    assert stage_communicators(MIXED, "engine", tie_embeddings=True) == ((7,), (6, 6))
    # more segments, more groups: a rank holding more of them holds more communicators
    three = _plan([_stage(0, 1), _stage(2, 5)], [_stage(0, 3), _stage(4, 5)])
    assert engine_communicators(three, tie_embeddings=False) == (2, 3, 3, 2)


def test_megatron_deepspeed_count() -> None:
    # world, TP, model-parallel; + data-parallel
    assert megatron_deepspeed_communicators(0, 1, 4, 1, True) == 3
    assert megatron_deepspeed_communicators(0, 1, 4, 2, True) == 4
    # + pipeline group, one neighbour, tied group; a middle stage: two neighbours, no tie
    assert megatron_deepspeed_communicators(0, 4, 4, 2, True) == 7
    assert megatron_deepspeed_communicators(1, 4, 4, 2, True) == 7
    with pytest.raises(ValueError, match="stage=4, depth=4"):
        megatron_deepspeed_communicators(4, 4, 4, 1, True)


def _groups_worker(rank: int, store: str, out: str, tie: bool) -> None:
    import torch.distributed as dist

    from sailor.megatron_patch.groups import build_process_groups
    from sailor.megatron_patch.roles import role_of

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=4)
    groups = build_process_groups(MIXED, role_of(MIXED, rank), tie, 60.0)
    # torch registers a group on its members only: the world group and each one created
    mine = len(dist.distributed_c10d._world.pg_map)
    Path(out, f"{rank}.json").write_text(json.dumps([mine, groups.num_groups_created]))
    dist.destroy_process_group()


@pytest.mark.parametrize("tie", [True, False])
def test_engine_count_is_what_the_group_builder_creates(tmp_path: Path, tie: bool) -> None:
    from tests.spawn import spawn

    spawn(_groups_worker, args=(str(tmp_path / "store"), str(tmp_path), tie), nprocs=4)
    got = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(4)]
    assert [g[0] for g in got] == list(engine_communicators(MIXED, tie))
    assert {g[1] for g in got} == {len(engine_group_ranks(MIXED, tie))}


def test_memory_grows_with_the_count() -> None:
    from sailor.schemas import LayerSize

    size = LayerSize(
        layer=1, tp=1, params=1000, activation_bytes_per_sample=100, output_bytes_per_sample=10
    )
    kw = {
        "model": MODEL,
        "sizes": [size],
        "microbatch_size": 1,
        "in_flight": 1,
        "recompute": False,
        "alloc_factor": 1.0,
        "overhead_bytes": 0,
        "capacity_bytes": 0,
        "pipeline": 0,
        "stage": 0,
        "gpu_type": "A",
        "communicator_bytes": 600_000_000,
    }
    two, five = (stage_memory(communicators=n, **kw) for n in (2, 5))  # type: ignore[arg-type]
    assert (two.num_communicators, two.communicators) == (2, 1_200_000_000)
    assert five.total - two.total == 3 * 600_000_000 == five.communicators - two.communicators
    with pytest.raises(ValueError, match="communicators=-1"):
        stage_memory(communicators=-1, **kw)  # type: ignore[arg-type]
    # a non-tensor overhead measured on ranks holding up to 3 communicators holds theirs:
    # only those beyond are priced
    covered = {n: stage_memory(communicators=n, communicators_covered=3, **kw) for n in (2, 3, 5)}  # type: ignore[arg-type]
    assert covered[2].communicators == covered[3].communicators == 0
    assert covered[2].total == covered[3].total
    assert covered[5].communicators == 2 * 600_000_000 and covered[5].num_communicators == 5


def test_a_fit_prices_communicators_only_where_the_runs_show_a_cost() -> None:
    """GH200's 15 runs hold 3-7 communicators and their memory residuals fall with the
    count: M0 is their median residual and holds up to 7; a rank holding more pays the
    base's bytes for each one beyond. Residuals that grow give the slope, and M0 holds none."""
    from sailor.simulator.calibrate import _communicators_and_m0

    flat = [(4_000_000_000 - 100_000_000 * n, n) for n in (3, 4, 5, 7)]
    comm, covered, m0, why = _communicators_and_m0(flat, 600_000_000)
    assert (comm, covered) == (600_000_000, 7) and "do not grow" in why
    assert m0 == int(statistics.median(r for r, _ in flat))  # nothing subtracted
    growing = [(1_000_000_000 + 500_000_000 * n, n) for n in (2, 3, 4, 6)]
    comm, covered, m0, _ = _communicators_and_m0(growing, 600_000_000)
    assert covered == 0 and comm == pytest.approx(500_000_000, rel=1e-6)
    assert m0 == pytest.approx(1_000_000_000, rel=1e-6)
    # a slope within its spread is not a cost: +5 MB per communicator over residuals that
    # scatter by hundreds of MB leaves M0 holding them (a slope of +1 MB priced every
    # communicator at 1 MB, one of -1 MB at the base's 616 MB beyond the runs)
    noisy = [(3_000_000_000 + 5_000_000 * n + (-1) ** n * 300_000_000, n) for n in range(3, 9)]
    comm, covered, _, why = _communicators_and_m0(noisy, 600_000_000)
    assert (comm, covered) == (600_000_000, 8) and "standard error" in why
    one = [(3_000_000_000, 4), (3_200_000_000, 4)]
    assert _communicators_and_m0(one, 600_000_000)[:3] == (600_000_000, 4, 3_100_000_000)


def _cal(median: int, high: int, covered: int = 0) -> Calibration:
    """The catalog prior with ``communicator_bytes`` at (0, median, high) for every
    communicator beyond ``covered`` (the catalog's own prior: beyond 7)."""
    from sailor.catalog import calibration

    prior = calibration().prior
    assert prior is not None
    comm = ConstantRange(low=0, median=median, high=high)
    return Calibration(
        default=GPUCalibration(gpu_type="*", communicator_bytes=median),
        prior=prior.model_copy(
            update={"communicator_bytes": comm, "communicators_covered": covered}
        ),
    )


def test_simulate_shows_the_term_and_the_interval_widens() -> None:
    from tests.unit.test_simulator_simulate import _pipe
    from tests.unit.test_simulator_simulate import _plan as sim_plan

    plan = sim_plan(_pipe([2, 5], 1, 4), _pipe([2, 5], 1, 4))
    est = _sim(
        plan, calibration=Calibration(default=GPUCalibration(gpu_type="*", communicator_bytes=GB))
    )
    row = est.memory[0]  # type: ignore[attr-defined]
    # world, the stage's sync group and the tied embedding's group
    assert row.num_communicators == 3 and row.communicators == 3 * GB
    assert row.total >= row.communicators + row.overhead
    narrow = simulate_interval(
        plan, MODEL, PROFILES, _network(), PRICES, calibration=_cal(GB, GB), gpu_specs=SPECS
    )[1]
    wide = simulate_interval(
        plan, MODEL, PROFILES, _network(), PRICES, calibration=_cal(GB, 2 * GB), gpu_specs=SPECS
    )[1]
    assert wide.peak_memory_bytes.high - narrow.peak_memory_bytes.high == 3 * GB
    assert wide.peak_memory_bytes.median == narrow.peak_memory_bytes.median
    # under the catalog's prior, whose overhead range holds up to 7 communicators (the
    # GH200 runs'), a rank holding 3 pays nothing apart in any corner
    held = simulate_interval(
        plan,
        MODEL,
        PROFILES,
        _network(),
        PRICES,
        calibration=_cal(GB, 2 * GB, covered=7),
        gpu_specs=SPECS,
    )[1]
    assert held.peak_memory_bytes.high < narrow.peak_memory_bytes.high - 2 * GB
    # the original corner has no such term
    original = dict(corners(_cal(GB, 2 * GB)))["original"]
    assert original.default.communicator_bytes == 0


def test_a_plan_that_fitted_without_the_term_does_not_with_it() -> None:
    from tests.unit.test_simulator_simulate import _pipe
    from tests.unit.test_simulator_simulate import _plan as sim_plan

    plan = sim_plan(_pipe([2, 5], 1, 4), _pipe([2, 5], 1, 4))
    base = simulate_interval(
        plan, MODEL, PROFILES, _network(), PRICES, calibration=_cal(0, 0), gpu_specs=SPECS
    )[1]
    assert base.fits_in_memory  # 16 GB GPUs, a tiny model
    capacity = 16 << 30
    # the prior's high end for each of the rank's three communicators tips it over
    before = next(c for c in base.corners if c.corner == "pessimistic").peak_memory_bytes
    high = (capacity - before) // 3 + 100_000_000
    _, iv = simulate_interval(
        plan, MODEL, PROFILES, _network(), PRICES, calibration=_cal(0, high), gpu_specs=SPECS
    )
    assert not iv.fits_in_memory
    pessimistic = next(c for c in iv.corners if c.corner == "pessimistic")
    assert not pessimistic.fits_in_memory and pessimistic.peak_memory_bytes > capacity


def test_a_plan_simulated_in_every_corner_counts_its_communicators_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The communicators depend on the plan's layout and the process groups only: a plan
    simulated in the four corners counts them once (the robust planner's case), another
    plan object or other process groups count again, and the figures are those of a count
    made afresh."""
    from tests.unit.test_simulator_simulate import _pipe
    from tests.unit.test_simulator_simulate import _plan as sim_plan

    sim_mod = importlib.import_module("sailor.simulator.simulate")  # the module, not simulate()
    calls: list[str] = []

    def counted(plan: Plan, groups: str, tie: bool) -> tuple[tuple[int, ...], ...]:
        calls.append(groups)
        return stage_communicators(plan, groups, tie)  # type: ignore[arg-type]

    monkeypatch.setattr(sim_mod, "stage_communicators", counted)
    plan = sim_plan(_pipe([2, 5], 1, 4), _pipe([3], 2, 4))
    cal = _cal(GB, 2 * GB)
    ests = [_sim(plan, calibration=c) for _, c in corners(cal)]
    assert calls == ["engine"]
    other = plan.model_copy()
    _sim(other, calibration=cal)
    md = cal.model_copy(update={"process_groups": "megatron_deepspeed"})
    _sim(plan, calibration=md)
    assert calls == ["engine", "engine", "megatron_deepspeed"]
    sim_mod._COMMUNICATORS.clear()
    fresh = [_sim(plan, calibration=c) for _, c in corners(cal)]
    assert fresh == ests and len(calls) == 4
