"""The checkpointable state of a DeepSpeed adapter rank: :class:`DeepSpeedRun`.

What the layer-keyed checkpoints (``sailor.training_process.deepspeed_glue``) read from and
write into a rank running a plan through DeepSpeed's pipe engine (:mod:`deepspeed_adapter`):
its parameters, named by ``PipelineModule`` exactly as Sailor's ``stage_state`` keys
(``"{global_layer}.{param}"``), the AdamW moments the optimizer keeps for them, the step, the
data position and the precision. Nothing here imports DeepSpeed or ``sailor.checkpoint``.

Checkpoints need the optimizer to be the AdamW the adapter built (``make_optimizer``), keyed by
the module's own parameters: so it is in fp32 (DeepSpeed's basic-optimizer path, no ZeRO). In
bf16 or fp16 DeepSpeed wraps it (``BF16_Optimizer``, ``FP16_Optimizer``) around fp32 master
copies in flat groups that are not mapped to layer keys: :meth:`DeepSpeedRun.check_checkpointable`
refuses those by name instead of saving the low-precision weights without their master copies.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from sailor.megatron_patch.checkpoint_io import SaveIO
from sailor.megatron_patch.engine import TrainConfig, resumed_skipped_steps
from sailor.megatron_patch.precision import Precision, check_state_precision
from sailor.megatron_patch.tp_layers import tp_dim_of
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
    non-finite gradient): AdamW took ``step - skipped_steps`` steps. The adapter skips none
    itself in fp32, so the count stays what the checkpoint said."""
    tp_group: Any = field(default=None)
    """The rank's TP group (TP is 1 under DeepSpeed's pipe engine: none)."""
    spec: ModelSpec | None = None
    """The model: its ``vocab_size`` pads the vocabulary matrices of a checkpoint saved
    before the engine padded them (None: none is padded)."""

    @property
    def adam_step(self) -> int:
        """AdamW's step count: iterations minus those skipped."""
        return self.step - self.skipped_steps

    def keyed_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return list(self.module.named_parameters())

    def check_checkpointable(self) -> None:
        """Refuse a save or a resume where the moments are not the AdamW's own (module
        docstring): bf16 and fp16 runs, by name."""
        if self.engine_optimizer is not self.optimizer:
            raise NotCheckpointableError(
                f"precision={self.precision!r}: DeepSpeed steps a "
                f"{type(self.engine_optimizer).__name__} holding fp32 master weights and "
                "moments in flat groups the adapter does not map to layer keys; it saves and "
                "resumes fp32 runs only (run this job on Sailor's engine to checkpoint it)"
            )

    def state(self) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor, int | None]]:
        """``{key: (weight, exp_avg, exp_avg_sq, tp_dim)}`` of this rank (detached views;
        zero moments before the first step). Raises if AdamW's step count is not
        :attr:`adam_step` (the state would resume a different update)."""
        self.check_checkpointable()
        out: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor, int | None]] = {}
        for key, p in self.keyed_parameters():
            w = p.detach()
            st = self.optimizer.state.get(p, {})
            if not st:
                if self.adam_step > 0:
                    raise RuntimeError(f"{key}: no AdamW state at AdamW step {self.adam_step}")
                out[key] = (w, torch.zeros_like(w), torch.zeros_like(w), tp_dim_of(p))
                continue
            step = st.get("step", 0)
            n = int(step.item() if isinstance(step, torch.Tensor) else step)
            if n != self.adam_step:
                raise RuntimeError(
                    f"{key}: AdamW step {n} != iteration {self.step} minus "
                    f"{self.skipped_steps} skipped"
                )
            out[key] = (w, st["exp_avg"].detach(), st["exp_avg_sq"].detach(), tp_dim_of(p))
        return out

    def scaling_state(self) -> dict[str, Any]:
        """The globals Sailor's engine keeps beside the weights (``Trainer.scaling_state``):
        the precision, the steps skipped, no loss scale (fp32), no non-finite streak (the
        adapter does not skip non-finite steps: a streak a resumed engine checkpoint was in
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
        dropped (fp32 has none), as Sailor's engine drops it without a scaler."""
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
        AdamW moments into the module and the optimizer, at AdamW step :attr:`adam_step`."""
        self.check_checkpointable()
        for key, p in self.keyed_parameters():
            if key not in weights:
                raise KeyError(f"{key}: not in the checkpoint (rank {self.rank})")
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


class DeepSpeedCheckpointIO(SaveIO[DeepSpeedRun], Protocol):
    """What the adapter needs of a checkpoint implementation (called on every rank)."""

    def position(self, root: str, step: int) -> tuple[int, int]:
        """``(step, consumed_samples)`` of the committed checkpoint ``step`` under ``root``."""
        ...

    def restore(self, run: DeepSpeedRun, root: str, step: int) -> None:
        """Load this rank's layers (saved under any layout) and their AdamW moments."""
        ...
