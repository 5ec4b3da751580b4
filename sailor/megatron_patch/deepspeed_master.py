"""The fp32 master weights and AdamW moments of a bf16 DeepSpeed run, by parameter.

In bf16 DeepSpeed's pipe engine steps a ``BF16_Optimizer`` (``deepspeed/runtime/
bf16_optimizer.py``) around the adapter's AdamW: the module's parameters are bf16 views into
one flat bf16 buffer per parameter group, and the AdamW steps one flat fp32 *partition* per
group instead (``fp32_groups_flat_partition``): the fp32 master of this data-parallel rank's
1/DP slice of the flat buffer (padded to a multiple of 2·DP elements), its moments in
``optimizer.state[partition]``, created by the first step and then linked to each parameter's
fragment (``_lazy_init_hp_params_optimizer_state``). A parameter may span several ranks'
partitions, so its full master is assembled with one sum over its data-parallel group.

DeepSpeed's fragment API covers this optimizer (``deepspeed.utils``: ``safe_set_full_fp32_param``,
``safe_set_full_optimizer_state`` write this rank's fragment, no collective; each parameter's
``_hp_mapping`` locates its fragment in the flat partition and its moments), so nothing here
maps the flat groups by hand: what it adds is the AdamW step count (one per flat partition,
which the API does not reach) and the moments' creation and linking on a resume before the
first step, when the API has no fragment to write into.

Reading (:func:`read_full`) is a collective over each parameter's data-parallel group: every
rank of a stage reads its parameters in the same order, one collective per tensor. It is
DeepSpeed's ``get_full_hp_param`` (behind ``safe_get_full_fp32_param`` and
``safe_get_full_optimizer_state``: a zero fp32 buffer of the parameter's size, this rank's
fragment copied in, all-reduced over ``_dp_group``) split in two, for three reasons:

- memory: each full tensor goes to the host as soon as it is summed, and only if the rank
  keeps it (the layers it writes); the device holds one parameter's full fp32 tensor at a
  time, not the masters and both moments of the whole stage (12 B per parameter on every
  data-parallel rank: DP times the optimizer state the rank keeps, ~42 GB for a 3.5B stage
  at DP 8, an OOM at the first save);
- traffic: a save sums each tensor with a reduce to the rank that writes its layer, not an
  all-reduce that delivers every full tensor to every rank of the group (DP times what the
  save writes), and the writer's host copy is the one the checkpoint writes (``into``: the
  checkpointer's copies of the last save, lent; no second host copy);
- failure: a rank whose own part fails (a device or host allocation, a fragment read) still
  takes part in every later collective with a zero buffer and raises at the end, so its
  peers are never left in a collective it skipped (they would wait there, and it in the
  save's next collective, until the process group's timeout). A failure *in* a collective
  is raised at once: the group is broken, and its peers fail in it too.

deepspeed is imported inside the functions only (the adapter imports it only when it runs).

fp16 is not here: DeepSpeed steps an ``FP16_UnfusedOptimizer`` around a torch AdamW, whose
per-parameter fp32 copies the fragment API does not cover, whose construction takes one
AdamW step on zero gradients (the step count is one ahead of the updates, and weight decay
was applied once), and whose loss-scale window counts one step more than Sailor's
``LossScaler``; none of that runs on DeepSpeed's CPU accelerator (``Type fp16 is not
supported on your device``) to be tested here.
"""

from __future__ import annotations

import importlib.metadata
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

__all__ = [
    "LINKED",
    "MOMENTS",
    "UnlinkedParametersError",
    "adam_steps",
    "is_bf16_optimizer",
    "load_moments",
    "read_full",
    "set_master",
]

MOMENTS = ("exp_avg", "exp_avg_sq")
"""The AdamW state read and written beside each master (DeepSpeed's optimizer state keys)."""


LINKED = ("_hp_mapping", "_dp_group", "get_full_hp_param")
"""What ``link_hp_params`` gives each parameter and this module reads: ``_hp_mapping`` (its
fragment of the flat partition, or None) and ``_dp_group`` are DeepSpeed's private
attributes (0.1x, ``deepspeed/utils/mixed_precision_linkage.py``), so their absence is
checked by name rather than found as an ``AttributeError`` partway through a save."""


class UnlinkedParametersError(ValueError):
    """DeepSpeed's ``BF16_Optimizer`` did not give the parameters what this module reads
    (:data:`LINKED`): another DeepSpeed version than the ones this was written against."""


def is_bf16_optimizer(engine_optimizer: Any, params: Sequence[nn.Parameter]) -> bool:
    """Whether ``engine_optimizer`` is DeepSpeed's ``BF16_Optimizer`` (duck-typed: deepspeed
    is not imported to ask); raises :class:`UnlinkedParametersError`, naming what is missing
    and the DeepSpeed version, if it is one whose parameters lack what ``link_hp_params``
    gives them (:data:`LINKED`)."""
    if type(engine_optimizer).__name__ != "BF16_Optimizer" or not hasattr(
        engine_optimizer, "fp32_groups_flat_partition"
    ):
        return False
    missing = [a for a in LINKED if not all(hasattr(p, a) for p in params)]
    if missing:
        raise UnlinkedParametersError(
            f"DeepSpeed {_deepspeed_version()}: its BF16_Optimizer's parameters lack "
            f"{', '.join(missing)} (link_hp_params), which reading and writing a bf16 run's "
            "fp32 masters and moments needs; run this DeepSpeed version in fp32, or the job "
            "on Sailor's engine"
        )
    return True


def _deepspeed_version() -> str:
    try:
        return importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        return "(version unknown)"


def _partitions(engine_optimizer: Any) -> list[torch.Tensor]:
    return list(engine_optimizer.fp32_groups_flat_partition)


def adam_steps(engine_optimizer: Any) -> list[int]:
    """The AdamW step count of each flat fp32 partition (0 for one without state yet)."""
    out = []
    for flat in _partitions(engine_optimizer):
        step = engine_optimizer.optimizer.state.get(flat, {}).get("step", 0)
        out.append(int(step.item() if isinstance(step, torch.Tensor) else step))
    return out


def _local_part(p: nn.Parameter, kind: str | None) -> torch.Tensor:
    """``p``'s full size in fp32, zero but for this rank's fragment of ``kind`` (None: the
    master; else an AdamW state key), as ``get_full_hp_param`` builds it before its sum."""
    buf = torch.zeros(p.numel(), dtype=torch.float32, device=p.device)
    linked: Any = p  # ``link_hp_params`` gave it ``_hp_mapping``
    mapping = linked._hp_mapping  # None: none of p lies in this rank's partition
    if mapping is not None:
        addr = mapping.lp_fragment_address
        buf.narrow(0, addr.start, addr.numel).copy_(mapping.get_hp_fragment(kind))
    return buf


def _lighter(exc: Exception) -> Exception:
    """``exc`` without the locals of the frames it was raised through (its traceback stays):
    the buffer of a failed part would otherwise stay allocated, through the finished
    frame's locals, for the rest of the save's collectives."""
    traceback.clear_frames(exc.__traceback__)
    return exc


def _group_ranks(group: Any) -> list[int]:
    """The global ranks of a data-parallel group (DeepSpeed's ``_dp_group``: a torch
    process group, or None for the world)."""
    import torch.distributed as dist

    if group is None:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(group))


@torch.no_grad()
def read_full(
    keyed: Sequence[tuple[str, nn.Parameter]],
    kinds: Sequence[str | None],
    writer: Callable[[str], int | None],
    failure: Exception | None = None,
    into: Mapping[str, Sequence[torch.Tensor]] | None = None,
) -> dict[str, list[torch.Tensor]]:
    """The full fp32 ``kinds`` (None: the master; ``MOMENTS``) of each parameter, on the
    host, by key, on the rank that keeps it: one collective over the parameter's
    data-parallel group per parameter and kind, in ``keyed`` order, on every rank of the
    stage alike (it is given the same ``keyed``, ``kinds`` and ``writer``).

    ``writer(key)`` is the global rank that keeps ``key`` (a save's writer of its layer):
    the sum is a reduce to that rank alone, and the others keep nothing of it (an
    all-reduce delivered every full tensor to every rank of the group, DP times the bytes a
    save writes). None: every rank of the group keeps it (an all-reduce). A writer outside
    the parameter's group is refused by name before any collective (on every rank of the
    group alike). ``into`` (by key, one host tensor per kind, e.g. a checkpointer's copies of
    the last save, lent for this one) is where a kept tensor is copied, where its shape and
    dtype fit; else it is a new host tensor (on the CPU the summed buffer itself).

    A failure of this rank's own part (or ``failure``, one from before the call) makes the
    rest of its contributions zeros: it keeps nothing more, takes part in every remaining
    collective, and is raised once they are all done (module docstring). Only a zero buffer
    this rank cannot even allocate leaves it out of the rest (raised at once, with the
    first failure as its cause)."""
    from deepspeed import comm

    me = comm.get_rank()
    dsts: list[int | None] = []
    for key, p in keyed:
        dst = writer(key)
        if dst is not None:
            ranks = _group_ranks(getattr(p, "_dp_group", None))
            if dst not in ranks:
                raise ValueError(
                    f"{key}: writer rank {dst} is not in its data-parallel group {ranks}"
                )
        dsts.append(dst)
    out: dict[str, list[torch.Tensor]] = {}
    for (key, p), dst in zip(keyed, dsts, strict=True):
        kept = dst is None or dst == me
        linked: Any = p  # ``link_hp_params`` gave it ``_dp_group``
        dest = list((into or {}).get(key, ())) if kept else []
        for i, kind in enumerate(kinds):
            buf: torch.Tensor | None = None
            if failure is None:
                try:
                    buf = _local_part(p, kind)
                except Exception as exc:  # raised after the last collective
                    failure = _lighter(exc)
                    out.clear()  # nothing of it is saved: free the host copies now
            if buf is None:
                try:
                    buf = torch.zeros(p.numel(), dtype=torch.float32, device=p.device)
                except Exception as exc:
                    raise exc from failure
            if dst is None:
                comm.all_reduce(buf, group=linked._dp_group)
            else:  # ``dst`` is a global rank (torch.distributed.reduce's), not a group rank
                comm.reduce(buf, dst, group=linked._dp_group)
            if failure is None and kept:
                try:
                    # on the host now: the device holds one parameter's tensor at a time
                    out.setdefault(key, []).append(_on_host(buf.view(p.shape), dest, i))
                except Exception as exc:
                    failure = _lighter(exc)
                    out.clear()
            del buf
    if failure is not None:
        raise failure
    return out


def _on_host(full: torch.Tensor, dest: Sequence[torch.Tensor], i: int) -> torch.Tensor:
    """``full`` in host memory: copied into ``dest[i]`` where it fits, else moved (the
    tensor itself if it is on the host already)."""
    if i < len(dest):
        d = dest[i]
        if d.device.type == "cpu" and d.shape == full.shape and d.dtype == full.dtype:
            return d.copy_(full)
    return full.to("cpu")


@torch.no_grad()
def set_master(p: nn.Parameter, value: torch.Tensor) -> None:
    """Make ``value`` (full, fp32) the master of ``p``: this rank's fragment of it, and the
    bf16 parameter itself (what ``update_lp_params`` would gather: no collective)."""
    from deepspeed.utils import safe_set_full_fp32_param

    value = value.to(p.device, torch.float32)
    safe_set_full_fp32_param(p, value)
    p.copy_(value.to(p.dtype))


@torch.no_grad()
def load_moments(
    engine_optimizer: Any,
    keyed: Sequence[tuple[str, nn.Parameter]],
    moments: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    adam_step: int,
) -> None:
    """Make ``moments`` (full, by key) the AdamW state of ``keyed`` at ``adam_step``.

    ``adam_step`` 0 drops any state (the first step creates it). Otherwise each flat
    partition gets its step count and, before the first step, zero moments that are then
    linked to the parameters' fragments as that step would link them; the fragments are
    then written through DeepSpeed's API (the partition's alignment padding stays zero)."""
    from deepspeed.utils import safe_set_full_optimizer_state

    state = engine_optimizer.optimizer.state
    if adam_step <= 0:
        for flat in _partitions(engine_optimizer):
            state.pop(flat, None)
        return
    for flat in _partitions(engine_optimizer):
        st = state.setdefault(flat, {})
        for key in MOMENTS:
            if key not in st:
                st[key] = torch.zeros_like(flat)
        st["step"] = torch.tensor(float(adam_step))
    # BF16_Optimizer links the fragments after its first step; a resume writes them first
    engine_optimizer._lazy_init_hp_params_optimizer_state()
    for key, p in keyed:
        for name, value in zip(MOMENTS, moments[key], strict=True):
            safe_set_full_optimizer_state(p, value.to(p.device, torch.float32), name)
