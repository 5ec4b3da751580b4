"""The 1F1B schedule's spans for online calibration: forward, backward and exchanges apart.

On CPU (one process, the strict backend standing in for the world of one rank): every
microbatch gives one forward and one backward span, every exchange one p2p span, and timing
changes nothing the schedule computes. The CUDA path (events) is checked in
``tests/gpu/test_engine_gpu.py``.
"""

from __future__ import annotations

import time

import torch

from sailor.comm.api import use_backend
from sailor.comm.strict import StrictBackend
from sailor.megatron_patch.clock import SpanTimer
from sailor.megatron_patch.model import GPTStage, tiny_model
from sailor.megatron_patch.roles import role_of
from sailor.megatron_patch.schedule import P2P, run_1f1b
from sailor.megatron_patch.tp_layers import TPContext
from sailor.schemas.plan import Pipeline, Plan, ReplicaGroup, Stage

CPU = torch.device("cpu")


def test_span_timer_sums_named_spans_on_cpu() -> None:
    t = SpanTimer(CPU)
    for _ in range(3):
        mark = t.begin()
        time.sleep(0.002)
        t.end("fwd", mark)
    mark = t.begin()
    t.end("p2p", mark)
    got = t.collect()
    assert got["fwd"][1] == 3 and got["fwd"][0] >= 0.006
    assert got["p2p"][1] == 1
    assert t.collect() == {}  # reset by collect


def test_run_1f1b_times_each_microbatch_and_exchange_without_changing_the_result() -> None:
    m = 4
    stage = Stage(
        first_layer=0,
        last_layer=5,
        replica=ReplicaGroup(gpu_type="cpu", zone="z", tp=1, gpus_per_node=1),
    )
    plan = Plan(
        model="tiny-gpt",
        global_batch_size=m,
        pipelines=(Pipeline(stages=(stage,), microbatch_size=1, num_microbatches=m),),
    )
    spec = tiny_model("tiny-gpt", m)
    role = role_of(plan, 0)
    gpt = GPTStage(spec, role.first_layer, role.last_layer, tp=TPContext(), seed=0)
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, spec.vocab_size, (1, spec.seq_length), generator=g) for _ in range(m)]
    p2p = P2P(role, (1, spec.seq_length, spec.hidden_size), CPU)
    timer = SpanTimer(CPU)
    with use_backend(StrictBackend(0, CPU, 1)):
        timed = run_1f1b(gpt, role, p2p, lambda mb: (data[mb], data[mb]), 1 / m, timer=timer)
        grads = [p.grad.clone() for p in gpt.parameters() if p.grad is not None]
        gpt.zero_grad(set_to_none=True)
        plain = run_1f1b(gpt, role, p2p, lambda mb: (data[mb], data[mb]), 1 / m)
    assert torch.equal(timed, plain)
    again = [p.grad for p in gpt.parameters() if p.grad is not None]
    assert all(torch.equal(a, b) for a, b in zip(grads, again, strict=True))
    spans = timer.collect()
    assert spans["fwd"][1] == m and spans["bwd"][1] == m
    # one stage: recv_forward once, then per microbatch one paired exchange (the last a lone
    # send_backward): 2m + 1 exchanges, each empty and quick
    assert spans["p2p"][1] == 2 * m + 1
    assert spans["fwd"][0] > 0 and spans["bwd"][0] > 0
    assert spans["p2p"][0] < spans["fwd"][0] + spans["bwd"][0]
