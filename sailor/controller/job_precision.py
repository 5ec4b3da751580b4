"""The job's precision, as the controller fixes and keeps it: one for the job's whole life.

A job that trained in bf16 and is relaunched in fp16 (a V100 joined, and the new plan's GPU
types chose fp16) starts its loss scale at 2^16 over activations the bf16 model learned
above fp16's range: the forward overflows, the scale halves to its floor and the job fails
with non-finite gradients. The reverse changes the numerics silently. So the precision is
fixed once (docs/training.md, "One precision per job"):

* by the training config when it forces one (``precision: bf16|fp16|fp32``);
* else by the first plan the controller launches (its recorded ``Plan.precision``);

and kept in the desired state (``DesiredState.job_precision``, in etcd: a new leader reads
it, and a layout torn down to IDLE, whose plan is gone, keeps it). Every replan asks the
planner for plans in it (``Replan.precision``; the planner leaves out GPU types that cannot
run it), and a next plan in another precision is never launched. A forced precision other
than the recorded one takes over only with ``allow_precision_change``; otherwise the job
is held, not launched, until the config changes (:func:`precision_conflict`: the reason,
saying what to set, is the desired state's cause). Launched, every rank would refuse the
contradiction (``megatron_patch.precision.plan_precision``), and each refusal counted as a
job failure, retried with backoff, at every relaunch.

Pure: values in, values out (the catalog's GPU specs are package data, read once).
"""

from __future__ import annotations

from sailor import catalog
from sailor.schemas.model import ModelSpec
from sailor.schemas.plan import Plan
from sailor.schemas.precision import Precision
from sailor.schemas.runtime import DesiredState
from sailor.schemas.training import TrainingConfig

__all__ = [
    "HELD_PREFIX",
    "forced_precision",
    "job_precision",
    "plan_precision",
    "precision_conflict",
]


def forced_precision(training: TrainingConfig | None) -> Precision | None:
    """The precision the training config forces, None for ``auto`` (or no config)."""
    if training is None or training.precision == "auto":
        return None
    return training.precision


def job_precision(d: DesiredState, training: TrainingConfig | None) -> Precision | None:
    """The precision every plan of the job is made and launched in: the recorded one
    (``d.job_precision``), unless the config forces another and allows the change; before
    one is recorded, the forced one. None: not fixed yet (the first launched plan fixes it)."""
    forced = forced_precision(training)
    if d.job_precision is None:
        return forced
    if forced is not None and training is not None and training.allow_precision_change:
        return forced
    return d.job_precision


HELD_PREFIX = "held: the training config forces "
"""How the cause of a job held by :func:`precision_conflict` begins."""


def precision_conflict(d: DesiredState, training: TrainingConfig | None) -> str | None:
    """Why no plan of the job may be launched under ``training``, or None: the config forces
    another precision than the recorded one and does not allow the change. Every rank would
    refuse such a launch; the reason says what to set."""
    forced = forced_precision(training)
    rec = d.job_precision
    if rec is None or forced is None or forced == rec:
        return None
    if training is not None and training.allow_precision_change:
        return None
    return (
        f"{HELD_PREFIX}precision={forced!r} but the job runs {rec!r} "
        f"(fixed at its first launch); set precision: {rec} (or auto) to go on in it, or "
        f"allow_precision_change: true to switch to {forced}"
    )


def plan_precision(plan: Plan, model: ModelSpec | None) -> Precision:
    """The precision ``plan`` runs in: recorded, else derived from its GPU types (as the
    workers derive it: catalog specs, the model spec's request)."""
    return plan.resolved_precision(catalog.gpus(), model.precision if model else "bf16")
