"""The checkpointable state of a DeepSpeed adapter rank: :class:`DeepSpeedRun`.

What the layer-keyed checkpoints (``sailor.training_process.deepspeed_glue``) read from and
write into a rank running a plan through DeepSpeed's pipe engine (:mod:`deepspeed_adapter`):
its parameters, named by ``PipelineModule`` exactly as Sailor's ``stage_state`` keys
(``"{global_layer}.{param}"``), the AdamW moments the optimizer keeps for them, the step, the
data position and the precision. Nothing here imports DeepSpeed (but :mod:`deepspeed_master`
when a bf16 run is read or written) or ``sailor.checkpoint``.

In fp32 the optimizer DeepSpeed steps is the AdamW the adapter built (``make_optimizer``),
keyed by the module's own parameters (DeepSpeed's basic-optimizer path, no ZeRO): weights and
moments are read from the parameters and ``optimizer.state``. In bf16 DeepSpeed steps a
``BF16_Optimizer`` holding the fp32 master weights and moments in flat partitions across the
data-parallel ranks: they are read and written by parameter through DeepSpeed's fragment API
(:mod:`deepspeed_master`, which imports DeepSpeed when called), so a bf16 checkpoint holds the
fp32 masters, not the bf16 copies, in the same format. fp16 (``FP16_UnfusedOptimizer``,
not mapped: see :mod:`deepspeed_master`) is refused by name
(:meth:`DeepSpeedRun.check_checkpointable`) instead of saving the 16-bit weights without
their master copies.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from sailor.megatron_patch import deepspeed_master as master
from sailor.megatron_patch.checkpoint_io import SaveIO
from sailor.megatron_patch.engine import TrainConfig, resumed_skipped_steps
from sailor.megatron_patch.precision import Precision, check_state_precision
from sailor.megatron_patch.state import key_layer
from sailor.megatron_patch.tp_layers import tp_dim_of
from sailor.schemas.data_identity import DataIdentity
from sailor.schemas.model import ModelSpec
from sailor.schemas.plan import Plan

__all__ = ["DeepSpeedCheckpointIO", "DeepSpeedRun", "NotCheckpointableError"]


class NotCheckpointableError(ValueError):
    """The run's state cannot be saved or loaded in Sailor's format (not retryable)."""


@dataclass
class DeepSpeedRun:
    """One adapter rank's state: what a checkpoint saves and a resume restores."""

    plan: Plan
    rank: int
    module: nn.Module
    """The rank's ``PipelineModule``: parameters named ``"{global_layer}.{param}"``."""
    optimizer: torch.optim.Optimizer
    """The AdamW the adapter built (``make_optimizer``)."""
    engine_optimizer: Any
    """What DeepSpeed steps: the AdamW itself in fp32, a wrapper around it otherwise."""
    cfg: TrainConfig
    precision: Precision
    step: int
    consumed_samples: int
    skipped_steps: int = 0
    """Iterations a resumed state's run skipped (Sailor's engine, for an overflow or a
    non-finite gradient): AdamW took ``step - skipped_steps`` steps. The adapter adds the
    iterations DeepSpeed skips (its ``engine.skipped_steps``: in bf16 ``BF16_Optimizer``
    skips a step whose gradient norm is not finite; in fp32 DeepSpeed skips none)."""
    tp_group: Any = field(default=None)
    """The rank's TP group (TP is 1 under DeepSpeed's pipe engine: none)."""
    spec: ModelSpec | None = None
    """The model: its ``vocab_size`` pads the vocabulary matrices of a checkpoint saved
    before the engine padded them (None: none is padded)."""
    data: DataIdentity | None = None
    """The data ``consumed_samples`` indexes (``data.identity_of``): recorded in its
    checkpoints and compared with a checkpoint's at a resume (None: neither)."""
    data_changes: str = ""
    """What a restore accepted of a checkpoint trained on other data (the training config's
    ``allow_data_change``), '' if nothing: the adapter's ``ready`` event says it
    (``data_changed``), as the engine's worker's does."""

    @property
    def adam_step(self) -> int:
        """AdamW's step count: iterations minus those skipped."""
        return self.step - self.skipped_steps

    def keyed_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return list(self.module.named_parameters())

    @property
    def bf16(self) -> bool:
        """Whether DeepSpeed steps a ``BF16_Optimizer`` around the AdamW (fp32 masters and
        moments in flat partitions, :mod:`deepspeed_master`)."""
        return self.engine_optimizer is not self.optimizer and master.is_bf16_optimizer(
            self.engine_optimizer, [p for _k, p in self.keyed_parameters()]
        )

    def check_checkpointable(self) -> None:
        """Refuse a save or a resume whose master weights and moments are not mapped to layer
        keys (module docstring): anything DeepSpeed steps but the AdamW itself (fp32) or a
        ``BF16_Optimizer`` around it (bf16), i.e. fp16's ``FP16_UnfusedOptimizer``, by name."""
        if self.engine_optimizer is not self.optimizer and not self.bf16:
            raise NotCheckpointableError(
                f"precision={self.precision!r}: DeepSpeed steps a "
                f"{type(self.engine_optimizer).__name__} whose fp32 master weights and moments "
                "the adapter does not map to layer keys; it saves and resumes fp32 and bf16 "
                "runs (run this job on Sailor's engine to checkpoint it in fp16)"
            )

    def _adam_steps(self) -> list[tuple[str, int]]:
        """``(what, AdamW step count)`` of every tensor the optimizer steps (parameters in
        fp32, flat partitions in bf16); none before the first step."""
        if self.bf16:
            steps = master.adam_steps(self.engine_optimizer)
            return [(f"flat fp32 partition {i}", n) for i, n in enumerate(steps) if n]
        out = []
        for key, p in self.keyed_parameters():
            step = self.optimizer.state.get(p, {}).get("step")
            if step is not None:
                out.append((key, int(step.item() if isinstance(step, torch.Tensor) else step)))
        return out

    def _check_adam_step(self) -> None:
        steps = self._adam_steps()
        if not steps and self.adam_step > 0:
            raise RuntimeError(f"no AdamW state at AdamW step {self.adam_step}")
        for what, n in steps:
            if n != self.adam_step:
                raise RuntimeError(
                    f"{what}: AdamW step {n} != iteration {self.step} minus "
                    f"{self.skipped_steps} skipped"
                )

    def weights(self) -> dict[str, torch.Tensor]:
        """This rank's full weights by key: the fp32 masters in bf16 (on the host; a
        collective over each stage's data-parallel group: every rank calls it), the
        parameters in fp32."""
        if self.bf16:
            got = master.read_full(self.keyed_parameters(), [None], lambda _k: None)
            return {k: w for k, (w,) in got.items()}
        return {k: p.detach() for k, p in self.keyed_parameters()}

    def state(
        self,
        writers: Mapping[int, int] | None = None,
        into: Mapping[str, Sequence[torch.Tensor]] | None = None,
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor, int | None]]:
        """``{key: (weight, exp_avg, exp_avg_sq, tp_dim)}`` of this rank's parameters in the
        layers it writes: ``writers`` maps each layer to the global rank that writes it (a
        save's writer assignment, the same on every rank); None: every parameter of the rank.
        fp32: the parameters and AdamW's moments; zero moments before the first step. Raises
        if AdamW's step count is not :attr:`adam_step` (the state would resume a different
        update).

        In bf16 the fp32 masters and moments, on the host: a collective over each stage's
        data-parallel group (every rank calls it, whatever it writes), one reduce to the
        layer's writer per parameter and tensor (an all-reduce without ``writers``); the
        device holds one of them at a time and the host keeps the written layers' only
        (:func:`deepspeed_master.read_full`), copied into ``into`` (by key: weight and both
        moments, e.g. the host copies of the last save, lent) where they fit. A failure on
        this rank (its step count, an allocation, a fragment) is raised after the last
        collective, so its peers never wait in one it skipped."""
        self.check_checkpointable()  # the job's precision: every rank raises alike
        stepped = self.adam_step > 0

        def writer(key: str) -> int | None:
            return None if writers is None else writers.get(key_layer(key), -1)

        def kept(key: str) -> bool:
            return writers is None or writer(key) == self.rank

        out: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor, int | None]] = {}
        if self.bf16:
            failure: Exception | None = None
            try:
                self._check_adam_step()
            except Exception as exc:  # raised by read_full after its collectives
                failure = exc
            keyed = self.keyed_parameters()
            kinds = (None, *master.MOMENTS) if stepped else (None,)
            got = master.read_full(keyed, kinds, writer, failure, into)
            for key, p in keyed:
                if key in got:
                    w, *mv = got[key]
                    m, v = mv if mv else _zero_moments(w, (into or {}).get(key, ()))
                    out[key] = (w, m, v, tp_dim_of(p))
            return out
        self._check_adam_step()
        for key, p in self.keyed_parameters():
            if not kept(key):
                continue
            w = p.detach()
            st = self.optimizer.state.get(p, {})
            if not st and stepped:
                raise RuntimeError(f"{key}: no AdamW state at AdamW step {self.adam_step}")
            if st:
                m, v = st["exp_avg"].detach(), st["exp_avg_sq"].detach()
            else:
                m, v = torch.zeros_like(w), torch.zeros_like(w)
            out[key] = (w, m, v, tp_dim_of(p))
        return out

    def scaling_state(self) -> dict[str, Any]:
        """The globals Sailor's engine keeps beside the weights (``Trainer.scaling_state``):
        the precision, the steps skipped, no loss scale (fp32 and bf16 have none), no
        non-finite streak (DeepSpeed keeps none: a streak a resumed engine checkpoint was in
        is dropped)."""
        return {
            "precision": self.precision,
            "skipped_steps": self.skipped_steps,
            "loss_scale": None,
            "nonfinite": {},
        }

    def load_scaling_state(self, state: Mapping[str, Any]) -> None:
        """Continue from a checkpoint's globals: another precision is refused unless
        ``allow_precision_change`` (the engine's check and error); a saved loss scale is
        dropped (fp32 and bf16 have none), as Sailor's engine drops it without a scaler."""
        check_state_precision(
            state.get("precision"), self.precision, self.cfg.allow_precision_change
        )
        self.skipped_steps = resumed_skipped_steps(state, self.step)

    @torch.no_grad()
    def load(
        self,
        weights: Mapping[str, torch.Tensor],
        moments: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    ) -> None:
        """Copy full weights (every key of this rank: a missing one is a ``KeyError``) and
        AdamW moments into the module and the optimizer, at AdamW step :attr:`adam_step`
        (in bf16: into the fp32 masters, the bf16 parameters made from them)."""
        self.check_checkpointable()
        keyed = self.keyed_parameters()
        for key, _p in keyed:
            if key not in weights:
                raise KeyError(f"{key}: not in the checkpoint (rank {self.rank})")
        if self.bf16:
            for key, p in keyed:
                master.set_master(p, weights[key])
            master.load_moments(self.engine_optimizer, keyed, moments, self.adam_step)
            return
        for key, p in keyed:
            p.copy_(weights[key].to(p.device, p.dtype))
            if self.adam_step <= 0:
                self.optimizer.state.pop(p, None)
                continue
            exp_avg, exp_avg_sq = moments[key]
            self.optimizer.state[p] = {
                "step": torch.tensor(float(self.adam_step)),
                "exp_avg": exp_avg.to(p.device, p.dtype).clone(),
                "exp_avg_sq": exp_avg_sq.to(p.device, p.dtype).clone(),
            }


def _zero_moments(
    w: torch.Tensor, lent: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero moments of ``w`` before the first step: the lent copies (weight and both
    moments) zeroed where they fit, else new ones."""
    out = [
        t.zero_() if t.shape == w.shape and t.dtype == w.dtype else torch.zeros_like(w)
        for t in lent[1:3]
    ]
    while len(out) < 2:
        out.append(torch.zeros_like(w))
    return out[0], out[1]


class DeepSpeedCheckpointIO(SaveIO[DeepSpeedRun], Protocol):
    """What the adapter needs of a checkpoint implementation (called on every rank)."""

    def position(self, root: str, step: int) -> tuple[int, int]:
        """``(step, consumed_samples)`` of the committed checkpoint ``step`` under ``root``."""
        ...

    def restore(self, run: DeepSpeedRun, root: str, step: int) -> None:
        """Load this rank's layers (saved under any layout) and their AdamW moments."""
        ...
