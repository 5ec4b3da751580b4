"""Baseline planners, for comparison with :func:`sailor.planner.plan` on the same simulator.

* :func:`megatron_grid`: the homogeneous grid search a practitioner runs by hand: one GPU type
  in one zone, uniform stages, Megatron-style PP x TP x DP with one microbatch size.
* :func:`heterogeneity_blind`: every GPU treated as the slowest type of the pool; uniform
  stages, one microbatch size, GPUs handed out in pool order.

Same interface as :func:`sailor.planner.plan`; every plan is scored by the real simulator.
"""

from sailor.planner.baselines.blind import heterogeneity_blind
from sailor.planner.baselines.megatron import megatron_grid

__all__ = ["heterogeneity_blind", "megatron_grid"]
