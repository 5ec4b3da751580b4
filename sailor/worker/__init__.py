"""Deprecated alias of :mod:`sailor.training_process` (the training process the agent launches).

Kept only because agent configs written against the earlier example name the module in
``worker_argv`` (``python -m sailor.worker ...``): such an agent, upgraded in place, would
otherwise fail to start its workers at its next plan, mid-run, rather than at start-up. New
code and configs use ``sailor.training_process``; nothing in Sailor imports this package.
"""

from sailor.training_process import main

__all__ = ["main"]
