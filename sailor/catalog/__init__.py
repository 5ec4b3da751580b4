"""Built-in catalog: GPU spec sheets, list prices, model architectures (package data).

Loading reads JSON files shipped inside the package; the results are validated schemas.
Nothing here is measured on a user's cluster: profiles and network measurements come from
the profiler or an import.
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from typing import Any

from sailor.schemas import GPUPrice, GPUSpec, ModelSpec, PriceTable
from sailor.schemas.calibration import Calibration
from sailor.schemas.deployment import Deployment
from sailor.schemas.device_kind import spec_of
from sailor.schemas.prices import EgressPrice

__all__ = [
    "DEFAULT_DEPLOYMENT",
    "calibration",
    "deployment",
    "deployments",
    "gpu",
    "gpus",
    "model",
    "models",
    "prices",
]

DEFAULT_DEPLOYMENT = "sailor"
"""The deployment plans are priced for unless told otherwise: Sailor's own engine."""


def _load(name: str) -> Any:
    return json.loads(resources.files(__package__).joinpath(name).read_text())


@cache
def gpus() -> dict[str, GPUSpec]:
    """Every catalog GPU type by name."""
    return {g["name"]: GPUSpec(**g) for g in _load("gpus.json")["gpus"]}


@cache
def models() -> dict[str, ModelSpec]:
    """Every catalog model by name."""
    return {m["name"]: ModelSpec(**m) for m in _load("models.json")["models"]}


@cache
def prices() -> PriceTable:
    """List prices with the date they were read."""
    raw = _load("prices.json")
    return PriceTable(
        gpus=tuple(GPUPrice(**p) for p in raw["gpus"]),
        egress=tuple(EgressPrice(**e) for e in raw["egress"]),
        same_region_usd_per_gb=raw["same_region_usd_per_gb"],
        cross_region_usd_per_gb=raw["cross_region_usd_per_gb"],
        read_on=raw["read_on"],
        source=raw["source"],
    )


@cache
def calibration() -> Calibration:
    """Simulator constants per GPU type, each with the measurement it came from."""
    return Calibration.model_validate(_load("calibration.json"))


@cache
def deployments() -> dict[str, Deployment]:
    """Every catalog deployment (the structures a plan can be priced for) by name."""
    return {d["name"]: Deployment(**d) for d in _load("deployments.json")["deployments"]}


def deployment(name: str) -> Deployment:
    """One deployment; a clear error names the unknown one and the known ones."""
    table = deployments()
    if name not in table:
        raise KeyError(f"deployment={name!r} is not in the catalog (known: {', '.join(table)})")
    return table[name]


def gpu(name: str) -> GPUSpec:
    """One GPU type (a CPU kind ``cpu-<kind>``: the ``cpu`` entry under its name); a clear
    error names the unknown type and the known ones."""
    table = gpus()
    spec = spec_of(table, name)
    if spec is None:
        raise KeyError(
            f"gpu_type={name!r} is not in the catalog (known: {', '.join(table)}, "
            "and CPU kinds cpu-<kind>)"
        )
    return spec


def model(name: str) -> ModelSpec:
    """One model; a clear error names the unknown model and the known ones."""
    table = models()
    if name not in table:
        raise KeyError(f"model={name!r} is not in the catalog (known: {', '.join(table)})")
    return table[name]
