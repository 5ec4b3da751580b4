"""Failures every rank raises alike, and what the controller and the checkpoint do with them.

- A label out of range and a checkpoint step refused for an inf or NaN are the job's (the
  data or the weights are bad wherever they run), however many nodes report them; before, the
  two or three nodes that raised were charged, and healthy nodes excluded one after another.
- A save that failed on some rank is raised by every rank: the same refusal everywhere, or
  a peer's failure (not charged) where the failure was another node's storage.
- A refused save leaves no layer file: the refusing writer writes none (it checks every
  tensor first), and the others' are deleted, whichever finishes first; a committed step is
  never touched.

Each test fails on the code before.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from sailor.checkpoint import LocalStorage, NonFiniteCheckpointError, TrainingGlobals, save_full
from sailor.checkpoint.errors import StorageError
from sailor.checkpoint.format import step_dir
from sailor.checkpoint.writer import commit, discard_save, persist_layers
from sailor.controller.node_health import ExclusionPolicy, charge
from sailor.megatron_patch.errors import PeerFailedError, classify, failure_record
from sailor.megatron_patch.vocab_parallel import LabelOutOfRangeError
from sailor.schemas.runtime import DesiredState, NodeHealth
from tests.unit.test_checkpoint_local import _state

POLICY = ExclusionPolicy(failures=2, exclude_s=100, max_exclude_s=300)


def _record(exc: BaseException, rank: int) -> str:
    return json.dumps(failure_record(exc, rank=rank, step=7, in_training=True))[:2000]


def _d(placed: int) -> DesiredState:
    return DesiredState(
        epoch=1,
        generation=1,
        placement={f"n{i}": (i - 1,) for i in range(1, placed + 1)},
        job_health=NodeHealth(),
    )


@pytest.mark.parametrize(
    "exc",
    [
        LabelOutOfRangeError("step 7: label(s) outside the vocabulary [0, 64) ... rank 3 (h)"),
        NonFiniteCheckpointError("step 7: tensor 3.w.weight holds a non-finite value"),
    ],
    ids=["labels", "checkpoint"],
)
@pytest.mark.parametrize("reporting", [1, 2])
def test_an_agreed_error_is_the_jobs_however_few_nodes_report_it(
    exc: BaseException, reporting: int
) -> None:
    """4 placed nodes, 1 or 2 of them report (the others' reports not in yet): no node is
    charged (before: origin local, each reporting node counted, below the job-wide bar)."""
    reports = {f"n{i}": _record(exc, rank=i - 1) for i in range(1, reporting + 1)}
    c = charge(_d(4), reports, 10.0, POLICY)
    assert c.health == {}, c.notes
    assert c.job == NodeHealth()  # counted in the agreed error's own record
    assert c.agreed is not None
    rec = c.agreed[type(exc).__name__]
    assert rec.failures == 1 and rec.cause.startswith(type(exc).__name__)


# ---- every rank raises a failed save ---------------------------------------------------------


def _gathered(monkeypatch: pytest.MonkeyPatch, others: list[Any]) -> None:
    monkeypatch.setattr("sailor.megatron_patch.save_failure.world_objects", lambda obj: others)


def test_a_refusal_is_raised_alike_on_a_rank_whose_save_went_well(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from sailor.megatron_patch.save_failure import raise_save_failure

    text = "step 2: tensor 3.w.weight holds a non-finite value (inf or NaN)"
    # what a peer sends: the class's name (the object collectives carry plain data only)
    cls = "sailor.checkpoint.errors:NonFiniteCheckpointError"
    refusal = (cls, f"NonFiniteCheckpointError: {text}", "h1")
    _gathered(monkeypatch, [None, refusal])
    settled = []
    with pytest.raises(NonFiniteCheckpointError) as e:
        raise_save_failure(None, lambda: settled.append(1))
    assert str(e.value) == text and settled == [1]
    # the rank that has it re-raises its own (traceback and all)
    own = NonFiniteCheckpointError(text, key="3.w.weight")
    with pytest.raises(NonFiniteCheckpointError) as e2:
        raise_save_failure(own, lambda: None)
    assert e2.value is own


def test_a_rank_sends_a_job_wide_class_by_name_as_plain_data() -> None:
    from sailor.comm.codec import decode, encode
    from sailor.megatron_patch.save_failure import _summary

    sent = _summary(NonFiniteCheckpointError("step 2: bad", key="k"))
    assert sent is not None
    assert sent[0] == "sailor.checkpoint.errors:NonFiniteCheckpointError"
    assert decode(encode(sent), 0) == sent
    got = _summary(StorageError("disk full"))
    assert got is not None and got[0] is None  # not job-wide: no class at all


@pytest.mark.parametrize(
    ("summary", "says"),
    [
        (("builtins:exec", "x: y", "h1"), "'builtins:exec'"),
        (("os:system", "x: y", "h1"), "'os:system'"),
        (("sailor.checkpoint.errors:StorageError", "x: y", "h1"), "StorageError"),
        (("sailor.checkpoint.errors:CheckpointError.__init__", "x", "h1"), "__init__"),
        (("not.loaded.module:Error", "x: y", "h1"), "not.loaded.module"),
        (("sailor.checkpoint.errors:NonFiniteCheckpointError", 3, "h1"), "summary"),
        (["a", "b", "c"], "summary"),
        ("text", "summary"),
    ],
    ids=["exec", "os-system", "not-job-wide", "a-method", "not-loaded", "bad-text", "list", "str"],
)
def test_a_peer_naming_a_class_outside_the_job_wide_ones_is_refused_naming_it(
    monkeypatch: pytest.MonkeyPatch, summary: Any, says: str
) -> None:
    from sailor.comm.codec import PeerObjectError
    from sailor.megatron_patch.save_failure import raise_save_failure, report_save_failure

    _gathered(monkeypatch, [None, summary])
    for call in (raise_save_failure, report_save_failure):
        with pytest.raises(PeerObjectError, match=r"^rank 1 ") as e:
            call(None, lambda: pytest.fail("no settle for a refused summary"))
        assert says in str(e.value) and e.value.rank == 1
        assert classify(e.value, in_training=True) == "peer"


def test_another_nodes_storage_error_is_a_peers_failure_here(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from sailor.megatron_patch.save_failure import raise_save_failure

    _gathered(monkeypatch, [None, (None, "StorageError: cannot write x: disk full", "h1")])
    with pytest.raises(PeerFailedError, match=r"rank\(s\) 1 \(h1\), not here") as e:
        raise_save_failure(None, lambda: pytest.fail("no settle for a node's failure"))
    assert classify(e.value, in_training=True) == "peer"
    own = StorageError("cannot write x: disk full")
    _gathered(monkeypatch, [(None, f"StorageError: {own}", "h0")])
    with pytest.raises(StorageError):
        raise_save_failure(own, lambda: None)


# ---- a refused save's files --------------------------------------------------------------------


def _layers(nan: bool, layers: tuple[int, ...]) -> dict[int, dict[str, Any]]:
    st = _state(seed=0)
    if nan:
        st["2.v"].weight[0, 0] = math.nan
    by: dict[int, dict[str, Any]] = {}
    for key, p in st.items():
        layer, name = key.split(".", 1)
        if int(layer) in layers:
            by.setdefault(int(layer), {})[name] = p
    return by


def _files(root: Path, step: int) -> list[str]:
    return sorted(p.name for p in (root / step_dir(step)).rglob("*") if p.is_file())


def test_the_refusing_writer_writes_no_layer_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, its layer files were written and fsync'd on the pool's threads (leaving the
    pool waits for every task) before the refusal."""
    storage = LocalStorage(tmp_path)
    monkeypatch.setattr(storage, "write_all", lambda *a, **k: pytest.fail("wrote layer files"))
    with pytest.raises(NonFiniteCheckpointError, match=r"tensor 2\.v\.weight"):
        persist_layers(storage, 5, "sid", _layers(True, (0, 1, 2)), rank=1)


@pytest.mark.parametrize("refusal_first", [False, True])
def test_a_refused_saves_files_are_deleted_whichever_writer_ends_first(
    tmp_path: Path, refusal_first: bool
) -> None:
    storage = LocalStorage(tmp_path)
    save_full(storage, _state(seed=0), TrainingGlobals(4, 16, {}), model="toy", num_layers=4)
    before = _files(tmp_path, 4)

    def good() -> None:
        persist_layers(storage, 5, "sid", _layers(False, (0, 1)), rank=0)

    def bad() -> None:
        with pytest.raises(NonFiniteCheckpointError):
            persist_layers(storage, 5, "sid", _layers(True, (2, 3)), rank=1)

    for write in (bad, good) if refusal_first else (good, bad):
        write()
    with pytest.raises(NonFiniteCheckpointError, match=r"step 5: tensor 2\.v\.weight"):
        commit(
            storage,
            step=5,
            save_id="sid",
            writer_ranks=[0, 1],
            globals_=TrainingGlobals(5, 20, {}),
            model="toy",
            num_layers=4,
            timeout_s=5.0,
        )
    assert _files(tmp_path, 5) == ["sid-rank00001.json"]  # the refusal alone
    assert _files(tmp_path, 4) == before


def test_discarding_never_touches_a_committed_save(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    save_full(
        storage,
        _state(seed=0),
        TrainingGlobals(4, 16, {}),
        model="toy",
        num_layers=4,
        save_id="sid",
    )
    before = _files(tmp_path, 4)
    assert discard_save(storage, 4, "sid") == []
    assert _files(tmp_path, 4) == before


def test_an_agreed_error_naming_a_host_like_a_backend_is_this_ranks_own() -> None:
    """The agreed errors name ranks and hosts; a host called ``gloo-node-3`` must not make
    the record a peer's (review: ``classify`` matched its text markers first). The engine's
    list is the controller's."""
    from sailor.controller.failure_text import AGREED_ERRORS
    from sailor.megatron_patch.errors import AGREED, failure_record
    from sailor.megatron_patch.nonfinite import NonFiniteGradientsError

    assert AGREED == AGREED_ERRORS
    exc = NonFiniteGradientsError("first seen at step 4 on rank 1 (gloo-node-3): socket")
    rec = failure_record(exc, rank=0, step=4, in_training=True)
    assert (rec["origin"], rec["retry"]) == ("local", True)


def _agree_worker(rank: int, store: str, out: str) -> None:
    import json
    from pathlib import Path

    import torch
    import torch.distributed as dist

    from sailor.megatron_patch.step_agreement import BAD_LABELS, NONFINITE, agree_step

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    got = []
    # the loss lives on rank 1 (the last stage); rank 0 read a bad label, rank 1's gradient
    # is non-finite; then a NaN in a square; then nothing
    cases = [
        (float(rank), 1.5, rank == 1, rank == 0),
        (0.0, float("nan") if rank == 0 else 2.0, False, False),
        (0.25 * rank, 1.0, False, False),
    ]
    for loss, sq, bad_grad, bad_label in cases:
        a = agree_step(
            torch.tensor([loss], dtype=torch.float64),
            torch.tensor(sq, dtype=torch.float64),
            torch.tensor(bad_grad),
            bad_label,
            rank,
            2,
        )
        squares = a.squares if a.squares == a.squares else "nan"
        nf, bl = list(a.ranks(NONFINITE)), list(a.ranks(BAD_LABELS))
        got.append([a.loss, squares, list(a.flags), a.nonfinite, nf, bl])
    Path(out, f"{rank}.json").write_text(json.dumps(got))
    dist.destroy_process_group()


def test_the_iterations_agreement_sums_the_loss_and_keeps_each_ranks_flags(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``agree_step`` on two ranks: the loss and the squares are summed, each rank's flags sit
    in its own slot (so every rank knows which ranks saw what), a NaN square makes the step
    non-finite on every rank; both ranks read the same values."""
    import json

    from tests.spawn import spawn

    spawn(_agree_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    r0, r1 = (json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1))
    assert r0 == r1
    assert r0[0] == [1.0, 3.0, [2, 1], True, [1], [0]]
    assert r0[1] == [0.0, "nan", [0, 0], True, [], []]
    assert r0[2] == [0.25, 2.0, [0, 0], False, [], []]


def test_the_local_check_leaves_out_empty_gradients() -> None:
    import math

    import torch

    from sailor.megatron_patch.step_agreement import local_nonfinite

    cpu = torch.device("cpu")
    empty = torch.empty(0)
    assert not bool(local_nonfinite([empty, torch.ones(3)], cpu))
    assert bool(local_nonfinite([empty, torch.tensor([1.0, math.nan])], cpu))
    assert bool(local_nonfinite([torch.tensor([math.inf]), empty], cpu))
    assert not bool(local_nonfinite([empty], cpu))
