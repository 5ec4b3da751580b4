"""Training metrics in one place: model FLOPs, MFU per GPU type, JSON lines, TensorBoard.

* :mod:`flops` — model FLOPs per token and per GPU type of a plan (pure).
* :mod:`throughput` — ``step_metrics``: tokens/s, MFU per GPU type, loss, lr (pure).
* :mod:`tensorboard` — event files written and read without ``tensorboard``.
* :mod:`logger` — ``MetricsLogger``: JSON lines and TensorBoard side by side.

Must never import torch: the engine hands it numbers.
"""

from sailor.metrics.flops import flops_per_iteration_by_gpu_type, model_flops_per_token
from sailor.metrics.logger import MetricsLogger
from sailor.metrics.tensorboard import EventFileWriter, read_events
from sailor.metrics.throughput import mfu_by_gpu_type, step_metrics

__all__ = [
    "EventFileWriter",
    "MetricsLogger",
    "flops_per_iteration_by_gpu_type",
    "mfu_by_gpu_type",
    "model_flops_per_token",
    "read_events",
    "step_metrics",
]
