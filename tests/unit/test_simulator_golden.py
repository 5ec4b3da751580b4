"""simulate() against digests of its earlier answers: every field, bit for bit.

A change that must not move any figure (a speed-up, a refactor) has to leave each
``Estimate`` — every stage's times, every memory breakdown, costs, notes and their order —
and each replay timeline exactly as they were. The digests below were written by the
simulator as it was before it worked once per distinct pipeline (commit 387eb8e), which
computed every stage of every pipeline on its own.

Cases: seeded random plans on the tiny setup of ``test_simulator_simulate`` (up to 60
pipelines drawn from a few layouts, so that alike pipelines repeat; zones and node shapes
without a measured link, a GPU type without a profile (or a spec: an error), shared nodes,
recomputation, spot flags, measured collective latencies, link latencies, framework time,
tied embeddings, asynchronous sends, tied and loss all-reduces), each with the closed form,
the replay and the timeline; and the 15 measured OPT-350 plans, calibrated, when the
reference data is present.

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
        None,
        Calibration(sends_attention_mask=False),
        Calibration(blocking_p2p=False),
        Calibration(tied_allreduce=True, loss_allreduce=True),
        Calibration(
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
    from tests.reference_opt350 import load_opt350

    cache: dict[str, Any] = {}

    def setup() -> dict[str, Any]:
        if not cache:
            model, profiles, network, prices, runs = load_opt350()
            cal = Calibration(gpus=(calibrate_gpu(runs, model, profiles, network, prices),))
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
    "random-0": "196dcd5666fd6c551cf97dab",  # its stage-2 ring is on one node (n2)
    "random-1": "eff068e5f527d2018ae1342b",
    "random-2": "8cd743a06d4194945f656ad3",
    "random-3": "98aa175371c4c39d82980dc4",
    "random-4": "ded1e3f750f0314d2ad3b836",
    "random-5": "d5759bab3556eb89b0718393",
    "random-6": "5e999bfd561f28180cbb0f4f",
    "random-7": "fc96be7ddbc1ff89424f6a95",
    "random-8": "ca34466c6afea5d619bd7cab",
    "random-9": "1db99894e319fc1508f1ccd7",
    "random-10": "45310a5fb290c4f667cbb0da",
    "random-11": "e0d12206e2af726b06af87fd",
    "random-12": "70287cc23933cc6f9205b77b",
    "random-13": "92229630a0110ba73b5d15dc",
    "random-14": "d875c2aa53c45b4296ea5a49",
    "random-15": "efe2c9a879846729b4e8f4a2",
    "random-16": "ca4795593e878bb86cc112bf",
    "random-17": "31615ecbaa946dd7b995cd9c",
    "random-18": "8343be9baf818f2be8caefe9",
    "random-19": "935792c11a0b49495e895e0b",
    "random-20": "8b6adb0b42b77a61aa912993",
    "random-21": "46eff5202037337fa721d40c",
    "random-22": "31822a80209b1206021c939d",
    "random-23": "02e039cd7a151b0a3a536f53",
    "random-24": "300d64c9b3c153647db8f8e1",
    "random-25": "3d06ba2e69210a21d6e5f726",
    "random-26": "31822a80209b1206021c939d",
    "random-27": "78a74748469d1d39c48ee362",
    "random-28": "f1a27da22bd813b46ea64c7d",
    "random-29": "b0016962ee08f9e17a2e2b8e",
    "random-30": "e7a4f6bd5282d03bc9541d1f",
    "random-31": "1f635dfe7c8b9308239f5546",
    "random-32": "0539ee0605ed7576dc083e2d",
    "random-33": "8516ec203d987b86045c00ac",
    "random-34": "31822a80209b1206021c939d",
    "random-35": "4e815ce8f05155c1638a8f40",
    "random-36": "80c81b026e420fbc617aeefd",
    "random-37": "f261edf3dcb31f54a52e835b",
    "random-38": "84100420ed4c2d5258747b77",
    "random-39": "8f30f1862d146f3e130c1cf6",
    "random-40": "216b190a0143134d8bb1ffdd",
    "random-41": "31822a80209b1206021c939d",
    "random-42": "b0e0bac01fe731ee169463b6",
    "random-43": "438d55e17405113f6113be72",
    "random-44": "1f3e2ccd0f37ed5bae79a3ce",
    "random-45": "79696092a32c8936e62e095d",
    "random-46": "6fcb43a69d9bdf9a40e21ffb",
    "random-47": "f4802abf17d87ebbd8073373",
    "reference-0": "037c192db7bb397b2ae7894b",
    "reference-1": "6c21cffb0d1e33717205c0e8",
    "reference-2": "12e68a3d723d2edabf9a27d2",
    "reference-3": "9451c16b0a7d603dbeba86cf",
    "reference-4": "ccc42b0ff0257e17a0122586",
    "reference-5": "672ff831588752d7db911d4e",
    "reference-6": "a1af562d86a7e167a5870e08",
    "reference-7": "9005596362159259f48dbefe",
    "reference-8": "91c831a4cd72851c02f95435",
    "reference-9": "9464a953cc5a3cc4aac37625",
    "reference-10": "aca4381203e995d5d778e1ad",
    "reference-11": "2aca92933f8dd69b3a4ac95d",
    "reference-12": "f3dcb0da466273ca17526b52",
    "reference-13": "da10573fc653f4829ec5fa1d",
    "reference-14": "8303df0321b8706aefd021b8",
}


if __name__ == "__main__":
    print("GOLDEN: dict[str, str] = {")
    for name, args, kw in CASES:
        print(f'    "{name}": "{_digests(args(), kw)}",')
    print("}")
