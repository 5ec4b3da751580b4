"""``sailor profile layers`` works in (TP, mbs) units: each is saved as it finishes, one that
runs out of GPU memory is skipped with its cause, and each unit's model is freed before the
next is built. The measurements are stubbed where a failure is injected (an OOM is a GPU's,
raised here on the CPU); the freeing is checked on the real in-place measurement."""

from __future__ import annotations

import gc
import itertools
import json
import sys
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from sailor import catalog
from sailor.cli.main import app
from sailor.profiler import layers, tp_procs
from sailor.profiler.layer_measurement import LayerMeasurement
from sailor.profiler.layers import LayerRun, profile_layers
from sailor.profiler.merge import merge_db, save_db
from sailor.profiler.procs import RankFailedError
from sailor.profiler.timing import RepeatSettings, Stats
from sailor.schemas import LayerProfile, ProfileDB

TINY = catalog.model("tiny-gpt")
FAST = RepeatSettings(warmup=1, min_reps=1, max_reps=1, min_time_s=0.0)
_OOM_STDERR = (
    "Traceback (most recent call last):\n  ...\ntorch.OutOfMemoryError: CUDA out of memory. "
    "Tried to allocate 2.00 GiB. GPU 1 has a total capacity of 79.10 GiB\n"
)


def _fake(tp: int, mbs: int) -> list[LayerMeasurement]:
    """Every layer of tiny-gpt at (tp, mbs), with figures that depend on both."""
    st = Stats.of([1e-3 * mbs / tp])
    return [
        LayerMeasurement(
            kind=TINY.layer_kind(i),
            tp=tp,
            mbs=mbs,
            fwd=st,
            bwd=st,
            update=st,
            params=1000 // tp,
            saved_bytes=100 * mbs,
            output_bytes=10 * mbs,
            input_bytes=10 * mbs,
            peak_growth_bytes=0,
            layer=i,
        )
        for i in range(TINY.num_all_layers)
    ]


class _Stubbed:
    """``measure_kinds`` (TP 1) and ``measure_tp`` (TP > 1) replaced by :func:`_fake`; a unit
    in ``oom`` runs out of GPU memory, one in ``boom`` fails otherwise."""

    def __init__(
        self,
        monkeypatch: pytest.MonkeyPatch,
        oom: frozenset[tuple[int, int]] = frozenset(),
        boom: frozenset[tuple[int, int]] = frozenset(),
    ) -> None:
        self.oom, self.boom = oom, boom
        monkeypatch.setattr(layers, "measure_kinds", self._tp1)
        monkeypatch.setattr(tp_procs, "measure_tp", self._tp)

    def _check(self, tp: int, mbs: int) -> None:
        if (tp, mbs) in self.boom:
            raise RuntimeError(f"tp={tp} mbs={mbs}: boom")
        if (tp, mbs) in self.oom and tp == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        if (tp, mbs) in self.oom:
            raise RankFailedError("sailor.profiler.tp_procs", 1, "exit 1", _OOM_STDERR)

    def _tp1(self, spec: Any, mbs: int, *args: Any, **kw: Any) -> list[LayerMeasurement]:
        self._check(1, mbs)
        return _fake(1, mbs)

    def _tp(self, spec: Any, tp: int, mbs_list: list[int], *a: Any, **kw: Any) -> Any:
        out: list[LayerMeasurement] = []
        for mbs in mbs_list:  # one launch measures every mbs it is given, as the ranks do
            self._check(tp, mbs)
            out.extend(_fake(tp, mbs))
        return out


def _run(**kw: Any) -> LayerRun:
    base: dict[str, Any] = {
        "spec": TINY,
        "gpu_type": "cpu",
        "tps": (1, 2),
        "mbs": (1, 2, 4),
        "settings": FAST,
        "measure_memory": False,
        "measure_overhead": False,
    }
    return LayerRun(**{**base, **kw})


def _units(db: ProfileDB) -> set[tuple[int, int]]:
    return {(t.tp, t.microbatch_size) for t in db.timings}


def test_a_unit_out_of_gpu_memory_is_skipped_and_the_rest_measured(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An OOM at TP 1 (in this process) and in a TP 2 rank: those units are skipped with their
    cause; every other unit, TP 2 at the smaller microbatches included, is in the database,
    and the caller got the database after each unit."""
    _Stubbed(monkeypatch, oom=frozenset({(1, 2), (2, 4)}))
    seen: list[set[tuple[int, int]]] = []
    db, ms = profile_layers(_run(), on_unit=lambda d: seen.append(_units(d)))
    assert _units(db) == {(1, 1), (1, 4), (2, 1), (2, 2)}
    assert {(m.tp, m.mbs) for m in ms} == _units(db)
    skipped = json.loads(db.meta["cpu.skipped"])
    assert set(skipped) == {"tp1.mbs2", "tp2.mbs4"}
    assert skipped["tp1.mbs2"].startswith("OutOfMemoryError: CUDA out of memory")
    assert skipped["tp2.mbs4"].startswith("rank 1: torch.OutOfMemoryError: CUDA out of memory")
    assert len(seen) == 6  # one database per unit, growing
    assert seen[0] == {(1, 1)} and seen[-1] == _units(db)
    assert all(a <= b for a, b in itertools.pairwise(seen))
    # sizes come from the microbatches measured
    assert db.size(1, 1) is not None and db.size(2, 1) is not None


def test_another_failure_is_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    _Stubbed(monkeypatch, boom=frozenset({(1, 4)}))
    with pytest.raises(RuntimeError, match="boom"):
        profile_layers(_run(tps=(1,)))


def test_the_callers_thread_count_is_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU run measures on ``run.threads``; its caller (a notebook, the CLI's later work,
    a test process) keeps its own count afterwards, on success and on an error."""
    import torch

    before = torch.get_num_threads()
    other = 2 if before != 2 else 3
    try:
        torch.set_num_threads(other)
        _Stubbed(monkeypatch)
        profile_layers(_run(tps=(1,), mbs=(1,), threads=1))
        assert torch.get_num_threads() == other
        _Stubbed(monkeypatch, boom=frozenset({(1, 1)}))
        with pytest.raises(RuntimeError, match="boom"):
            profile_layers(_run(tps=(1,), mbs=(1,), threads=1))
        assert torch.get_num_threads() == other
    finally:
        torch.set_num_threads(before)


@pytest.fixture
def original(tmp_path: Path) -> Path:
    """A database file with another GPU's (imported) profile in it, for the run to merge into."""
    out = tmp_path / "db.json"
    kept = LayerProfile(
        gpu_type="T4",
        tp=1,
        microbatch_size=1,
        layer=0,
        kind="embedding",
        fwd_s=1.0,
        bwd_s=1.0,
        update_s=1.0,
        source="imported",
    )
    save_db(ProfileDB(model=TINY.name, timings=(kept,), meta={"T4.device": "x"}), out)
    return out


_CLI = ["profile", "layers", "--mbs", "1,2,4", "--no-memory", "--no-overhead"]


def test_cli_failure_keeps_the_finished_units(
    monkeypatch: pytest.MonkeyPatch, original: Path
) -> None:
    """A failure at the last unit: the units before it are already merged into the output
    (with what the file held), and the error says so."""
    _Stubbed(monkeypatch, boom=frozenset({(1, 4)}))
    res = CliRunner().invoke(app, [*_CLI, "-o", str(original)])
    assert res.exit_code == 2
    assert "boom" in res.output and "the 2 (TP, mbs) unit(s) before it are merged" in res.output
    db = ProfileDB.model_validate_json(original.read_text())
    assert _units(db) == {(1, 1), (1, 2)}
    assert {t.gpu_type for t in db.timings} == {"T4", "cpu"}


def test_cli_without_failures_writes_what_it_always_wrote(
    monkeypatch: pytest.MonkeyPatch, original: Path
) -> None:
    """Saving after each unit changes nothing in the end: the file is the run's database
    merged into the file as it was (the old CLI's one save), and no unit is listed skipped."""
    _Stubbed(monkeypatch)
    before = ProfileDB.model_validate_json(original.read_text())
    from sailor.cli import profile_layers_cmd

    saves: list[int] = []

    def counting(db: ProfileDB, path: Path) -> None:
        saves.append(len(db.timings))
        save_db(db, path)

    monkeypatch.setattr(profile_layers_cmd, "save_db", counting)
    res = CliRunner().invoke(app, [*_CLI, "-o", str(original)])
    assert res.exit_code == 0, res.output
    n = TINY.num_all_layers
    assert saves == [1 + n, 1 + 2 * n, 1 + 3 * n, 1 + 3 * n]  # each unit, then the end
    got = ProfileDB.model_validate_json(original.read_text())
    cli_run = _run(tps=(1,), settings=RepeatSettings())  # the CLI's defaults
    want, _ = merge_db(before, profile_layers(cli_run)[0])

    def undated(db: ProfileDB) -> dict[str, Any]:
        d = db.model_dump()
        d["meta"] = {k: v for k, v in d["meta"].items() if not k.endswith(".date")}
        return d

    assert undated(got) == undated(want)
    assert "cpu.skipped" not in got.meta


def test_merge_lists_a_skipped_unit_until_a_run_measures_it() -> None:
    """``<gpu>.skipped`` is not a plain meta value: a later run that measures a unit takes it
    off the list (the list goes once empty); units still unmeasured stay listed."""
    from sailor.profiler.layers import to_profile_db

    def db(units: list[tuple[int, int]], skipped: dict[str, str]) -> ProfileDB:
        ms = [m for tp, mbs in units for m in _fake(tp, mbs)]
        meta = {"cpu.skipped": json.dumps(skipped)} if skipped else {}
        return to_profile_db(TINY, "cpu", ms, meta)

    first = db([(1, 1)], {"tp1.mbs4": "OOM a", "tp1.mbs8": "OOM b"})
    second, _ = merge_db(first, db([(1, 4)], {}))
    assert json.loads(second.meta["cpu.skipped"]) == {"tp1.mbs8": "OOM b"}
    third, _ = merge_db(second, db([(1, 2)], {"tp1.mbs16": "OOM c"}))
    assert json.loads(third.meta["cpu.skipped"]) == {"tp1.mbs8": "OOM b", "tp1.mbs16": "OOM c"}
    fourth, _ = merge_db(third, db([(1, 8), (1, 16)], {}))
    assert "cpu.skipped" not in fourth.meta
    assert _units(fourth) == {(1, 1), (1, 2), (1, 4), (1, 8), (1, 16)}


@pytest.fixture
def no_automatic_gc() -> Iterator[None]:
    """Only explicit collections run: what a long run may see between two of the
    collector's full passes."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.mark.usefixtures("no_automatic_gc")
def test_a_units_model_is_freed_before_the_next_is_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first optimizer a process builds imports ``torch._dynamo``, and a frame that import
    keeps (in a reference cycle) pins its caller: ``in_situ.measure_model`` with the unit's
    whole model. Emulated here: the first optimizer built pins its caller's frame in a cycle.
    No unit's model may still be alive when the next unit builds its own."""
    from sailor.megatron_patch import engine
    from sailor.megatron_patch.model import GPTStage
    from sailor.profiler import in_situ

    real = engine.make_optimizer
    first = [True]

    def lazily_importing(*args: Any, **kw: Any) -> Any:
        if first[0]:
            first[0] = False
            cycle: list[Any] = [sys._getframe(1)]
            cycle.append(cycle)
        return real(*args, **kw)

    monkeypatch.setattr(engine, "make_optimizer", lazily_importing)
    monkeypatch.setattr(in_situ, "make_optimizer", lazily_importing)
    built: list[weakref.ref[GPTStage]] = []
    alive_at_build: list[int] = []

    class Recording(GPTStage):
        def __init__(self, *args: Any, **kw: Any) -> None:
            alive_at_build.append(sum(r() is not None for r in built))
            super().__init__(*args, **kw)
            built.append(weakref.ref(self))

    monkeypatch.setattr(in_situ, "GPTStage", Recording)
    profile_layers(_run(tps=(1,)))
    assert alive_at_build == [0, 0, 0]


def test_a_failed_launch_reports_the_rank_that_failed_not_one_killed(tmp_path: Path) -> None:
    """A TP rank that runs out of memory leaves the others waiting in a collective, and they
    are killed: the error must carry the failed rank's stderr (where the OOM is), not that
    of rank 0, killed with nothing to say."""
    from sailor.profiler.procs import run_ranks

    (tmp_path / "oom_rank.py").write_text(
        "import sys, time\n"
        "if sys.argv[sys.argv.index('--rank') + 1] == '1':\n"
        "    sys.stderr.write('torch.OutOfMemoryError: CUDA out of memory.\\n')\n"
        "    sys.exit(1)\n"
        "time.sleep(60)\n"
    )
    with pytest.raises(RankFailedError) as err:
        run_ranks("oom_rank", 2, {}, deadline_s=30, extra_env={"PYTHONPATH": str(tmp_path)})
    assert err.value.rank == 1 and err.value.why == "exit 1"
    assert layers._out_of_memory(err.value.stderr) == "torch.OutOfMemoryError: CUDA out of memory."


def test_a_cpu_probes_parent_process_does_not_load_torch() -> None:
    """``sailor profile network --device cpu`` runs its probes in rank processes that import
    torch; the parent reads their Stats and the host's device type only, and does not import
    it too (~2 CPU-s per run)."""
    import subprocess

    code = (
        "import sys\n"
        "from sailor.cli import profile_network_cmd\n"
        "from sailor.cli.profile_group import local_gpu_type\n"
        "from sailor.profiler import collective_probe, network_probe\n"
        "assert local_gpu_type('cpu') == 'cpu'\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert res.stdout.strip() == "[]", res.stdout[:500]
