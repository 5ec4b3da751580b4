"""Pipelines on one shared host: the processor-sharing replay and simulate_on_shared_host."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sailor.schemas import Calibration, Pipeline, ProfileDB, Stage
from sailor.schemas.profile import HostSharing
from sailor.simulator import simulate
from sailor.simulator.cpu_host import (
    SharedPipe,
    fair_share,
    replay_shared,
    simulate_on_shared_host,
)
from sailor.simulator.pipeline import replay_1f1b
from tests.unit.test_simulator_simulate import (
    MODEL,
    PRICES,
    PROFILES,
    SPECS,
    N,
    _network,
    _pipe,
    _plan,
    _rg,
)


def _host(cores: int, slowdown: tuple[float, ...], wake_s: float) -> HostSharing:
    """A measured host as the profiler stores it."""
    return HostSharing(gpu_type="cpu", cores=cores, slowdown=slowdown, wake_s=wake_s, source="t")


_times = st.lists(st.floats(0.05, 3.0), min_size=1, max_size=5)
_ALONE = _host(cores=64, slowdown=(1.0,) * 16, wake_s=0.0)


@settings(max_examples=150, deadline=None)
@given(_times, st.data(), st.integers(1, 8))
def test_without_sharing_it_is_the_replay_of_each_pipeline(
    f: list[float], data: st.DataObject, m: int
) -> None:
    n = len(f)
    b = data.draw(st.lists(st.floats(0.05, 3.0), min_size=n, max_size=n))
    d = data.draw(st.lists(st.floats(0.0, 1.0), min_size=n - 1, max_size=n - 1))
    want = replay_1f1b(f, b, m, d)
    got = replay_shared([SharedPipe(tuple(f), tuple(b), tuple(d), m, (1,) * n)], _ALONE)[0]
    assert got.end_s == pytest.approx(want.end_s, rel=1e-9)
    assert got.stage_end_s == pytest.approx(want.stage_end_s, rel=1e-9)


@settings(max_examples=100, deadline=None)
@given(_times, st.data(), st.integers(1, 6), st.integers(1, 3))
def test_one_core_shared_fairly_does_all_the_work_back_to_back(
    f: list[float], data: st.DataObject, m: int, pipes: int
) -> None:
    # without link delays some rank can always run, so one fairly shared core never idles:
    # the iteration is the sum of every operation's work
    n = len(f)
    b = data.draw(st.lists(st.floats(0.05, 3.0), min_size=n, max_size=n))
    one_core = _host(cores=1, slowdown=tuple(float(k) for k in range(1, 9)), wake_s=0.0)
    p = SharedPipe(tuple(f), tuple(b), (0.0,) * (n - 1), m, (1,) * n)
    runs = replay_shared([p] * pipes, one_core)
    assert max(r.end_s for r in runs) == pytest.approx(pipes * m * (sum(f) + sum(b)), rel=1e-9)


def test_wake_up_delays_only_an_oversubscribed_host() -> None:
    p = SharedPipe((1.0, 1.0, 1.0), (2.0, 2.0, 2.0), (0.0, 0.0), 4, (1, 1, 1))
    slow = (1.0, 1.0, 1.5, 2.0)
    base = replay_shared([p], _host(cores=2, slowdown=slow, wake_s=0.0))[0].end_s
    woken = replay_shared([p], _host(cores=2, slowdown=slow, wake_s=0.25))[0].end_s
    later = replay_shared([p], _host(cores=2, slowdown=slow, wake_s=0.5))[0].end_s
    assert base < woken < later
    # with a core per rank nobody waits for one
    roomy = replay_shared([p], _host(cores=3, slowdown=(1.0,) * 3, wake_s=0.5))[0].end_s
    assert roomy == pytest.approx(replay_1f1b(p.f, p.b, 4).end_s)


def test_a_receive_posted_after_its_send_waits_for_the_hand_over() -> None:
    # stage 0 sends its forward of mb 1 while stage 1 still runs mb 0 (F 1 + B 4): the
    # receive of mb 1 is posted after the send, so it pays the rendezvous; the receives
    # posted first (mb 0, every backward) pay nothing more
    p = SharedPipe((1.0, 1.0), (1.0, 4.0), (0.0,), 2, (1, 1))
    base = _host(cores=2, slowdown=(1.0, 1.0), wake_s=0.0)
    plain = replay_shared([p], base, record=True)[0]
    hand = replay_shared([p], base.model_copy(update={"rendezvous_s": 0.5}), record=True)[0]
    start = {(o.stage, o.kind, o.microbatch): o.start_s for o in hand.ops}
    before = {(o.stage, o.kind, o.microbatch): o.start_s for o in plain.ops}
    assert start[(1, "F", 1)] == pytest.approx(before[(1, "F", 1)] + 0.5)
    assert start[(1, "F", 0)] == before[(1, "F", 0)]
    assert hand.end_s == pytest.approx(plain.end_s + 0.5)
    # the busy-host figure applies only while `cores` ranks compute: never on 2 free cores
    busy = base.model_copy(update={"rendezvous_busy_s": 9.0})
    assert replay_shared([p], busy)[0].end_s == pytest.approx(plain.end_s)
    # while another pipeline keeps the one core busy, it applies
    burner = SharedPipe((50.0,), (50.0,), (), 1, (1,))
    one_core = _host(cores=1, slowdown=(1.0, 2.0, 3.0), wake_s=0.0)
    runs = [
        replay_shared([p, burner], h, record=True)[0]
        for h in (one_core.model_copy(update={"rendezvous_busy_s": 0.5}), one_core)
    ]
    f1 = [
        next(o.start_s for o in r.ops if (o.stage, o.kind, o.microbatch) == (1, "F", 1))
        for r in runs
    ]
    assert f1[0] == pytest.approx(f1[1] + 0.5)


def test_bound_ranks_share_only_their_own_core() -> None:
    # three one-stage pipelines on 2 cores: ranks 0 and 2 are bound to core 0, rank 1 to
    # core 1. A host whose factor is only the fair share (their mean per-core share, 5/3)
    # leaves rank 1 at full speed and halves ranks 0 and 2; unbound, the three run alike
    p = SharedPipe((1.0,), (1.0,), (), 3, (1,))
    fair = _host(cores=2, slowdown=(1.0, 1.0, 5 / 3), wake_s=0.0)
    bound = [r.end_s for r in replay_shared([p] * 3, fair.model_copy(update={"pinned": True}))]
    assert bound == pytest.approx([12.0, 6.0, 12.0])
    free = [r.end_s for r in replay_shared([p] * 3, fair)]
    assert free == pytest.approx([10.0] * 3)  # all three at 3/5 of their speed throughout
    # what the measurement leaves beyond the fair share slows every bound rank alike: three
    # ranks bound share cores 2, 1, 2 (mean 5/3), so a factor of 2.5 leaves 1.5. Rank 1 ends
    # at 6 * 1.5; ranks 0 and 2 have done 9 / 3 = 3 of their 6 by then and finish the rest
    # two to a core, where the fair share (2/1, two ranks on two cores) leaves nothing more
    heavy = fair.model_copy(update={"pinned": True, "slowdown": (1.0, 1.0, 2.5)})
    assert [r.end_s for r in replay_shared([p] * 3, heavy)] == pytest.approx([15.0, 9.0, 15.0])
    assert fair_share(3, 2) == pytest.approx(5 / 3) and fair_share(4, 2) == 2.0
    assert fair_share(2, 2) == 1.0 and fair_share(5, 1) == 5.0


def test_bound_ranks_wait_for_a_wake_up_only_on_a_busy_core_of_their_own() -> None:
    # a 2-stage pipeline bound to cores 0 and 1 plus a one-stage pipeline on core 0: stage 1
    # (core 1) never shares its core, so each of its forwards starts as soon as the
    # activation is in and it is free; unbound, with both cores busy, it waits to be woken
    p = SharedPipe((1.0, 1.0), (1.0, 1.0), (0.0,), 4, (1, 1))
    other = SharedPipe((30.0,), (30.0,), (), 1, (1,))
    h = _host(cores=2, slowdown=(1.0, 1.0, 1.5), wake_s=0.5)

    def late_starts(host: HostSharing) -> list[float]:
        ops = replay_shared([p, other], host, record=True)[0].ops
        end = {(o.stage, o.kind, o.microbatch): o.end_s for o in ops}
        mine = sorted((o for o in ops if o.stage == 1), key=lambda o: o.start_s)
        return [
            o.start_s - max(end[(0, "F", o.microbatch)], prev.end_s)
            for prev, o in itertools.pairwise(mine)
            if o.kind == "F"
        ]

    assert late_starts(h.model_copy(update={"pinned": True})) == pytest.approx([0.0] * 3)
    assert max(late_starts(h)) == pytest.approx(0.5)


def test_a_tp_stage_counts_as_its_ranks() -> None:
    host = _host(cores=1, slowdown=(1.0, 2.0), wake_s=0.0)
    one = replay_shared([SharedPipe((1.0,), (1.0,), (), 3, (1,))], host)[0].end_s
    two = replay_shared([SharedPipe((1.0,), (1.0,), (), 3, (2,))], host)[0].end_s
    assert two == pytest.approx(2 * one)


def test_factor_past_the_measured_range_is_a_fair_share() -> None:
    h = _host(cores=2, slowdown=(1.0, 1.1, 1.6, 2.2), wake_s=0.0)
    assert h.factor(0) == 1.0 and h.factor(3) == 1.6
    assert h.factor(8) == pytest.approx(2.2 * 8 / 4)


@pytest.mark.parametrize(
    ("kw", "word"),
    [
        ({"cores": 0, "slowdown": (1.0,), "wake_s": 0.0}, "cores"),
        ({"cores": 1, "slowdown": (), "wake_s": 0.0}, "slowdown"),
        ({"cores": 1, "slowdown": (1.0, -1.0), "wake_s": 0.0}, "slowdown"),
        ({"cores": 1, "slowdown": (1.0,), "wake_s": -1.0}, "wake_s"),
        ({"cores": 1, "slowdown": (1.0,), "wake_s": 0.0, "rendezvous_s": -1.0}, "rendezvous_s"),
    ],
)
def test_bad_host_models_are_refused(kw: dict[str, object], word: str) -> None:
    with pytest.raises(ValueError, match=word):
        HostSharing(gpu_type="cpu", source="t", **kw)  # type: ignore[arg-type]


def test_bad_pipelines_are_refused() -> None:
    with pytest.raises(ValueError, match="delays"):
        replay_shared([SharedPipe((1.0, 1.0), (1.0, 1.0), (), 2, (1, 1))], _ALONE)
    with pytest.raises(ValueError, match="m=0"):
        replay_shared([SharedPipe((1.0,), (1.0,), (), 0, (1,))], _ALONE)


def _db(slowdown: tuple[float, ...], wake_s: float) -> ProfileDB:
    host = HostSharing(gpu_type="A", cores=2, slowdown=slowdown, wake_s=wake_s, source="test")
    return PROFILES.model_copy(update={"hosts": (host,)})


def test_simulate_on_a_shared_host() -> None:
    plan = _plan(_pipe([2, 4, 6], 2, 6), _pipe([2, 4, 6], 2, 6))  # 8 ranks
    kw = {"gpu_specs": SPECS, "method": "replay"}
    alone = simulate(plan, MODEL, PROFILES, _network(), PRICES, **kw)  # type: ignore[arg-type]
    # no HostSharing entry: each rank keeps its own device, and a note says so
    none = simulate_on_shared_host(plan, MODEL, PROFILES, _network(), PRICES, **kw)  # type: ignore[arg-type]
    assert none.iteration_time_s == alone.iteration_time_s
    assert any("no host-sharing profile" in n for n in none.notes)
    # a host on which sharing costs nothing gives the ordinary replay
    free = _db((1.0,) * 8, 0.0)
    same = simulate_on_shared_host(plan, MODEL, free, _network(), PRICES, **kw)  # type: ignore[arg-type]
    assert same.iteration_time_s == pytest.approx(alone.iteration_time_s, rel=1e-9)
    # 8 ranks on 2 cores: slower than 8 devices, not slower than one core doing it all
    shared = _db((1.0, 1.0, 1.5, 2.0), 1e-4)
    est = simulate_on_shared_host(plan, MODEL, shared, _network(), PRICES, **kw)  # type: ignore[arg-type]
    assert est.iteration_time_s > 1.5 * alone.iteration_time_s
    assert any("share one host of 2 cores" in n for n in est.notes)
    # through simulate the entry is ignored (GPUs own their devices)
    assert simulate(plan, MODEL, shared, _network(), PRICES, **kw).iteration_time_s == (  # type: ignore[arg-type]
        alone.iteration_time_s
    )


def test_host_sharing_schema_checks_and_merge() -> None:
    with pytest.raises(ValueError, match="slowdown"):
        HostSharing(gpu_type="cpu", cores=2, slowdown=(1.0, 0.0), wake_s=0.0, source="t")
    with pytest.raises(ValueError, match="cores"):
        HostSharing(gpu_type="cpu", cores=0, slowdown=(1.0,), wake_s=0.0, source="t")
    h = HostSharing(gpu_type="cpu", cores=2, slowdown=(1.0,), wake_s=0.0, source="t")
    with pytest.raises(ValueError, match="hosts"):
        ProfileDB(model="m", hosts=(h, h))
    newer = h.model_copy(update={"wake_s": 1e-3})
    merged = ProfileDB(model="m", hosts=(h,)).merged(ProfileDB(model="m", hosts=(newer,)))
    assert merged.host_sharing("cpu") == newer and merged.host_sharing("gpu") is None


def test_a_collective_entered_after_computing_pays_the_wake_up_once() -> None:
    kw = {"gpu_specs": SPECS, "method": "replay"}
    base = _db((1.0,) * 8, 0.0)
    cold = base.model_copy(
        update={"hosts": (base.hosts[0].model_copy(update={"collective_wake_s": 0.25}),)}
    )

    def gap(plan: object, cal: Calibration) -> float:
        a = simulate_on_shared_host(plan, MODEL, base, _network(), PRICES, calibration=cal, **kw)  # type: ignore[arg-type]
        b = simulate_on_shared_host(plan, MODEL, cold, _network(), PRICES, calibration=cal, **kw)  # type: ignore[arg-type]
        return b.iteration_time_s - a.iteration_time_s

    two = _plan(_pipe([2, 4, 6], 2, 6), _pipe([2, 4, 6], 2, 6))
    # the gradient all-reduces: only the first is entered after computing
    assert gap(two, Calibration()) == pytest.approx(0.25)
    # the loss all-reduce follows the optimizer step: once more
    assert gap(two, Calibration(loss_allreduce=True)) == pytest.approx(0.5)
    # one rank: no collective at all
    whole = Stage(first_layer=0, last_layer=N - 1, replica=_rg())
    one = _plan(Pipeline(stages=(whole,), microbatch_size=2, num_microbatches=6))
    assert gap(one, Calibration(loss_allreduce=True)) == 0.0


def test_all_reduces_take_the_measured_time_of_what_their_ranks_did_just_before() -> None:
    kw = {"gpu_specs": SPECS, "method": "replay"}
    base = _db((1.0,) * 8, 0.0)

    def with_entries(compute: float, chained: float, update: float, probe_bytes: int) -> object:
        host = base.hosts[0].model_copy(
            update={
                "allreduce_after_compute_s": (compute, compute),
                "allreduce_after_allreduce_s": (chained, chained),
                "allreduce_after_update_s": (update, update),
                "allreduce_probe_bytes": probe_bytes,
            }
        )
        return base.model_copy(update={"hosts": (host,)})

    tied = MODEL.model_copy(update={"tie_embeddings": True})

    def it(db: object, plan: object, cal: Calibration) -> float:
        return simulate_on_shared_host(
            plan, tied, db, _network(), PRICES, calibration=cal, **kw
        ).iteration_time_s  # type: ignore[arg-type]

    two = _plan(_pipe([2, 4, 6], 2, 6), _pipe([2, 4, 6], 2, 6))
    cal = Calibration(loss_allreduce=True, tied_allreduce=True)
    # probing as many bytes as the largest all-reduce moves: the measured times replace the
    # ring's. Each stage's gradients are all-reduced with its twin in the other pipeline
    # (entered after computing), then the first and last stages all-reduce the tied
    # embedding (entered after that all-reduce), then the loss all-reduce after the update
    huge = 1 << 40
    small = it(with_entries(0.1, 0.01, 0.001, huge), two, cal)
    large = it(with_entries(0.2, 0.01, 0.001, huge), two, cal)
    assert large - small == pytest.approx(0.1)
    more = it(with_entries(0.1, 0.02, 0.001, huge), two, cal)
    assert more - small == pytest.approx(0.01)  # the tied embedding's all-reduce
    last = it(with_entries(0.1, 0.01, 0.003, huge), two, cal)
    assert last - small == pytest.approx(0.002)
    # a probe of fewer bytes leaves the ring's bandwidth time for the rest: slower
    assert it(with_entries(0.1, 0.01, 0.001, 1), two, cal) > small
    # the loss all-reduce alone with one rank: nothing
    whole = Stage(first_layer=0, last_layer=N - 1, replica=_rg())
    one = _plan(Pipeline(stages=(whole,), microbatch_size=2, num_microbatches=6))
    assert it(with_entries(0.1, 0.01, 0.5, huge), one, cal) == it(base, one, cal)


def test_host_sharing_entry_times_need_one_value_per_rank_count() -> None:
    h = _host(cores=2, slowdown=(1.0, 1.0), wake_s=0.0)
    with pytest.raises(ValueError, match="allreduce_after_update_s"):
        h.model_validate(
            {
                **h.model_dump(),
                "allreduce_after_compute_s": (1e-3, 2e-3),
                "allreduce_after_allreduce_s": (1e-3, 2e-3),
                "allreduce_after_update_s": (1e-3,),
            }
        )
    with pytest.raises(ValueError, match="allreduce_after_compute_s"):
        h.model_validate(
            {
                **h.model_dump(),
                "allreduce_after_compute_s": (-1e-3,),
                "allreduce_after_allreduce_s": (1e-3,),
                "allreduce_after_update_s": (1e-3,),
            }
        )
