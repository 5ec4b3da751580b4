"""The strict backend's local checks, one per NCCL rule it enforces at the call."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from sailor.comm import api as comm
from sailor.comm.strict import CommRuleError, DryGroup, StrictBackend, read_logs

META = torch.device("meta")


def _m(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, device=META)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: comm.broadcast(torch.zeros(2), src=0), "rank's device is meta"),
        (lambda: comm.all_reduce(_m(4, 4).t()), "not contiguous"),
        (lambda: comm.gather(_m(2), [_m(2), _m(3)], dst=0), "output"),
        (lambda: comm.gather(_m(2), None, dst=0), "without outputs"),
        (lambda: comm.all_gather_into_tensor(_m(3), _m(2)), "for 2 x"),
        (lambda: comm.all_reduce(_m(1), group=DryGroup((1, 2))), "without it"),
        (lambda: comm.batch_isend_irecv([comm.P2POp("send", _m(1), 0)]), "peer 0"),
        (lambda: comm.batch_isend_irecv([comm.P2POp("recv", torch.zeros(1), 1)]), "device"),
        # dtypes NCCL has no type for (gloo takes them as they are)
        (lambda: comm.all_reduce(_m(2, dtype=torch.bool)), "dtype torch.bool: NCCL has no"),
        (lambda: comm.broadcast(_m(2, dtype=torch.complex64), src=0), "torch.complex64"),
        (
            lambda: comm.all_gather_into_tensor(_m(4, dtype=torch.int16), _m(2, dtype=torch.int16)),
            "tensor of dtype torch.int16",
        ),
        (
            lambda: comm.all_gather([_m(2, dtype=torch.bool)] * 2, _m(2, dtype=torch.bool)),
            "tensor of dtype torch.bool",
        ),
        (
            lambda: comm.batch_isend_irecv([comm.P2POp("send", _m(2, dtype=torch.bool), 1)]),
            "send tensor of dtype torch.bool",
        ),
        (
            lambda: comm.batch_isend_irecv([comm.P2POp("recv", _m(2, dtype=torch.complex128), 1)]),
            "recv tensor of dtype torch.complex128",
        ),
    ],
)
def test_refused_calls(call: Callable[[], object], match: str) -> None:
    with comm.use_backend(StrictBackend(0, META, 2)), pytest.raises(CommRuleError, match=match):
        call()


def test_every_dtype_nccl_has_is_taken() -> None:
    backend = StrictBackend(0, META, 2)
    with comm.use_backend(backend):
        for dtype in (torch.int8, torch.uint8, torch.int32, torch.int64, torch.float16):
            comm.all_reduce(_m(2, dtype=dtype))
        for dtype in (torch.bfloat16, torch.float32, torch.float64):
            comm.wait_all(comm.batch_isend_irecv([comm.P2POp("send", _m(2, dtype=dtype), 1)]))
    assert len(backend.ops) == 5 + 3 * 2


def test_the_default_backend_is_restored_and_logs_round_trip(tmp_path: Path) -> None:
    default = comm.current_backend()
    backend = StrictBackend(1, META, 2)
    with comm.use_backend(backend):
        comm.all_reduce(_m(3), op="max")
        comm.wait_all(comm.batch_isend_irecv([comm.P2POp("recv", _m(2), 0)]))
        got: list[object] = [None, None]
        comm.all_gather_object(got, "x")
        assert got == [None, "x"]
    assert comm.current_backend() is default
    backend.write(tmp_path)
    logs = read_logs(tmp_path)
    assert [op.kind for op in logs[1]] == ["all_reduce", "recv", "wait", "all_gather_object"]
    assert logs[1][0].detail == "max" and logs[1][1].peer == 0
