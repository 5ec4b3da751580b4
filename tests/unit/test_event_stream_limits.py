"""``EVENT_MAX_MSG_SIZE`` bounds the largest event an agent legitimately publishes, with
margin: the limit refuses a flood of big events, never a real one. The largest is a
NodeJoined of a 16-GPU node whose facts hold every bounded error text at its bound in
characters that JSON escapes to 6 bytes each (``\\u0001``)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from sailor.controller.config import ControllerConfig
from sailor.coordination.stream_limits import EVENT_MAX_BYTES, EVENT_MAX_MSG_SIZE
from sailor.schemas.events import NodeJoined, PreemptionNotice, WorkerFailed
from sailor.schemas.hardware import NodeSpec, TorchRuntime
from sailor.schemas.node_check import DeviceFacts, EndpointFacts, NodeFacts, ProbeFacts

_ESC = "\x01"  # one character, six bytes in JSON


def _largest_joined() -> NodeJoined:
    devices = tuple(
        DeviceFacts(
            index=i,
            cuda_name="NVIDIA H100 80GB HBM3",
            catalog_name="H100-80",
            name_error="",
            memory_bytes=85_000_000_000,
            free_bytes=84_000_000_000,
            capability=(9, 0),
            bf16=True,
            fp16=True,
        )
        for i in range(16)
    )
    down = EndpointFacts(url="nats://head-1:4222," * 3, reachable=False, error=_ESC * 1024)
    facts = NodeFacts(
        node_kind="gpu",
        gpu_type="H100-80",
        gpus=16,
        hostname="a-rather-long-hostname.europe-west4-a.c.some-project.internal",
        torch_version="2.13.0+cu128",
        torch_cuda="12.8",
        gathered=True,
        cuda_available=False,
        cuda_error=_ESC * 1024,
        driver_version="570.86.15",
        nccl_version="2.27.3",
        arch_list=("sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120", "compute_120"),
        devices=devices,
        probe=ProbeFacts(ranks=16, error=_ESC * 4096),
        nats=down,
        etcd=down,
        cpu_quota=0.4,
    )
    node = NodeSpec(
        node_id="n" * 128,
        gpu_type="H100-80",
        gpus=16,
        zone="europe-west4-a",
        address="10.128.0.123:29500",
        runtime=TorchRuntime(
            torch_version="2.13.0+cu128", torch_cuda="12.8", nccl_version="2.27.3"
        ),
    )
    return NodeJoined(event_id="e" * 128, node_id="n" * 128, time=1.8e9, node=node, facts=facts)


def test_the_largest_legitimate_event_fits_with_margin() -> None:
    sizes = {
        "node_joined": len(_largest_joined().model_dump_json().encode()),
        "worker_failed": len(
            WorkerFailed(
                event_id="e" * 128,
                node_id="n" * 128,
                time=1.8e9,
                plan_id="p" * 64,
                cause=_ESC * 4096,
            )
            .model_dump_json()
            .encode()
        ),
        "preemption_notice": len(
            PreemptionNotice(
                event_id="e" * 128, node_id="n" * 128, time=1.8e9, deadline=1.8e9, source="s" * 64
            )
            .model_dump_json()
            .encode()
        ),
    }
    largest = max(sizes.values())
    assert 30_000 < sizes["node_joined"] < 60_000, sizes  # the figure the constant cites
    assert largest * 4 <= EVENT_MAX_MSG_SIZE, (sizes, EVENT_MAX_MSG_SIZE)


def test_the_stream_total_is_configurable_and_holds_one_largest_event() -> None:
    """``event_stream_max_bytes``: 64 MiB by default (JetStream reserves it out of
    ``max_file_store``: the 1 GiB of before left room for a handful of jobs); below one
    largest event the stream could not hold what it admits: refused naming the field."""
    assert ControllerConfig().event_stream_max_bytes == EVENT_MAX_BYTES == 64 * 1024**2
    assert ControllerConfig(event_stream_max_bytes=8 << 20).event_stream_max_bytes == 8 << 20
    with pytest.raises(ValidationError, match="event_stream_max_bytes"):
        ControllerConfig(event_stream_max_bytes=EVENT_MAX_MSG_SIZE - 1)
