"""simulate() against digests of its earlier answers: every field, bit for bit.

A change that must not move any figure (a speed-up, a refactor) has to leave each
``Estimate`` — every stage's times, every memory breakdown, costs, notes and their order —
and each replay timeline exactly as they were. The digests below were written by the
simulator as it was before it worked once per distinct pipeline (commit 387eb8e), which
computed every stage of every pipeline on its own, and rewritten when precision was priced as
the engine runs it (fp32 gradient all-reduce, autocast state and weight copies, wire dtype;
``MemoryBreakdown.weight_copies`` joined every answer): the 15 reference plans' figures were
checked equal, value for value, before and after that rewrite. The reference plans' digests
were rewritten once more when the attention mask stopped being sent by default
(``Calibration.sends_attention_mask=False``: Sailor's engine sends none, and measured
Megatron-DeepSpeed runs show no such cost); their pipelined plans lost the mask's bytes.

Cases: seeded random plans on the tiny setup of ``test_simulator_simulate`` (up to 60
pipelines drawn from a few layouts, so that alike pipelines repeat; zones and node shapes
without a measured link, a GPU type without a profile (or a spec: an error), shared nodes,
recomputation, spot flags, measured collective latencies, link latencies, framework time,
tied embeddings, asynchronous sends, tied and loss all-reduces), each with the closed form,
the replay and the timeline; and the 15 measured OPT-350 plans, calibrated, when the
reference data is present.

The 9 pipelined reference plans' digests were rewritten when ``calibrate_gpu`` started to
fit the p2p efficiency from the multi-stage runs (their calibration changed, not the
simulator; the 6 single-stage plans did not move), and again when it fitted a fixed cost per
transfer beside it (``GPUCalibration.p2p_fixed_s``; the same 9 moved, the 6 did not), and
once more when that fit tried several starting points (the same optimum, moved in the 13th
digit).

Random cases re-recorded when the p2p model followed the engine's scatter + gather (the
backward all-gather on the sending stage's TP ranks, not the receiver's; none in a direction
whose receiving stage has TP 1).

Random cases 3, 5, 9, 18, 30, 37 and 47 re-recorded when the autocast step phase got its 4 B/param
transient (the engine's flat gradient buffer, then foreach AdamW's temporary): their fp32 /
autocast stages with small activations now peak in the step; the 15 measured plans
(FP16_Optimizer) did not move.

Random cases 3, 11, 27 and 32 re-recorded when a gradient all-reduce over a link the network
profile does not hold (a flat guess by distance) set ``uses_estimates``, as a pipeline
transfer over one already did: that flag is the only field of theirs that changed (checked
field by field).

The 26 random cases with a recompute stage that holds a block re-recorded when recompute
was priced (each block's forward again in its backward, as the engine runs it); every case
without one kept its digest; 24 of them again when recompute held one microbatch's copies of
the whole stage's weights (autocast's cache), not one layer's; 25 again when recompute kept
the embedding's and the head's activations whole (the engine checkpoints blocks only) and
the last layer's working set.

43 random cases re-recorded when autocast's weight copies left out the embedding's table
(its lookup reads the fp32 table; ``memory.copied_params``): the cases whose stage 0 runs
under autocast; the 15 measured plans (FP16_Optimizer) did not move.

37 random cases re-recorded when Sailor's engine's held stage output (each in-flight
microbatch's fp32 output, kept until its backward, on every stage but the last;
``memory.held_output_bytes``) joined the activations, and a GPU's estimated timings read its
estimated block's memory traffic as the calibration's ``activations`` count it; the 15
measured plans (FP16_Optimizer, imported profiles) did not move.

18 random cases re-recorded when the tied embedding's all-reduce (``tied_allreduce``) under
``vocab_parallel`` was priced as the engine's chunk groups (each node moves the matrix once,
``V·h/T`` elements per group) instead of the whole matrix on every TP rank: the cases with
that all-reduce and a TP-2 holder; with the old pricing restored, all 63 match the old digests.

43 random cases re-recorded when the backward's weight-gradient transient joined the peak
under autocast (``memory.weight_grad_bytes``: a layer's largest weight gradient cast to fp32
before the add into the kept gradient, 4 B per element beyond the weight copies; measured on
the engine's layers); the 15 measured plans (FP16_Optimizer) did not move. (Recorded twice
the same day: first at ``(e + 4)`` B, which a review measured to count the released weight
copy again.)

26 random cases re-recorded when an unprofiled link's fallbacks put a sibling zones' curve of
the same VM shapes before the same zones' curve of another shape, and marked the latter a
guess: their notes and ``uses_estimates`` changed; no time moved (their networks hold one
shape).

34 random cases and the 9 pipelined reference plans re-recorded when a stage boundary's
all-gather over a curve became a ring all-gather (``t-1`` steps of one slice, not the whole
tensor at once; ``tp_comm.all_gather_s``): the random cases with a TP > 1 receiver, and the
reference plans through their refitted p2p constants (0.117 / 0.68 ms -> 0.116 / 0.67 ms).

17 random cases (4, 6, 7, 9, 12, 13, 14, 17, 21, 23, 24, 28, 29, 37, 38, 42, 46) and the 15
reference plans re-recorded when a spec sheet's TP link got its efficiency by link kind
(``tp_link_efficiency`` 0.6 -> 0.3 over NVLink and the rest, ``tp_link_efficiency_pcie`` 0.16
over PCIe: the reference profiles' measured TP degrees, ``benchmarks/tp_link_evidence.py``)
and a measured split embedding's backward was raised to its forward's compute (at least the
roofline's share; the all-reduce taken out in the measuring engine's dtype), not to its
forward with the all-reduce: the random cases with a TP > 1 stage; the reference plans through
their TP-4 tables and their calibration's hook cost (0.472 -> 0.469 ms/layer).

18 random cases (the 17 above and 16) re-recorded when a spec sheet's link among a TP group
became the group's peers' (``GPUSpec.link_gbps_among``: GH-96's GPUs are linked directly, 150
GB/s per pair, 450 per GPU) and the NVLink prior's median went from 0.3 to 0.27 with it: the
random cases' TP > 1 stages on a spec sheet's link. The reference plans did not move (their
network profile holds GH-96's measured intra-node curves).

Every case re-recorded when each memory breakdown gained the GPU's NCCL communicators
(``MemoryBreakdown.communicators`` and ``num_communicators``, counted from the plan under the
deployment's process groups, ``simulator.communicators``), which are part of every digest: the
reference plans' values did not move (their fit, Megatron-DeepSpeed's groups, reads 0 bytes
per communicator); the random cases' calibrations set none, so their totals did not move
either.

17 random cases re-recorded when a gradient ring ordered the nodes of one zone by GPU type and
node shape, not by the plan's pipeline order (``network_model.ring_allreduce``): the cases
with a ring among nodes of different kinds in one zone. In 16 only the notes moved (the ring's
neighbours are other pairs, so other unmeasured links are named); in random-16 the ring's
slowest hop changed and its iteration is 4.8 % shorter. The 15 measured plans (one GPU type)
did not move.

After an intended change of the model, print the new digests with
``python tests/unit/test_simulator_golden.py`` and replace :data:`GOLDEN`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import random
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from sailor.schemas import (
    Calibration,
    Endpoint,
    GPUCalibration,
    NetworkProfile,
    Pipeline,
    Plan,
    ProfileDB,
    ReplicaGroup,
    Stage,
)
from sailor.schemas.network import CollectiveLatency
from sailor.schemas.profile import FrameworkTime
from sailor.simulator import simulate, simulate_with_timeline
from tests.reference_opt350 import REF
from tests.unit.test_simulator_simulate import MODEL, PRICES, PROFILES, SPECS, N, _network

RANDOM_CASES = 48

Case = tuple[str, Callable[[], tuple[Any, ...]], dict[str, Any]]


def _random_cases() -> Iterator[Case]:
    rng = random.Random(20261122)
    ep = Endpoint(zone="z-a", gpu_type="A", gpus_per_node=2)
    base = _network()
    nets = [
        base,
        _network(0.3),
        NetworkProfile(),
        base.model_copy(
            update={
                "collectives": (
                    CollectiveLatency(endpoint=ep, ranks=2, latency_s=3e-4, scope="inter_node"),
                    CollectiveLatency(endpoint=ep, ranks=4, latency_s=9e-4, scope="inter_node"),
                )
            }
        ),
        base.model_copy(
            update={
                "links": tuple(
                    ln.model_copy(update={"curve": ln.curve.model_copy(update={"latency_s": 1e-4})})
                    for ln in base.links
                )
            }
        ),
    ]
    cals = [
        # sends_attention_mask=True where the digests were written with the schema's old
        # default (the mask is no longer sent by default): they pin the distinct-pipeline
        # bookkeeping, not the model's defaults
        Calibration(sends_attention_mask=True),
        Calibration(sends_attention_mask=False),
        Calibration(sends_attention_mask=True, blocking_p2p=False),
        Calibration(sends_attention_mask=True, tied_allreduce=True, loss_allreduce=True),
        Calibration(
            sends_attention_mask=True,
            blocking_p2p=False,
            tied_allreduce=True,
            loss_allreduce=True,
            gpus=(
                GPUCalibration(
                    gpu_type="A",
                    profiler_overhead_s=2e-4,
                    network_efficiency=0.3,
                    sync_fixed_s=1e-3,
                    alloc_factor=1.1,
                    memory_overhead_bytes=2 << 30,
                ),
                GPUCalibration(gpu_type="B", network_efficiency=0.5),
            ),
        ),
    ]
    ft = FrameworkTime(
        gpu_type="A", iteration_s=1e-3, microbatch_s=2e-4, sample_s=1e-5, source="test"
    )
    dbs = [
        PROFILES,
        ProfileDB(model="tiny", timings=PROFILES.timings, sizes=PROFILES.sizes, framework=(ft,)),
    ]
    models = [MODEL, MODEL.model_copy(update={"tie_embeddings": True})]
    # without B's spec: memory capacity unknown; without E's: no profile, no spec, an error
    specs = [SPECS, SPECS, {k: v for k, v in SPECS.items() if k != "B"}]
    specs.append({k: v for k, v in SPECS.items() if k != "E"})

    def group() -> ReplicaGroup:
        return ReplicaGroup(
            gpu_type=rng.choice("AAABBE"),
            zone=rng.choice(("z-a", "z-a", "z-b", "z-c", "y-q")),
            tp=rng.choice((1, 1, 2)),
            gpus_per_node=rng.choice((2, 2, 2, 4)),
            node_id=rng.choice(("", "", "n1", "n2")),
            spot=rng.choice((None, None, True, False)),
        )

    def layout() -> tuple[list[Stage], int, int]:
        depth = rng.randint(1, 5)
        bounds = [0, *sorted(rng.sample(range(1, N), depth - 1)), N]
        stages = [
            Stage(first_layer=a, last_layer=b - 1, replica=group(), recompute=rng.random() < 0.2)
            for a, b in itertools.pairwise(bounds)
        ]
        return stages, rng.choice((1, 2, 3, 4, 8)), rng.randint(1, 9)

    for i in range(RANDOM_CASES):
        layouts = [layout() for _ in range(rng.randint(1, 4))]
        pipes = []
        for _ in range(rng.choice((1, 2, 3, 5, 8, 20, 60))):
            stages, mbs, m = rng.choice(layouts)
            if rng.random() < 0.15:  # the same layout with one stage on another node or zone
                stages = list(stages)
                k = rng.randrange(len(stages))
                r = stages[k].replica.model_copy(
                    update={
                        "node_id": rng.choice(("", "n1", "n3")),
                        "zone": rng.choice(("z-a", "z-b")),
                    }
                )
                stages[k] = stages[k].model_copy(update={"replica": r})
            pipes.append(Pipeline(stages=tuple(stages), microbatch_size=mbs, num_microbatches=m))
        plan = Plan(
            model="tiny", global_batch_size=sum(p.samples for p in pipes), pipelines=tuple(pipes)
        )
        args = (plan, rng.choice(models), rng.choice(dbs), rng.choice(nets), PRICES)
        kw = {
            "calibration": rng.choice(cals),
            "gpu_specs": rng.choice(specs),
            "spot": rng.random() < 0.3,
        }

        def given(args: tuple[Any, ...] = args) -> tuple[Any, ...]:
            return args

        yield f"random-{i}", given, kw


def _reference_cases() -> Iterator[Case]:
    if not REF.is_dir():
        return
    from sailor.catalog import gpus
    from sailor.simulator import calibrate_gpu
    from tests.reference_opt350 import DEEPSPEED, load_opt350

    cache: dict[str, Any] = {}

    def setup() -> dict[str, Any]:
        if not cache:
            model, profiles, network, prices, runs = load_opt350()
            cal = DEEPSPEED.with_gpu(
                calibrate_gpu(runs, model, profiles, network, prices, base=DEEPSPEED)
            )
            cache.update(
                model=model, profiles=profiles, network=network, prices=prices, runs=runs, cal=cal
            )
        return cache

    for k in range(15):

        def args(k: int = k) -> tuple[Any, ...]:
            s = setup()
            return (s["runs"][k].plan, s["model"], s["profiles"], s["network"], s["prices"])

        def kw_lazy(k: int = k) -> dict[str, Any]:
            return {"calibration": setup()["cal"], "gpu_specs": gpus()}

        yield f"reference-{k}", args, {"lazy": kw_lazy}


def _cases() -> list[Case]:
    return [*_random_cases(), *_reference_cases()]


def _digests(args: tuple[Any, ...], kw: dict[str, Any]) -> str:
    if "lazy" in kw:
        kw = kw["lazy"]()
    parts: list[str] = []
    for method in ("closed_form", "replay"):
        try:
            parts.append(simulate(*args, method=method, **kw).model_dump_json())
        except Exception as exc:  # the same error as before is part of the answer
            parts.append(f"{type(exc).__name__}: {exc}")
    try:
        est, tl = simulate_with_timeline(*args, **kw)
        parts.append(est.model_dump_json())
        parts.append(repr([dataclasses.astuple(op) for op in tl.ops]))
        parts.append(repr((tl.pipeline_end_s, tl.iteration_time_s)))
    except Exception as exc:
        parts.append(f"{type(exc).__name__}: {exc}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


CASES = _cases()


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_same_answer_as_before(case: Case) -> None:
    name, args, kw = case
    assert _digests(args(), kw) == GOLDEN[name]


GOLDEN: dict[str, str] = {
    "random-0": "a47c9dbe770f1ef40a08fedb",
    "random-1": "43457b7bc73e698e87562bcd",
    "random-2": "100b976e2fc401fe584f776e",
    "random-3": "ed519d73c1fd454928acd888",
    "random-4": "006a9f7b070d33568d90912a",
    "random-5": "d294a2ec464764e2548923c4",
    "random-6": "6facb16b23a96f10ddc890e2",
    "random-7": "7a7d0a70c3d6489331361e34",
    "random-8": "1c6cf0581856c322b2759250",
    "random-9": "5d51294b93b1c4154c1cf57b",
    "random-10": "e76cf7cdb1fcf0939cd01185",
    "random-11": "07ccb971384b4297b653bcff",
    "random-12": "bd941e1a1dd332215e8c8ca2",
    "random-13": "6c2cbeaf5af826c2a94f3195",
    "random-14": "8601e25968c8faa1d4e5d07c",
    "random-15": "41a04fedcd272e6dc3dbc99a",
    "random-16": "3a9410778c0fa4926d34a8ce",
    "random-17": "1704350e35be665b7899c52f",
    "random-18": "7e4fecb1fa95e55f1c7dcc34",
    "random-19": "2bbb4229cbe367dd191fe156",
    "random-20": "00327ba7bd9f0f296bcd2f1d",
    "random-21": "c368f03accbf4dec6446c0f2",
    "random-22": "31822a80209b1206021c939d",
    "random-23": "919b4835b7848ebb064de228",
    "random-24": "ead76c46353ae58bf5b154cd",
    "random-25": "ce19b6e7a24916fc5a95b1d3",
    "random-26": "31822a80209b1206021c939d",
    "random-27": "f51483416ce0ac97f52c7117",
    "random-28": "ba9d10cacd90eac817369664",
    "random-29": "9adde1dabd2e12a592b072ee",
    "random-30": "4aa0028e34e8733b3bd6e437",
    "random-31": "803bcc03f7494f244de9ed82",
    "random-32": "4aa7bed77e6d8a451be673be",
    "random-33": "e33a2827aa04dc7b1c6d5194",
    "random-34": "31822a80209b1206021c939d",
    "random-35": "02102c6577e3c37160b59e75",
    "random-36": "e2d6dbb5a515dc630a48ccc4",
    "random-37": "b2537651add2c3d1f1863597",
    "random-38": "892d5442e487f3ab751ae47a",
    "random-39": "ce5eeaee93ec31eb195db2a1",
    "random-40": "5846c2b1319542010bdbdae0",
    "random-41": "31822a80209b1206021c939d",
    "random-42": "3896fa63d92dc682318d815a",
    "random-43": "438d55e17405113f6113be72",
    "random-44": "4139852738cbd0e940ea8f1c",
    "random-45": "a936c0c200236c457c860d8a",
    "random-46": "3ff23f4da30a731c3f4c4398",
    "random-47": "5397483aabc64c145a17960e",
    "reference-0": "b91e8efc59254067cbb6f472",
    "reference-1": "38d1bf85e0f6c43a3d12ca9c",
    "reference-2": "02064ef0c8ae6a05be99fd48",
    "reference-3": "f7728d4c595aff168370dddb",
    "reference-4": "1bbe0dd590dead4944f0d2c1",
    "reference-5": "9d2ae23773bee813efb88717",
    "reference-6": "17b4c68dc5cbcb1e56b0c33d",
    "reference-7": "b3243a06083492d4c5ad920b",
    "reference-8": "c6224adb4ba75ee077a9adf2",
    "reference-9": "dc8c7a42664884058791e525",
    "reference-10": "36f45b1cbd265c55b60986bd",
    "reference-11": "28ababb9e763577c5a29cca1",
    "reference-12": "e305da6d76ce8e9f9afdc1eb",
    "reference-13": "50d7dac22419ee9b174fd0ac",
    "reference-14": "62f343a168eb0fc7af7d17ca",
}


if __name__ == "__main__":
    print("GOLDEN: dict[str, str] = {")
    for name, args, kw in CASES:
        print(f'    "{name}": "{_digests(args(), kw)}",')
    print("}")
