"""A communicator that NCCL's watchdog aborted is seen at the next host sync.

With ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` the watchdog aborts a timed-out communicator
without raising in Python; :func:`sailor.comm.abort.backend_error` reads each group's
``get_error`` after the sync, before a value is read back. No NCCL here: the groups below
stand in for torch's, with torch's own ``ErrorType``; a real gloo group (no ``get_error``)
must pass.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ErrorType

from sailor.comm import abort
from sailor.localnet import free_port


class _Backend:
    def __init__(self, err: Any) -> None:
        self.err = err

    def get_error(self) -> Any:
        return self.err


class _Group:
    def __init__(self, name: str, err: Any | None, has_device: bool = True) -> None:
        self.group_name, self.err, self.has_device = name, err, has_device

    def size(self) -> int:
        return 4

    def _get_backend(self, device: torch.device) -> object:
        if not self.has_device:
            raise RuntimeError(f"no backend for {device}")
        return object() if self.err is None else _Backend(self.err)


def _pairs(*groups: _Group) -> list[tuple[Any, Any]]:
    return [(g, ("nccl", None)) for g in groups]


@pytest.mark.parametrize("err", [ErrorType.TIMEOUT, ErrorType.COMM_ERROR, ErrorType.REMOTE_ERROR])
def test_a_failed_communicator_is_named(err: Any) -> None:
    groups = _pairs(
        _Group("0", ErrorType.SUCCESS),
        _Group("1", None),  # a backend without get_error (gloo)
        _Group("2", ErrorType.TIMEOUT, has_device=False),  # not on this device
        _Group("3", err),
    )
    msg = abort.backend_error(groups, torch.device("cuda", 0))
    assert msg is not None and "'3'" in msg and err.name in msg
    # it is a peer's failure for the worker's record (errors.classify)
    from sailor.megatron_patch.errors import classify

    assert classify(dist.DistBackendError(msg), True) == "peer"


def test_healthy_communicators_pass() -> None:
    groups = _pairs(_Group("0", ErrorType.SUCCESS), _Group("1", None))
    assert abort.backend_error(groups, torch.device("cuda", 0)) is None


def test_a_real_gloo_world_passes() -> None:
    from torch.distributed import distributed_c10d as c10d

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        dist.new_group([0])
        pairs = list(c10d._world.pg_map.items())
        assert len(pairs) == 2
        assert abort.backend_error(pairs, torch.device("cpu")) is None
        abort.host_sync(torch.device("cpu"))  # nothing to wait for on a CPU
    finally:
        dist.destroy_process_group()
