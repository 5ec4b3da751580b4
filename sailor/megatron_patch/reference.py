"""Plain single-process training: the ground truth the engine must match step for step.

No process group, no pipeline, no TP: the whole model (tied embeddings really tied, one
shared matrix) on one device, one forward and backward over the whole global batch per
iteration, ``torch.nn.utils.clip_grad_norm_`` when clipping is on, AdamW with the same
weight-decay groups and learning-rate schedule. It reads the same samples at the same data
positions as the engine and starts from the same layout-free initialisation, so in fp32 the
engine's losses and parameters must agree with it to rounding.

Used by the correctness tests and as the baseline of ``benchmarks/engine_throughput.py``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from sailor.megatron_patch.architecture import Architecture
from sailor.megatron_patch.data import SyntheticTokens, TokenSource
from sailor.megatron_patch.engine import TrainConfig, make_optimizer
from sailor.megatron_patch.model import GPTStage
from sailor.megatron_patch.optim import param_groups
from sailor.schemas.model import ModelSpec

__all__ = ["ReferenceRun", "train_reference"]


@dataclass
class ReferenceRun:
    """Losses per iteration, final full parameters and AdamW moments, seconds per iteration
    (and the parameters and moments after ``params_at`` iterations, when asked for)."""

    losses: list[float] = field(default_factory=list)
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    step_s: list[float] = field(default_factory=list)
    moments: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    """``(exp_avg, exp_avg_sq)`` per key after the last step (empty after 0 steps)."""
    params_at: dict[str, torch.Tensor] = field(default_factory=dict)
    moments_at: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def train_reference(
    spec: ModelSpec,
    global_batch_size: int,
    steps: int,
    cfg: TrainConfig,
    consumed_samples: int = 0,
    microbatch_size: int | None = None,
    arch: Architecture | None = None,
    device: torch.device | None = None,
    data: TokenSource | None = None,
    params_at: int | None = None,
) -> ReferenceRun:
    """Train ``steps`` iterations on one process; ``microbatch_size`` only bounds memory.

    ``arch``: the model family's structure (default the engine's own GPT). ``device`` (default
    the CPU) holds the model and the batches; the initialisation is drawn on the CPU either
    way, so every device starts from the same weights. Returned parameters are on that device.
    ``data``: the samples (default: the engine's synthetic tokens of ``cfg.seed``).
    ``params_at``: also keep the parameters and moments after that many iterations, so a
    caller that needs the losses of a long run and the state of a shorter one (the chaos
    verdict) trains once.
    """
    dev = device or torch.device("cpu")
    model = GPTStage(
        spec, 0, spec.num_all_layers - 1, seed=cfg.seed, tie_in_module=True, arch=arch
    ).to(dev)
    groups = param_groups(
        model.keyed_parameters(), cfg.weight_decay, cfg.no_decay, spec.tie_embeddings
    )
    opt = make_optimizer(groups, cfg)
    if data is None:
        data = SyntheticTokens(spec.vocab_size, spec.seq_length, cfg.seed)
    mbs = microbatch_size or global_batch_size
    run = ReferenceRun()
    pos = consumed_samples
    for k in range(steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        total = 0.0
        for first in range(0, global_batch_size, mbs):
            n = min(mbs, global_batch_size - first)
            x, y = data.batch(range(pos + first, pos + first + n))
            x, y = x.to(dev), y.to(dev)
            loss = model(x, y) * (n / global_batch_size)
            loss.backward()
            total += float(loss.detach())
        if cfg.clip_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad_norm)
        for g in opt.param_groups:
            g["lr"] = cfg.schedule.lr_at(consumed_samples // global_batch_size + k, cfg.lr)
        opt.step()
        pos += global_batch_size
        run.losses.append(total)
        run.step_s.append(time.perf_counter() - t0)
        if len(run.losses) == params_at:
            run.params_at = {k: p.detach().clone() for k, p in model.keyed_parameters()}
            run.moments_at = _moments(model, opt)
    run.params = {k: p.detach().clone() for k, p in model.keyed_parameters()}
    run.moments = _moments(model, opt)
    return run


def _moments(
    model: GPTStage, opt: torch.optim.Optimizer
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return {
        k: (st["exp_avg"].clone(), st["exp_avg_sq"].clone())
        for k, p in model.keyed_parameters()
        if (st := opt.state.get(p))
    }
