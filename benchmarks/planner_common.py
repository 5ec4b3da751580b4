"""Shared setup of the planner benchmarks: the original artifact's profiles, network, prices.

Reads ``../shared/reference/sailor`` (override with ``SAILOR_REFERENCE``). Prices: the
artifact's on-demand $/GPU-hour (A100-40 3.67, V100-16 2.86, GH-96 11.06; A100-80 from the
catalog), egress from its ``communication_cost.json``. Network: ``multizone_bandwidths_het``
(it has the A100-40 <-> V100-16 links the plain file lacks) + intra-node curves.
"""

from __future__ import annotations

import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy

from sailor import catalog
from sailor.importers.sailor_format import (
    import_egress,
    import_network,
    import_profiles,
    import_training_config,
)
from sailor.schemas import (
    Calibration,
    GPUPrice,
    GPUSpec,
    ModelSpec,
    NetworkProfile,
    Pool,
    PoolEntry,
    PriceTable,
    ProfileDB,
)

REFERENCE = Path(
    os.environ.get(
        "SAILOR_REFERENCE", Path(__file__).resolve().parents[2] / "shared/reference/sailor"
    )
)
ARTIFACT_PRICES = {"A100-40": 3.67, "V100-16": 2.86, "GH-96": 11.06, "A100-80": 5.07}
CONFIGS = {
    "OPT-350": "training_config_opt_350.json",
    "GPT-Neo-2.7": "training_config_gpt_neo27.json",
}


@dataclass(frozen=True)
class Setup:
    model: ModelSpec
    profiles: ProfileDB
    network: NetworkProfile
    prices: PriceTable
    specs: dict[str, GPUSpec]
    calibration: Calibration

    def kw(self) -> dict[str, object]:
        return {
            "model": self.model,
            "profiles": self.profiles,
            "network": self.network,
            "prices": self.prices,
            "gpu_specs": self.specs,
            "calibration": self.calibration,
        }


def load(model: str) -> Setup:
    r = REFERENCE
    m = import_training_config(r / "configs" / CONFIGS[model])
    prof = import_profiles(r / "profiles/profiles_tmp.json", r / "profiles/llm_info.json", model)
    net = import_network(
        r / "providers/multizone_bandwidths_het.json", r / "providers/intra_node_bandwidths.json"
    )
    egress = import_egress(r / "providers/communication_cost.json")
    prices = PriceTable(
        gpus=tuple(
            GPUPrice(gpu_type=g, region="*", on_demand_usd_per_hour=p, spot_usd_per_hour=p)
            for g, p in ARTIFACT_PRICES.items()
        ),
        egress=egress.egress,
        source="original artifact's prices",
    )
    cal_fn = getattr(catalog, "calibration", None)
    cal = cal_fn() if callable(cal_fn) else Calibration()
    return Setup(m, prof, net, prices, catalog.gpus(), cal)


def pool(counts: dict[tuple[str, str], int], gpus_per_node: int = 4) -> Pool:
    """GPUs per (type, zone) -> pool of 4-GPU nodes."""
    return Pool(
        entries=tuple(
            PoolEntry(gpu_type=g, zone=z, nodes=n // gpus_per_node, gpus_per_node=gpus_per_node)
            for (g, z), n in counts.items()
        )
    )


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (
        f"{platform.node()} | {cpu} | {os.cpu_count()} CPUs (shared) | Python "
        f"{sys.version.split()[0]} | numpy {numpy.__version__} | {platform.platform()}"
    )
