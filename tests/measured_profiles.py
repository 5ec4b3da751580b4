"""A small measured-looking ProfileDB for CLI tests: OPT-350 (16 heads) on A100-40 and
V100-16 at TP 1 and 2, microbatch 1, estimated from a flat per-kind cost and stamped as
measured (the input ``sailor profile estimate`` extrapolates from)."""

from __future__ import annotations

from pathlib import Path

from sailor import catalog
from sailor.profiler.calibrated_estimate import KindCost, estimate_gpu
from sailor.schemas import ProfileDB


def write_measured_db(path: Path) -> Path:
    """Write the profile to ``path`` and return it."""
    model, specs = catalog.model("OPT-350"), catalog.gpus()
    grid = [(1, 1), (2, 1)]
    kc = KindCost(latency=(0.0, 0.0, 0.0), scale=(3.0, 3.0, 3.0))
    table = {(k, t, b): kc for k in ("embedding", "block", "head") for t, b in grid}
    measured = tuple(
        t.model_copy(update={"source": "measured"})
        for g in ("A100-40", "V100-16")
        for t in estimate_gpu(model, specs[g], table, grid).timings
    )
    path.write_text(ProfileDB(model=model.name, timings=measured).model_dump_json())
    return path
