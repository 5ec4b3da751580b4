"""Where per-step metrics go: JSON lines and TensorBoard event files, side by side.

:class:`MetricsLogger` takes the flat dict of :func:`sailor.metrics.throughput.step_metrics`
(or any ``{name: number | None}``) and writes it as one JSON line and as TensorBoard scalars
(``None`` values, such as a CPU's MFU, are JSON ``null`` and left out of TensorBoard).
One process logs the run's metrics (rank 0); the figures are global per iteration.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TextIO

from sailor.metrics.tensorboard import EventFileWriter

__all__ = ["MetricsLogger"]


class MetricsLogger:
    """JSON lines at ``jsonl`` and/or TensorBoard events under ``tensorboard_dir``."""

    def __init__(self, jsonl: Path | str | None = None, tensorboard_dir: Path | str | None = None):
        self._jsonl: TextIO | None = None
        if jsonl is not None:
            Path(jsonl).parent.mkdir(parents=True, exist_ok=True)
            self._jsonl = Path(jsonl).open("a")  # noqa: SIM115 - open for the whole run
        self._tb = EventFileWriter(tensorboard_dir) if tensorboard_dir is not None else None

    @property
    def tensorboard_file(self) -> Path | None:
        return self._tb.path if self._tb is not None else None

    def log(self, step: int, values: Mapping[str, float | int | None]) -> None:
        now = time.time()
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"step": step, "time": now, **values}) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            scalars = {k: float(v) for k, v in values.items() if v is not None and k != "step"}
            self._tb.add_scalars(step, scalars, wall_time=now)
            self._tb.flush()

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
