"""The corners on a slow link: plans of consumer GPU nodes across ~1 Gb/s, each corner against
the original's model.

The reference profiles hold OPT-350 on RTX-3090, Titan-RTX and RTX-2080 (8 GPUs per node)
and the artifact's network files a 0.115 GB/s curve between such nodes. For every plan of one
to three stages of those types (one type per stage, in every order; the layers split evenly),
TP 2, 4 and 8, microbatch 1, 2 and 4, one or two pipelines (global batch 64), it simulates
the four corners (closed form) and prints, by class of plan, the median corner's and the
optimistic corner's iteration time over the original corner's (the original artifact's
model, which takes the probe as it is), and whether the original's time lies inside
[optimistic, pessimistic].

What it shows is how far the cost model's median sits from a model that prices the link at
its probe, on hardware the catalog has no fit for: not accuracy (no measured run is read).
Prints the machine and the data. Never asserts. Run:
``python benchmarks/slow_link_corners.py [--deployment sailor|megatron-deepspeed]``.
"""

from __future__ import annotations

import argparse
import itertools
import platform
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

from sailor import catalog
from sailor.importers.sailor_format import import_network, import_profiles
from sailor.schemas import Pipeline, Plan, ReplicaGroup, Stage
from sailor.simulator import simulate
from sailor.simulator.uncertainty import CORNERS, corners

REF = Path(__file__).resolve().parents[1] / ".." / "shared" / "reference" / "sailor"
TYPES = ("RTX-3090", "Titan-RTX", "RTX-2080")
ZONE = "us-central1-a"
GBS = 64

Row = tuple[tuple[str, ...], int, int, int, dict[str, float]]


def _plan(combo: tuple[str, ...], tp: int, mbs: int, dp: int, layers: int) -> Plan:
    per = layers // len(combo)
    stages, first = [], 0
    for i, g in enumerate(combo):
        last = layers - 1 if i == len(combo) - 1 else first + per - 1
        replica = ReplicaGroup(gpu_type=g, zone=ZONE, tp=tp, gpus_per_node=8)
        stages.append(Stage(first_layer=first, last_layer=last, replica=replica))
        first = last + 1
    pipe = Pipeline(stages=tuple(stages), microbatch_size=mbs, num_microbatches=GBS // (mbs * dp))
    return Plan(model="OPT-350", global_batch_size=GBS, pipelines=(pipe,) * dp)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--deployment", default="sailor", help="catalog deployment to price")
    args = ap.parse_args()
    print("== the corners on a slow link (consumer GPU nodes, ~1 Gb/s between them) ==")
    print(f"machine: {platform.node()} {platform.machine()}; python {sys.version.split()[0]}")
    print(f"reference data: {REF.resolve()}; deployment: {args.deployment}")
    model = catalog.model("OPT-350")
    prof = REF / "profiles"
    db = import_profiles(prof / "profiles_tmp.json", prof / "llm_info.json", "OPT-350")
    prov = REF / "providers"
    net = import_network(
        prov / "multizone_bandwidths_het.json", prov / "intra_node_bandwidths.json"
    )
    base = catalog.calibration()
    if args.deployment != "sailor":
        base = base.with_deployment(catalog.deployments()[args.deployment])
    cs = dict(corners(base))
    layers = model.num_all_layers
    rows: list[Row] = []
    skipped = 0
    for k in (1, 2, 3):
        for combo in itertools.permutations(TYPES, k):
            for tp, mbs, dp in itertools.product((2, 4, 8), (1, 2, 4), (1, 2)):
                plan = _plan(combo, tp, mbs, dp, layers)
                try:
                    t = {
                        c: simulate(
                            plan, model, db, net, catalog.prices(), calibration=cs[c],
                            gpu_specs=catalog.gpus(),
                        ).iteration_time_s
                        for c in CORNERS
                    }  # fmt: skip
                except (KeyError, ValueError):
                    skipped += 1
                    continue
                rows.append((combo, tp, mbs, dp, t))
    print(f"{len(rows)} plans simulated in {len(CORNERS)} corners ({skipped} not priced)")
    classes: list[tuple[str, Callable[[Row], bool]]] = [
        ("one stage, one pipeline", lambda r: r[3] == 1 and len(r[0]) == 1),
        ("2-3 stages across the link, one pipeline", lambda r: r[3] == 1 and len(r[0]) > 1),
        ("one stage, two pipelines", lambda r: r[3] == 2 and len(r[0]) == 1),
        ("2-3 stages, two pipelines", lambda r: r[3] == 2 and len(r[0]) > 1),
    ]
    print(
        "class | plans | median / original: mean (min-max) | optimistic / original: mean (min-max)"
    )
    for name, sel in classes:
        got = [r[4] for r in rows if sel(r)]
        if not got:
            continue
        med = [t["median"] / t["original"] for t in got]
        opt = [t["optimistic"] / t["original"] for t in got]
        print(
            f"{name} | {len(got)} | {statistics.mean(med):.2f} ({min(med):.2f}-{max(med):.2f}) | "
            f"{statistics.mean(opt):.2f} ({min(opt):.2f}-{max(opt):.2f})"
        )
    inside = sum(t["optimistic"] <= t["original"] <= t["pessimistic"] for *_, t in rows)
    print(f"original's time inside [optimistic, pessimistic]: {inside} of {len(rows)}")


if __name__ == "__main__":
    main()
