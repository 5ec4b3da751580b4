"""The per-microbatch hot loop makes no host sync and moves inputs the cheap way.

Catches: ``float(out)`` per microbatch (a host sync on every microbatch on a GPU; on meta
it cannot run at all), pageable blocking input copies to the GPU.
"""

from __future__ import annotations

from typing import Any

import torch

from sailor.comm.api import use_backend
from sailor.comm.device_copy import to_device
from sailor.comm.strict import StrictBackend
from sailor.megatron_patch.dry_run import META, _stage_on_meta
from sailor.megatron_patch.model import tiny_model
from sailor.megatron_patch.roles import role_of
from sailor.megatron_patch.schedule import P2P, run_1f1b
from sailor.megatron_patch.tp_layers import TPContext
from sailor.schemas.plan import Pipeline, Plan, ReplicaGroup, Stage


class _FakeHostTensor:
    def __init__(self, device: str = "cpu", pinned: bool = False) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.device = torch.device(device)
        self.pinned = pinned

    def is_pinned(self) -> bool:
        return self.pinned

    def pin_memory(self) -> _FakeHostTensor:
        self.calls.append(("pin_memory", None))
        return self

    def to(self, device: torch.device, non_blocking: bool = False) -> _FakeHostTensor:
        self.calls.append(("to", (device, non_blocking)))
        return self


def test_inputs_go_to_a_gpu_pinned_and_non_blocking() -> None:
    fake = _FakeHostTensor()
    gpu = torch.device("cuda", 0)
    to_device(fake, gpu)  # type: ignore[arg-type]
    assert fake.calls == [("pin_memory", None), ("to", (gpu, True))]
    pinned = _FakeHostTensor(pinned=True)  # already pinned (an offloaded held stage)
    to_device(pinned, gpu)  # type: ignore[arg-type]
    assert pinned.calls == [("to", (gpu, True))]
    # on another GPU (a rank that moved devices): a device copy, nothing to pin
    other = _FakeHostTensor("cuda:1")
    to_device(other, gpu)  # type: ignore[arg-type]
    assert other.calls == [("to", (gpu, False))]
    t = torch.arange(3)
    assert torch.equal(to_device(t, torch.device("cpu")), t)


def test_last_stage_loss_stays_on_the_device() -> None:
    """The whole 1F1B of a single-stage pipeline runs on meta: no loss read mid-iteration."""
    stage = Stage(
        first_layer=0,
        last_layer=5,
        replica=ReplicaGroup(gpu_type="A100", zone="z", tp=1, gpus_per_node=4),
    )
    plan = Plan(
        model="tiny-gpt",
        global_batch_size=4,
        pipelines=(Pipeline(stages=(stage,), microbatch_size=1, num_microbatches=4),),
    )
    spec = tiny_model("tiny-gpt", 4)
    role = role_of(plan, 0)
    gpt = _stage_on_meta(spec, role, TPContext())
    tokens = torch.zeros((1, spec.seq_length), dtype=torch.long, device=META)
    p2p = P2P(role, (1, spec.seq_length, spec.hidden_size), META)
    with use_backend(StrictBackend(0, META, 1)):
        total = run_1f1b(gpt, role, p2p, lambda mb: (tokens, tokens), 0.25)
    assert total.device == META and total.dtype == torch.float64 and total.shape == ()
