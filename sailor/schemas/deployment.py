"""What a training deployment decides that the cost model prices: its structure.

The same plan can run two ways where engines differ: gradients all-reduced in fp32 or in
16 bits, an activation crossing a TP boundary as t full copies or as slices gathered by the
receiver, an attention mask sent with it or not, blocking or asynchronous sends, separate
all-reduces of the tied embedding and of the loss. :class:`DeploymentStructure` holds those
choices; :class:`~sailor.schemas.calibration.Calibration` is one (the structure it prices)
and a :class:`Deployment` is a named one (the catalog's ``sailor`` engine and
``megatron-deepspeed``, ``sailor.catalog.deployments``).

Two structures matter for a calibration (docs/simulator-model.md, sections 2 and 7):

* the one it *prices*: the deployment being planned or simulated (by default Sailor's engine);
* the one its fit was *made under*: the deployment of the measured runs the constants came
  from (``GPUCalibration.fitted_under``); a replay of those runs, and the accuracy tests,
  simulate with it (``Calibration.as_fitted``).

Values only: nothing here reads a file.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from sailor.schemas._base import Frozen

__all__ = [
    "STRUCTURE_FIELDS",
    "Activations",
    "Deployment",
    "DeploymentStructure",
    "MixedPrecision",
    "ProcessGroups",
]

Activations = Literal["megatron", "engine"]
"""What an estimated transformer block keeps for its backward (``activations`` below)."""

MixedPrecision = Literal["autocast", "fp16_optimizer"]
"""How the framework runs a 16-bit plan (``mixed_precision`` below)."""

ProcessGroups = Literal["engine", "megatron_deepspeed"]
"""Whose process groups a rank's NCCL communicators follow (``process_groups`` below)."""


class DeploymentStructure(Frozen):
    """The deployment choices the simulator prices (defaults: Sailor's engine where the
    planner's search can price it; see ``sailor.catalog`` ``deployments.json``)."""

    sends_attention_mask: bool = Field(
        default=False,
        description=(
            "The pipeline engine sends the causal attention mask (seq x seq, 2 bytes per "
            "element, not split over TP) from every TP rank with every forward activation. "
            "False: Sailor's engine sends activations only, and the measured "
            "Megatron-DeepSpeed runs show no such cost; kept for a deployment that does."
        ),
    )
    p2p_across_tp: Literal["scatter_gather", "full_copies"] = Field(
        default="scatter_gather",
        description=(
            "How an activation crosses a stage boundary with TP > 1. 'scatter_gather' "
            "(Sailor's engine, megatron_patch.roles.boundary_pieces; DeepSpeed's pipe engine "
            "with TP > 1): each sender rank sends 1/t of it and the receiving TP group "
            "all-gathers it inside its node (one copy crosses the link). "
            "'full_copies': each of the receiver's TP ranks gets the whole activation from "
            "one sender (t copies cross the link, no all-gather)."
        ),
    )
    grad_allreduce_bytes: int | None = Field(
        default=None,
        ge=1,
        le=4,
        description=(
            "Bytes per gradient element in the gradient all-reduces. None: what "
            "mixed_precision implies (4 under autocast, the compute dtype's under "
            "fp16_optimizer); set to price another deployment (e.g. the original artifact's "
            "fp32 gradients)."
        ),
    )
    ring_links: Literal["node", "per_gpu"] = Field(
        default="node",
        description=(
            "What a gradient ring's bytes cross. 'node': the TP ranks of a node run their "
            "rings at once over the node's NICs (node-level bytes on the node's curve). "
            "'per_gpu' (the original artifact's model): each rank's ring moves its own "
            "bytes over the link curve of a 1-GPU VM of its type."
        ),
    )
    extra_state_bytes_per_param: float = Field(
        default=0.0,
        ge=0,
        description=(
            "Model-state bytes per parameter beyond the engine's (communication buffers, "
            "extra copies). 0 for the engine; 8 reproduces the original artifact's 24 B per "
            "parameter over DeepSpeed's 16."
        ),
    )
    blocking_p2p: bool = Field(
        default=True,
        description=(
            "Pipeline sends block the sender until the receiver has the message, so a "
            "transfer occupies both stages (DeepSpeed's pipe engine). False: sends are "
            "asynchronous and only the receiver waits; the transfer is a delay on the link "
            "(megatron_patch: isend, blocking recv)."
        ),
    )
    tied_allreduce: bool = Field(
        default=False,
        description=(
            "With tied embeddings, the ranks holding the embedding or the LM head all-reduce "
            "the tied gradient in a collective of its own after the segment all-reduces "
            "(megatron_patch). False: not modelled separately (DeepSpeed's ReduceTiedGrads "
            "is inside the measured sync_fixed_s)."
        ),
    )
    loss_allreduce: bool = Field(
        default=False,
        description=(
            "Every iteration ends with an all-reduce of the loss over all ranks, after the "
            "optimizer step (megatron_patch; it is also the iteration's barrier). False: "
            "not modelled (DeepSpeed reports the loss without a collective in the step)."
        ),
    )
    mixed_precision: MixedPrecision = Field(
        default="autocast",
        description=(
            "How the framework runs a 16-bit plan (Plan.precision bf16 or fp16). 'autocast' "
            "(megatron_patch, the engine that runs Sailor's jobs): fp32 weights, gradients "
            "and optimizer state, gradients all-reduced in fp32, and each in-flight "
            "microbatch keeps a compute-dtype copy of the stage's weights "
            "(schemas.precision). 'fp16_optimizer' (DeepSpeed's FP16_Optimizer, the "
            "framework of the reference plans): 16-bit weights and gradients, gradients "
            "all-reduced in 16 bits, an fp32 master copy, no per-microbatch copies."
        ),
    )

    vocab_parallel: bool = Field(
        default=True,
        description=(
            "The embedding and the LM head are split over a stage's TP ranks by vocabulary, "
            "with a vocab-parallel cross entropy (Megatron, and Sailor's engine: "
            "megatron_patch.vocab_parallel; the default: what imported and estimated layer "
            "sizes describe). False (an engine that replicates them): every TP rank holds "
            "the whole embedding and head, computes the full logits and an fp32 "
            "log-softmax, keeps the log-probabilities for the backward, whose first step "
            "holds the logits' gradient and the log-softmax's beside them (the head's "
            "working set is three times what it keeps)."
        ),
    )

    activations: Activations = Field(
        default="megatron",
        description=(
            "What a transformer block keeps for its backward where the analytic estimate "
            "stands in for a profile (LayerSize source 'estimated'; measured and imported "
            "sizes are what they are). 'megatron' (the default; Megatron without flash "
            "attention): Korthikanti et al.'s s*h*(10 + 24/t + 5*a*s/(h*t)) bytes per sample "
            "in 16 bits, with the attention scores, their softmax and dropout mask. 'engine' "
            "(Sailor's engine, as the catalog's built-in calibration and its 'sailor' "
            "deployment say, megatron_patch.model): fused attention (scaled_dot_product_"
            "attention keeps q, k, v, its output and the log-sum-exp, no seq x seq term), "
            "no dropout, fp32 norm inputs under autocast, the attention's and the MLP's "
            "normalised inputs once each in the compute dtype, and the MLP's activation by "
            "kind "
            "(simulator.estimate_profile)."
        ),
    )

    process_groups: ProcessGroups = Field(
        default="engine",
        description=(
            "Which process groups a rank holds an NCCL communicator of, each priced at "
            "GPUCalibration.communicator_bytes. 'engine' (Sailor's engine, "
            "simulator.process_groups, the layout megatron_patch.groups creates): the world "
            "group (its pipeline p2p too), the rank's TP group and every gradient-sync group "
            "it is in (one per layer segment it holds, more with mixed TP or tied "
            "embeddings). 'megatron_deepspeed': the groups Megatron-DeepSpeed's training "
            "step uses (world, TP, data-parallel, model-parallel, pipeline, one 2-rank group "
            "per pipeline neighbour, the tied embedding's)."
        ),
    )

    def structure(self) -> dict[str, Any]:
        """The structure's fields and values (what :class:`Deployment` and
        ``Calibration.with_deployment`` carry over)."""
        return {name: getattr(self, name) for name in STRUCTURE_FIELDS}

    def same_structure(self, other: DeploymentStructure) -> bool:
        """Whether ``other`` prices every structural choice as this one does."""
        return self.structure() == other.structure()


STRUCTURE_FIELDS: tuple[str, ...] = tuple(DeploymentStructure.model_fields)
"""Names of the structural fields, in declaration order."""


class Deployment(DeploymentStructure):
    """A named deployment: who runs the plan and how (a catalog preset or a user's file)."""

    name: str = Field(
        min_length=1,
        max_length=64,
        pattern=r"^[a-z0-9][a-z0-9_.-]*$",
        description="Short name (lowercase letters, digits, '.', '_', '-'), e.g. 'sailor'.",
    )
    description: str = Field(
        default="", description="What runs the plan, and where each choice comes from."
    )
