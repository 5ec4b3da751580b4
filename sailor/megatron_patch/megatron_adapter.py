"""Map a plan onto Megatron-core's parallel state (pure), and apply it when it is installed.

Megatron-core's ``parallel_state.initialize_model_parallel`` assumes one TP degree, one
pipeline depth and one data-parallel degree for the whole world, ranks ordered with TP
fastest, then data parallel, then pipeline (its default ``order="tp-cp-ep-dp-pp"``), and
an uneven split expressed as layers of the first and last stage with the rest even.
:func:`megatron_layout` checks a plan against that and returns the settings plus the
rank permutation between Sailor's order (``Plan.ranks()``: pipeline-major, then stage,
then TP rank) and Megatron's; plans that need mixed TP, different partitions or per-pipeline
microbatches raise :class:`UnsupportedPlanError` and run on Sailor's engine instead.

:func:`initialize_megatron` imports megatron.core only when called (optional dependency:
megatron-core >= 0.17 needs Python 3.12, 0.16.1 imports on 3.11, and its schedules need
CUDA, so nothing here runs it on this CPU machine). This module never imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sailor.schemas.plan import Plan

__all__ = ["MegatronLayout", "UnsupportedPlanError", "initialize_megatron", "megatron_layout"]


class UnsupportedPlanError(ValueError):
    """The plan needs something Megatron-core's parallel state cannot express."""


@dataclass(frozen=True)
class MegatronLayout:
    """A plan in Megatron-core's terms."""

    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    data_parallel_size: int
    num_layers: int
    """Transformer blocks (Sailor's global layers minus embedding and head)."""
    num_layers_in_first_pipeline_stage: int | None
    num_layers_in_last_pipeline_stage: int | None
    micro_batch_size: int
    num_microbatches: int
    megatron_rank_of_sailor_rank: tuple[int, ...]
    """``megatron_rank_of_sailor_rank[r]``: the rank Megatron must see for Sailor rank ``r``."""

    def sailor_rank_of_megatron_rank(self, rank: int) -> int:
        return self.megatron_rank_of_sailor_rank.index(rank)

    def tensor_parallel_groups(self) -> list[list[int]]:
        """Megatron's TP groups, in Megatron ranks."""
        tp, pp, dp = self._dims()
        return [[s * dp * tp + d * tp + t for t in range(tp)] for s in range(pp) for d in range(dp)]

    def pipeline_groups(self) -> list[list[int]]:
        tp, pp, dp = self._dims()
        return [[s * dp * tp + d * tp + t for s in range(pp)] for d in range(dp) for t in range(tp)]

    def data_parallel_groups(self) -> list[list[int]]:
        tp, pp, dp = self._dims()
        return [[s * dp * tp + d * tp + t for d in range(dp)] for s in range(pp) for t in range(tp)]

    def _dims(self) -> tuple[int, int, int]:
        return (
            self.tensor_model_parallel_size,
            self.pipeline_model_parallel_size,
            self.data_parallel_size,
        )


def megatron_layout(plan: Plan) -> MegatronLayout:
    """Megatron-core settings of ``plan``, or UnsupportedPlanError saying why there are none."""
    first = plan.pipelines[0]
    tps = {s.replica.tp for p in plan.pipelines for s in p.stages}
    if len(tps) != 1:
        raise UnsupportedPlanError(f"TP degrees {sorted(tps)}: Megatron-core needs one TP degree")
    for i, p in enumerate(plan.pipelines):
        if p.partition() != first.partition():
            raise UnsupportedPlanError(
                f"pipelines[{i}].partition={p.partition()} differs from {first.partition()}"
            )
        if (p.microbatch_size, p.num_microbatches) != (
            first.microbatch_size,
            first.num_microbatches,
        ):
            raise UnsupportedPlanError(
                f"pipelines[{i}] runs {p.num_microbatches}x{p.microbatch_size} samples: "
                "Megatron-core needs one microbatch size and count"
            )
    tp, pp, dp = tps.pop(), first.depth, len(plan.pipelines)
    blocks = plan.num_layers - 2
    # Megatron counts transformer blocks per stage; Sailor's stage 0 also holds the
    # embedding (global layer 0) and the last stage the head (global layer L+1).
    per_stage = list(first.partition())
    per_stage[0] -= 1
    per_stage[-1] -= 1
    if pp == 1:
        first_n = last_n = None
    else:
        middle = per_stage[1:-1]
        if len(set(middle)) > 1:
            raise UnsupportedPlanError(
                f"blocks per middle stage {middle}: Megatron-core splits the middle evenly"
            )
        if any(n < 0 for n in per_stage) or (middle and middle[0] == 0):
            raise UnsupportedPlanError(f"blocks per stage {per_stage}: a stage without blocks")
        first_n = per_stage[0] if not middle or per_stage[0] != middle[0] else None
        last_n = per_stage[-1] if not middle or per_stage[-1] != middle[0] else None
        if not middle and per_stage[0] == per_stage[-1]:
            first_n = last_n = None
    perm = tuple(s * dp * tp + d * tp + t for d, s, t in plan.ranks())
    return MegatronLayout(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        data_parallel_size=dp,
        num_layers=blocks,
        num_layers_in_first_pipeline_stage=first_n,
        num_layers_in_last_pipeline_stage=last_n,
        micro_batch_size=first.microbatch_size,
        num_microbatches=first.num_microbatches,
        megatron_rank_of_sailor_rank=perm,
    )


def initialize_megatron(layout: MegatronLayout) -> Any:
    """Initialise megatron.core's parallel state for ``layout`` (torch.distributed must be
    initialised with Megatron's rank, i.e. ``layout.megatron_rank_of_sailor_rank[rank]``).

    Raises ImportError with the install hint when megatron-core is not installed.
    """
    try:
        from megatron.core import parallel_state
    except ImportError as exc:
        raise ImportError(
            "megatron-core is optional and not installed (pip install megatron-core==0.16.1 "
            "on Python 3.11; its schedules need CUDA)"
        ) from exc
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tensor_model_parallel_size,
        pipeline_model_parallel_size=layout.pipeline_model_parallel_size,
    )
    return parallel_state
