"""The test that matters: heterogeneous plans train exactly like one process.

Real multi-process torch.distributed on gloo (CPU), one OS process per rank started through
the worker entry point. For each plan, N iterations must give the same loss at every
iteration and the same parameters (TP shards gathered along each parameter's TP dim) as
plain single-process training on the same global batches, in fp32, to rounding.

Plus the failure path: one rank raising makes every rank exit within a bounded time, with
the first cause in the failing rank's error file and the others reporting a peer failure.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sailor.megatron_patch.affinity import available_cores, format_cores
from sailor.megatron_patch.engine import TrainConfig
from sailor.megatron_patch.launch import LocalRun, launch_local
from sailor.megatron_patch.model import tiny_model
from sailor.megatron_patch.reference import train_reference
from sailor.megatron_patch.state import gather_full
from sailor.schemas.plan import Pipeline, Plan, ReplicaGroup, Stage

STEPS = 3


def _stage(a: int, b: int, tp: int = 1, recompute: bool = False) -> Stage:
    return Stage(
        first_layer=a,
        last_layer=b,
        replica=ReplicaGroup(gpu_type="cpu", zone="z", tp=tp, gpus_per_node=4),
        recompute=recompute,
    )


def _plan(model: str, *pipelines: Pipeline) -> Plan:
    return Plan(
        model=model,
        global_batch_size=sum(p.samples for p in pipelines),
        pipelines=pipelines,
    )


PLANS = {
    # 3-stage uneven pipeline (middle stage TP=2) beside a 2-stage pipeline with another
    # split (recomputation on, head at TP=2); different microbatch sizes and counts;
    # tied embeddings across 5 ranks.
    "gpt-3stage-beside-2stage": _plan(
        "tiny-gpt",
        Pipeline(
            stages=(_stage(0, 1), _stage(2, 3, tp=2), _stage(4, 5)),
            microbatch_size=1,
            num_microbatches=4,
        ),
        Pipeline(
            stages=(_stage(0, 3, recompute=True), _stage(4, 5, tp=2)),
            microbatch_size=2,
            num_microbatches=2,
        ),
    ),
    # Llama-style (RMSNorm, rotary, SwiGLU, GQA, untied): three pipelines, one of them a
    # single TP=2 stage; layers 0..1 held at TP=2 and TP=1 at once.
    "llama-three-pipelines": _plan(
        "tiny-llama",
        Pipeline(stages=(_stage(0, 5, tp=2),), microbatch_size=1, num_microbatches=2),
        Pipeline(stages=(_stage(0, 2), _stage(3, 5)), microbatch_size=3, num_microbatches=1),
        Pipeline(stages=(_stage(0, 1, tp=2), _stage(2, 5)), microbatch_size=1, num_microbatches=3),
    ),
}


def _full_params(plan: Plan, workdir: Path) -> dict[tuple[int, int], dict[str, torch.Tensor]]:
    """Full tensors of every (pipeline, stage), gathered from the TP ranks' dumps."""
    order = plan.ranks()
    dumps = [torch.load(workdir / f"state-{r}.pt") for r in range(len(order))]
    out: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    for pi, p in enumerate(plan.pipelines):
        for si in range(p.depth):
            ranks = [r for r, (a, b, _) in enumerate(order) if (a, b) == (pi, si)]
            full: dict[str, torch.Tensor] = {}
            for name, (_, dim) in dumps[ranks[0]].items():
                shards = [dumps[r][name][0] for r in ranks]
                if dim is None:  # replicated: every TP rank holds the same value
                    for s in shards[1:]:
                        torch.testing.assert_close(s, shards[0], rtol=0, atol=0)
                full[name] = gather_full(shards, dim)
            out[(pi, si)] = full
    return out


def _check_ok(run: LocalRun) -> None:
    if not run.ok:
        causes = [e for e in run.errors if e]
        pytest.fail(f"ranks failed: {run.returncodes} killed={run.killed} causes={causes}")


# The 5-rank GPT plan runs in `make long-test`: the outside-reference test
# (test_hf_reference.py) runs the same kinds of layouts (three stages with TP 2 in the middle,
# recomputation, tied embeddings across TP degrees) in make test.
@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.long) if n.startswith("gpt-") else n for n in sorted(PLANS)],
)
def test_heterogeneous_plan_matches_single_process(name: str, tmp_path: Path) -> None:
    plan = PLANS[name]
    run = launch_local(plan, STEPS, tmp_path, deadline_s=240)
    _check_ok(run)
    spec = tiny_model(plan.model, plan.global_batch_size)
    ref = train_reference(spec, plan.global_batch_size, STEPS, TrainConfig())
    assert ref.losses[-1] != ref.losses[0]

    for rank in range(len(plan.ranks())):
        losses = [s["loss"] for s in run.steps(rank)]
        assert losses == pytest.approx(ref.losses, rel=1e-5, abs=1e-6), rank
        steps = run.steps(rank)
        assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
        assert steps[-1]["consumed_samples"] == STEPS * plan.global_batch_size
        assert all(s["samples_per_s"] > 0 for s in steps)

    seen: set[str] = set()
    for (pi, si), params in _full_params(plan, tmp_path).items():
        for key, value in params.items():
            torch.testing.assert_close(
                value, ref.params[key], rtol=1e-4, atol=2e-5, msg=f"{name} p{pi}s{si} {key}"
            )
            seen.add(key)
    assert seen == set(ref.params)


def test_a_crashing_rank_stops_every_rank_quickly(tmp_path: Path) -> None:
    plan = _plan(
        "tiny-gpt",
        Pipeline(stages=(_stage(0, 2), _stage(3, 5, tp=2)), microbatch_size=2, num_microbatches=2),
        Pipeline(stages=(_stage(0, 5),), microbatch_size=4, num_microbatches=1),
    )
    run = launch_local(
        plan,
        50,
        tmp_path,
        per_rank_args={1: ["--fail-at-step", "2"]},
        deadline_s=240,
        timeout_s=90,  # generous: a loaded CI machine must not turn into a timeout
    )
    assert run.killed == []
    assert all(rc not in (0, None) for rc in run.returncodes), run.returncodes
    crashed_at = run.exit_times_s[1]
    # Everyone is gone within seconds of the failure, far below the 90 s timeout.
    assert max(run.exit_times_s) - crashed_at < 15.0, run.exit_times_s
    first = run.errors[1]
    assert first is not None
    assert first["origin"] == "local", run.errors
    assert first["error_type"] == "InjectedFailureError", run.errors
    assert "injected failure at step 2" in first["message"] and first["step"] == 2
    for rank in (0, 2, 3):
        err = run.errors[rank]
        assert err is not None and err["origin"] == "peer", err
        assert len(run.steps(rank)) == 2


def _looped_sample(vocab: int, seq: int, seed: int, n: int) -> torch.Tensor:
    """The synthetic data rule stepped one position at a time (the original loop)."""
    rule = torch.Generator().manual_seed(seed)
    mult = int(torch.randint(1, vocab, (1,), generator=rule))
    add = int(torch.randint(0, vocab, (1,), generator=rule))
    g = torch.Generator().manual_seed((seed * 6_364_136_223 + n + 1) % (2**63))
    cur = int(torch.randint(0, vocab, (1,), generator=g))
    noise = torch.rand(seq + 1, generator=g) < 0.1
    rand_tok = torch.randint(0, vocab, (seq + 1,), generator=g)
    out = torch.empty(seq + 1, dtype=torch.long)
    for i in range(seq + 1):
        out[i] = int(rand_tok[i]) if bool(noise[i]) else cur
        cur = (cur * mult + add) % vocab
    return out


@pytest.mark.parametrize(("vocab", "seq", "seed"), [(64, 16, 0), (8, 4, 1), (50257, 1024, 3)])
def test_vectorised_data_equals_the_loop(vocab: int, seq: int, seed: int) -> None:
    from sailor.megatron_patch.data import SyntheticTokens

    ds = SyntheticTokens(vocab, seq, seed)
    for n in (0, 1, 17, 123_456):
        assert torch.equal(ds.sample(n), _looped_sample(vocab, seq, seed, n))


@pytest.mark.long
def test_pinned_ranks_run_bound_round_robin_and_train_the_same(tmp_path: Path) -> None:
    plan = _plan(
        "tiny-gpt",
        Pipeline(stages=(_stage(0, 2), _stage(3, 5)), microbatch_size=2, num_microbatches=2),
        Pipeline(stages=(_stage(0, 5),), microbatch_size=4, num_microbatches=1),
    )
    free = launch_local(plan, 2, tmp_path / "free", deadline_s=240)
    bound = launch_local(plan, 2, tmp_path / "bound", deadline_s=240, pin_cores=True)
    _check_ok(free)
    _check_ok(bound)
    cores = available_cores()
    for rank in range(3):
        ready = next(e for e in bound.progress[rank] if e["event"] == "ready")
        assert ready["cpu_cores"] == str(cores[rank % len(cores)])
        loose = next(e for e in free.progress[rank] if e["event"] == "ready")
        assert loose["cpu_cores"] == format_cores(set(cores))
        assert [s["loss"] for s in bound.steps(rank)] == [s["loss"] for s in free.steps(rank)]
