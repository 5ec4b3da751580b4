"""``launch_local`` relaunches on a new port when its rendezvous port was taken before any
rank trained (another process bound it between ``free_port`` and rank 0's listener), as
the controller relaunches a generation; a run that fails otherwise is returned as it is."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from sailor.megatron_patch import launch
from sailor.schemas.plan import Pipeline, Plan, ReplicaGroup, Stage


def _plan() -> Plan:
    rg = ReplicaGroup(gpu_type="cpu", zone="z")
    stage = Stage(first_layer=0, last_layer=5, replica=rg)
    pipe = Pipeline(stages=(stage,), microbatch_size=2, num_microbatches=2)
    return Plan(model="tiny-llama", global_batch_size=4, pipelines=(pipe,))


def test_a_taken_rendezvous_port_is_relaunched_on_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = int(taken.getsockname()[1])
        drawn: list[int] = []
        real = launch.free_port

        def first_taken() -> int:
            drawn.append(port if not drawn else real())
            return drawn[-1]

        monkeypatch.setattr(launch, "free_port", first_taken)
        run = launch.launch_local(_plan(), 1, tmp_path, extra_args=["--load-poll-s", "0.05"])
    assert len(drawn) == 2 and drawn[1] != port, drawn
    assert run.ok, (run.returncodes, run.errors, run.stderr)
    assert [s["step"] for s in run.steps(0)] == [1]
    assert run.errors == [None]  # the first attempt's error file went with it
