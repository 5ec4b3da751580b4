"""The schemas ``sailor schema NAME`` prints, by the name a user types.

Its own module because both the command (:mod:`schema_cmd`) and the file loader's error hints
(:mod:`_io`: "see `sailor schema NAME`") need it, and the command imports the loader.
"""

from __future__ import annotations

from pydantic import BaseModel, TypeAdapter

from sailor import schemas as s
from sailor.schemas.node_check import CheckReport

__all__ = ["SCHEMAS"]

SCHEMAS: dict[str, type[BaseModel] | TypeAdapter[object]] = {
    "gpu": s.GPUSpec,
    "zone": s.Zone,
    "node": s.NodeSpec,
    "pool": s.Pool,
    "network": s.NetworkProfile,
    "prices": s.PriceTable,
    "model": s.ModelSpec,
    "layer-profile": s.LayerProfile,
    "profiles": s.ProfileDB,
    "plan": s.Plan,
    "deployment": s.Deployment,
    "calibration": s.Calibration,
    "estimate": s.Estimate,
    "event": s.EventAdapter,  # type: ignore[dict-item]
    "command": s.CommandAdapter,  # type: ignore[dict-item]
    "checkpoint-manifest": s.CheckpointManifest,
    "check-report": CheckReport,
    "training-config": s.TrainingConfig,
    "dataset-manifest": s.DatasetManifest,
}
