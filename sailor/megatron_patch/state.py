"""The checkpoint interface of a stage: layer-keyed parameters and optimizer state.

What the checkpoint code (``sailor.checkpoint``) relies on; keep it stable:

- :func:`stage_state` -> ``{"{global_layer}.{param_name}": (local_tensor, tp_dim)}``. The
  tensor is this rank's shard (a detached view of the live fp32 master weight); ``tp_dim``
  is the dimension it is sharded along (None: every TP rank holds the full tensor). TP rank
  ``r`` of ``t`` holds chunk ``r`` of ``t`` equal contiguous chunks along ``tp_dim``.
- :func:`optimizer_state` -> ``{name: {"exp_avg": t, "exp_avg_sq": t, "step": int,
  "tp_dim": d}}`` for AdamW, sharded exactly like the parameter.
- :func:`gather_full` / :func:`shard` turn TP shards into full tensors and back.
- :func:`load_full_state` loads full (unsharded) tensors, keyed the same way, into any
  layout: each rank slices out its shard. Names a stage does not own are ignored; names
  it owns and that are missing raise ``KeyError``. :func:`load_full_params` loads the
  names given and leaves the others (an import that reads one layer at a time).

With tied embeddings both copies (``"0.wte.weight"`` and ``"{L+1}.lm_head.weight"``) are
reported; they are equal after every step. A checkpoint may store either or both.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from sailor.megatron_patch.model import GPTStage, shard
from sailor.megatron_patch.tp_layers import tp_dim_of

__all__ = [
    "gather_full",
    "key_layer",
    "load_full_params",
    "load_full_state",
    "optimizer_state",
    "place",
    "shard",
    "stage_state",
]


def key_layer(key: str) -> int:
    """The global layer of a key ``"{global_layer}.{param_name}"``."""
    return int(key.split(".", 1)[0])


def stage_state(stage: GPTStage) -> dict[str, tuple[torch.Tensor, int | None]]:
    """This rank's parameters keyed by ``"{global_layer}.{param_name}"`` with their TP dim."""
    return {name: (p.detach(), tp_dim_of(p)) for name, p in stage.keyed_parameters()}


def optimizer_state(stage: GPTStage, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, Any]]:
    """AdamW moments and step count per parameter name (empty dict before the first step)."""
    out: dict[str, dict[str, Any]] = {}
    for name, p in stage.keyed_parameters():
        st = optimizer.state.get(p, {})
        if not st:
            continue
        step = st.get("step", 0)
        out[name] = {
            "exp_avg": st["exp_avg"].detach(),
            "exp_avg_sq": st["exp_avg_sq"].detach(),
            "step": int(step.item() if isinstance(step, torch.Tensor) else step),
            "tp_dim": tp_dim_of(p),
        }
    return out


def place(p: torch.nn.Parameter, t: torch.Tensor) -> None:
    """Make ``t`` the tensor of ``p``, which stays the same object (the optimizer keys its
    state by it). A parameter on ``meta`` (a stage built empty) cannot take another device's
    tensor as its ``data``: it is swapped with a parameter of ``t`` that carries its
    attributes (the TP dim). ``t`` must have ``p``'s shape and dtype and is not copied."""
    if t.shape != p.shape or t.dtype != p.dtype:
        raise ValueError(
            f"tensor of shape {tuple(t.shape)} and {t.dtype} for a parameter of "
            f"{tuple(p.shape)} and {p.dtype}"
        )
    if not p.is_meta:
        p.data = t
        return
    new = torch.nn.Parameter(t, requires_grad=p.requires_grad)
    new.__dict__.update(p.__dict__)  # the swap exchanges attribute dicts too
    torch.utils.swap_tensors(p, new)  # type: ignore[no-untyped-call]


def gather_full(shards: Sequence[torch.Tensor], tp_dim: int | None) -> torch.Tensor:
    """The full tensor from the shards of TP ranks ``0..t-1`` (in order)."""
    if tp_dim is None or len(shards) == 1:
        return shards[0]
    return torch.cat(list(shards), dim=tp_dim)


@torch.no_grad()
def load_full_params(stage: GPTStage, params: Mapping[str, torch.Tensor]) -> None:
    """Load the full tensors ``params`` holds (some of the stage's, keyed as
    :func:`load_full_state` keys them) into this rank's shards; the others are left as they
    are. Sliced where the tensor is, then copied and cast: only the shard moves."""
    tp = stage.tp
    for name, p in stage.keyed_parameters():
        full = params.get(name)
        if full is not None:
            p.copy_(shard(full, tp_dim_of(p), tp.size, tp.rank))


@torch.no_grad()
def load_full_state(
    stage: GPTStage,
    params: Mapping[str, torch.Tensor],
    optimizer: torch.optim.Optimizer | None = None,
    moments: Mapping[str, Mapping[str, Any]] | None = None,
) -> None:
    """Load full tensors (and optionally full AdamW moments) into this rank's shards."""
    tp = stage.tp
    for name, p in stage.keyed_parameters():
        dim = tp_dim_of(p)
        # sliced on the tensor's device, then copied (and cast): only the shard moves
        p.copy_(shard(params[name], dim, tp.size, tp.rank))
        if optimizer is None or moments is None or name not in moments:
            continue
        m = moments[name]
        optimizer.state[p] = {
            "step": torch.tensor(float(m["step"])),
            "exp_avg": shard(m["exp_avg"], dim, tp.size, tp.rank).to(p.device).clone(),
            "exp_avg_sq": shard(m["exp_avg_sq"], dim, tp.size, tp.rank).to(p.device).clone(),
        }
