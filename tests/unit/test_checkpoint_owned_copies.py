"""A save handed host copies made for it keeps them as they are, and lends them to the next.

A caller that assembles each tensor on the host itself (the DeepSpeed adapter's bf16 save:
each full master and moment summed into a host tensor on its writer) hands them to the
``Checkpointer`` (``save(owned=True)``): the snapshot copies nothing, and the copies stay the
checkpointer's for the next save, which borrows them back (``lend_copies``) to fill. Before,
the snapshot copied every tensor once more: the writer held two host copies of what it
wrote. Each copy the snapshot makes is counted through ``checkpointer._cpu_copy`` (the real
copy, counted); the save is a real one on a local directory.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sailor.checkpoint import LocalStorage, ParamState, TrainingGlobals, load
from sailor.checkpoint import checkpointer as checkpointer_module
from sailor.checkpoint.checkpointer import Checkpointer
from tests.unit.test_checkpoint_blocks import one_layer_plan
from tests.unit.test_checkpoint_local import _state

KINDS = ("weight", "exp_avg", "exp_avg_sq")


@pytest.fixture
def copied(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Bytes of each host copy the snapshot makes."""
    out: list[int] = []
    real = checkpointer_module._cpu_copy

    def counted(t: torch.Tensor, *args: object, **kw: object) -> torch.Tensor:
        out.append(t.nbytes)
        return real(t, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(checkpointer_module, "_cpu_copy", counted)
    return out


def _nbytes(state: dict[str, ParamState]) -> int:
    return sum(ps.tensor(k).nbytes for ps in state.values() for k in KINDS)


def test_an_owned_save_keeps_the_host_copies_it_is_handed_and_lends_them_to_the_next(
    tmp_path: Path, copied: list[int]
) -> None:
    storage = LocalStorage(tmp_path)
    ck = Checkpointer(storage, one_layer_plan(), 0, keep=None)
    assert ck.lend_copies() == {}  # nothing kept before a first save
    first = _state(seed=1, layers=1)
    ck.save(first, TrainingGlobals(1, 1, {}), owned=True)
    ck.wait()
    assert copied == []  # the snapshot copied nothing
    assert ck.kept_bytes == _nbytes(first)

    lent = ck.lend_copies()
    assert set(lent) == set(first)
    for key, ps in lent.items():
        for k in KINDS:  # the very tensors handed over
            assert ps.tensor(k).data_ptr() == first[key].tensor(k).data_ptr(), (key, k)
    assert ck.kept_bytes == 0  # lent: the checkpointer keeps none meanwhile

    second = _state(seed=2, layers=1)
    for key, ps in lent.items():
        for k in KINDS:
            ps.tensor(k).copy_(second[key].tensor(k))
    ck.save(lent, TrainingGlobals(2, 2, {}), owned=True)
    ck.wait()
    assert copied == []
    got = load(storage, [0], step=2)
    for key, ps in second.items():
        for k in KINDS:
            assert torch.equal(got.params[key].tensor(k), ps.tensor(k)), (key, k)

    # a save of tensors the caller goes on using is copied, as always
    ck.save(second, TrainingGlobals(3, 3, {}))
    ck.wait()
    assert sum(copied) == _nbytes(second)
    ck.close()
