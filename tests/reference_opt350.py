"""The original artifact's 15 measured OPT-350 plans (GH-96), loaded for the simulator tests.

``REF`` is ``../shared/reference/sailor`` (read-only; present in CI). Tests that use it skip
themselves when it is absent.
"""

from __future__ import annotations

import json
from pathlib import Path

from sailor.catalog import calibration, models
from sailor.importers.sailor_format import import_network, import_plan, import_profiles
from sailor.schemas import (
    Calibration,
    GPUCalibration,
    GPUPrice,
    ModelSpec,
    NetworkProfile,
    PriceTable,
    ProfileDB,
)
from sailor.simulator import MeasuredRun

__all__ = ["DEEPSPEED", "REF", "load_opt350"]

REF = Path(__file__).parents[1] / ".." / "shared" / "reference" / "sailor"


DEEPSPEED = Calibration(
    default=GPUCalibration(
        gpu_type="*", communicator_bytes=calibration().default.communicator_bytes
    )
).with_deployment(calibration().fitted_structure("GH-96"))
"""The framework the reference plans ran on, as the catalog's GH-96 fit records it
(``GPUCalibration.fitted_under``: the catalog deployment ``megatron-deepspeed``, DeepSpeed's
pipe engine with FP16_Optimizer, 16-bit gradients all-reduced, activations partitioned
across TP), not Sailor's autocast engine; with no constant fitted but the bytes of one NCCL
communicator, at the catalog prior's median: what a fit prices each communicator a rank holds
beyond its runs' most (``GPUCalibration.communicators_covered``)."""


def load_opt350() -> tuple[ModelSpec, ProfileDB, NetworkProfile, PriceTable, list[MeasuredRun]]:
    """Model, profiles, network, prices (the artifact's GH-96 price) and the measured runs."""
    model = models()["OPT-350"]
    profiles = import_profiles(
        REF / "profiles" / "profiles_tmp.json", REF / "profiles" / "llm_info.json", "OPT-350"
    )
    network = import_network(
        REF / "providers" / "multizone_bandwidths.json",
        REF / "providers" / "intra_node_bandwidths.json",
    )
    prices = PriceTable(
        gpus=(
            GPUPrice(
                gpu_type="GH-96",
                region="us-central1",
                on_demand_usd_per_hour=11.06,
                spot_usd_per_hour=11.06,
            ),
        )
    )
    runs = []
    for f in sorted((REF / "validation" / "OPT-350").glob("N*/plan_config_*.json")):
        d = json.loads(f.read_text())
        runs.append(
            MeasuredRun(
                name=f.stem,
                plan=import_plan(f, "OPT-350"),
                iteration_time_s=d["real"],
                peak_memory_bytes=d["max_mem"],
                grad_reduce_s=d["red_grads"],
            )
        )
    return model, profiles, network, prices, runs
