"""The simulator: iteration time, memory per GPU and $ per iteration of one plan.

Pure functions over frozen schemas: no I/O, no clock, no globals, no torch. The plotting
helper lives in :mod:`sailor.simulator.timeline_plot` and imports matplotlib lazily.
"""

from sailor.simulator.calibrate import MeasuredRun, calibrate_gpu
from sailor.simulator.estimate_profile import (
    ROOFLINE_EFFICIENCY,
    estimate_layer_size,
    estimate_layer_timing,
)
from sailor.simulator.lookup import ProfileLookupError
from sailor.simulator.pipeline import TimelineOp, closed_form_1f1b, replay_1f1b
from sailor.simulator.rank_timing import Method
from sailor.simulator.simulate import Timeline, simulate, simulate_with_timeline

__all__ = [
    "ROOFLINE_EFFICIENCY",
    "MeasuredRun",
    "Method",
    "ProfileLookupError",
    "Timeline",
    "TimelineOp",
    "calibrate_gpu",
    "closed_form_1f1b",
    "estimate_layer_size",
    "estimate_layer_timing",
    "replay_1f1b",
    "simulate",
    "simulate_with_timeline",
]
