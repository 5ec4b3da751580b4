"""Run a Sailor plan through DeepSpeed's pipeline engine (``deepspeed.pipe.PipelineModule``).

DeepSpeed's engine runs what its topology can express: every pipeline with the same depth
and the same layer partition, one microbatch size and count, no tensor parallelism (its
pipe engine leaves TP to Megatron), one activation-checkpointing setting for all stages.
:func:`deepspeed_layout` (pure) checks a plan against that and returns the DeepSpeed
settings, or raises :class:`UnsupportedPlanError` naming what does not fit; the
heterogeneous plans run on Sailor's own engine (``rank_main``).

What we keep from Sailor in the DeepSpeed run:

- the plan's **uneven partition** (DeepSpeed only offers uniform/parameters/type
  partitioning; :class:`SailorPipelineModule` sets its ``parts`` from the plan);
- **Sailor's rank order** (pipeline-major, ``Plan.ranks()``), through a DeepSpeed
  topology with axes ``("data", "pipe")`` instead of its default ``("pipe", "data")``;
- the **global layer index** as layer position, so DeepSpeed's parameter names
  (``"{layer}.{param}"``) are exactly the keys of ``state.stage_state``;
- the layout-free initialisation and the same data, so its losses match the reference.

Devices and precision, the same rules as the worker's (:mod:`devices`): the backend comes
from the plan (gloo for ``cpu`` replica groups, NCCL for GPUs), a rank's ``LOCAL_RANK`` is
its replica group's ``first_gpu`` (plus the TP rank, 0 here), made current before the
process group starts; :func:`deepspeed_precision` takes the job's precision as the engine does
(the training config's, the plan's recorded one, a model asking fp32: fp32 on a GPU runs
without DeepSpeed's 16-bit section), else bf16 where every GPU type of the plan has it, else
fp16 with dynamic loss scaling; fp32 on the CPU. Step times synchronize the
device before each clock read (CUDA kernels run asynchronously).

Checkpoints: Sailor's own format (``sailor.checkpoint``), through a
:class:`~sailor.megatron_patch.deepspeed_state.DeepSpeedCheckpointIO` that :func:`main` is
given (``python -m sailor.training_process.deepspeed_glue`` passes the layer-keyed one; this
package never imports ``sailor.checkpoint``). The iteration boundary is the worker's
(:class:`~sailor.megatron_patch.boundary.Boundary`): the agent's ``--control`` stop/save
requests (``saved``, ``stopped`` lines) and the training config's periodic checkpoints
(``checkpoint.every_steps``, ``periodic_checkpoint``). Each rank saves its layers' weights and
both AdamW moments (the optimizer is Sailor's AdamW, DeepSpeed only calls its ``step``), with
the step, the data position, the seed and the precision in the same globals as the engine's,
and ``--ckpt-dir --load-step`` resumes from a checkpoint the adapter or the engine wrote under
any layout (the reader relayouts by layer); the ranks that loaded first wait for the others on
the rendezvous store (``load_barrier``, ``--load-timeout-s``, ``--load-liveness-s``), not in
the first collective under ``--timeout-s``, as Sailor's engine does: each rank beats there from
its world's start, and a rank failing before or during its restore (building its module or
optimizer, inside ``deepspeed.initialize``), or dying without a word, ends the others with
its error, whether they wait on the store or are held in a collective. Another precision
than the checkpoint's is refused with the engine's error unless ``allow_precision_change``
(``precision.check_state_precision``), another seed too. In bf16 DeepSpeed steps a
``BF16_Optimizer`` around the AdamW, holding the fp32 master weights and moments in flat
partitions across the data-parallel ranks: the checkpoint holds those masters and moments
by layer key (``deepspeed_master``, DeepSpeed's fragment API), so it resumes here or in
Sailor's engine under any layout as an fp32 one does; the iterations DeepSpeed skips for a
non-finite gradient norm are counted (``skipped_steps``).
fp16 is not mapped (``FP16_UnfusedOptimizer``: ``deepspeed_master``): an fp16 run that may save
or resume (periodic checkpoints, ``--control``, ``--load-step``) is refused by name at start
(:func:`check_checkpoint_precision`), before DeepSpeed starts. Without a checkpoint IO
(``python -m sailor.megatron_patch.deepspeed_adapter``) a resume is refused at start
(:func:`check_args`), as is ``--in-place``/``--warm``.

``--train-config`` is read like the worker's: model (Sailor's own blocks; a ``transformers``
architecture or imported weights are refused), seed, data, AdamW (with ``no_decay``), the
precision check and checkpoints. What the adapter does not run (an LR schedule, clipping,
evaluation, forced loss scaling, metrics files) is refused by field and value
(:func:`check_train_config`) rather than ignored.

Tied embeddings are not mapped (DeepSpeed's ``TiedLayerSpec`` would need the head's norm
split off); use an untied model. deepspeed is imported only inside :func:`run`.

Run one rank: ``python -m sailor.training_process.deepspeed_glue`` (with checkpoints) or
``python -m sailor.megatron_patch.deepspeed_adapter`` (without), with the worker's arguments
(``--plan --rank --world-size --master --steps --model --progress --dump-state --control
--ckpt-dir --load-step --train-config``). Progress lines are the worker's (``ready``,
``step``, ``saved``, ``stopped``, ``done``; on stdout too for rank 0 or under ``--control``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812

from sailor import catalog
from sailor.megatron_patch.bad_labels import LabelWatch, agree_before_update, training_batch
from sailor.megatron_patch.boundary import Boundary, Progress, Status, sub_rank
from sailor.megatron_patch.data import (
    IndexedTokens,
    SyntheticTokens,
    TokenSource,
    build_dataset,
    identity_of,
    vocab_bound,
)
from sailor.megatron_patch.deepspeed_state import DeepSpeedCheckpointIO, DeepSpeedRun
from sailor.megatron_patch.devices import (
    check_rank_device,
    choose_backend,
    cuda_alloc_env,
    local_device,
    nccl_env,
)
from sailor.megatron_patch.engine import make_optimizer
from sailor.megatron_patch.load_barrier import worker_barrier
from sailor.megatron_patch.model import Block, Embedding, Head, init_block_
from sailor.megatron_patch.model_source import load_train_config, model_of, train_config
from sailor.megatron_patch.nccl_conf import read_nccl_conf
from sailor.megatron_patch.optim import param_groups
from sailor.megatron_patch.parent_death import die_with_parent
from sailor.megatron_patch.precision import native_bf16, plan_precision
from sailor.megatron_patch.rank_args import (
    build_parser,
    check_load_step,
    check_load_waits,
    check_periodic_checkpoints,
)
from sailor.megatron_patch.tp_layers import TPContext
from sailor.schemas.device_kind import is_cpu_type
from sailor.schemas.model import ModelSpec
from sailor.schemas.plan import Plan
from sailor.schemas.precision import Precision
from sailor.schemas.training import ScheduleConfig, TrainingConfig

__all__ = [
    "DeepSpeedLayout",
    "Precision",
    "UnsupportedPlanError",
    "check_args",
    "check_checkpoint_precision",
    "check_train_config",
    "deepspeed_config",
    "deepspeed_env",
    "deepspeed_layout",
    "deepspeed_precision",
    "device_sync",
    "main",
    "ready_event",
]


class UnsupportedPlanError(ValueError):
    """The plan needs something DeepSpeed's pipeline engine cannot express (not retryable)."""


@dataclass(frozen=True)
class DeepSpeedLayout:
    """A plan in DeepSpeed's terms."""

    num_stages: int
    data_parallel: int
    parts: tuple[int, ...]
    """Layer boundaries: stage ``s`` owns layers ``parts[s] .. parts[s+1]-1``."""
    micro_batch_size: int
    gradient_accumulation_steps: int
    activation_checkpoint_interval: int


def deepspeed_layout(plan: Plan, spec: ModelSpec | None = None) -> DeepSpeedLayout:
    """DeepSpeed settings of ``plan``, or UnsupportedPlanError saying why there are none;
    with ``spec``, a ValueError unless the plan covers the model's every layer (as Sailor's
    engine refuses: the pipeline is cut at the plan's last layer, and a plan short of the
    head trained the blocks on a cross entropy of hidden states, raising ``Target N is out
    of bounds`` once a label exceeded the hidden size)."""
    if spec is not None and spec.num_all_layers != plan.num_layers:
        raise ValueError(
            f"plan covers {plan.num_layers} layers, model {spec.name!r} has "
            f"{spec.num_all_layers} (embedding + {spec.num_layers} blocks + head)"
        )
    first = plan.pipelines[0]
    for i, p in enumerate(plan.pipelines):
        if p.partition() != first.partition():
            raise UnsupportedPlanError(
                f"pipelines[{i}].partition={p.partition()} differs from {first.partition()}: "
                "DeepSpeed needs one layer partition"
            )
        if (p.microbatch_size, p.num_microbatches) != (
            first.microbatch_size,
            first.num_microbatches,
        ):
            raise UnsupportedPlanError(
                f"pipelines[{i}] runs {p.num_microbatches}x{p.microbatch_size} samples, "
                f"pipelines[0] {first.num_microbatches}x{first.microbatch_size}: DeepSpeed "
                "needs one microbatch size and count"
            )
        for j, s in enumerate(p.stages):
            if s.replica.tp != 1:
                raise UnsupportedPlanError(
                    f"pipelines[{i}].stages[{j}].replica.tp={s.replica.tp}: DeepSpeed's pipe "
                    "engine runs TP=1 (use Sailor's engine or Megatron-core for TP)"
                )
    recompute = {s.recompute for p in plan.pipelines for s in p.stages}
    if len(recompute) > 1:
        raise UnsupportedPlanError("stages differ in recompute: DeepSpeed has one setting")
    parts = (*(s.first_layer for s in first.stages), plan.num_layers)
    return DeepSpeedLayout(
        num_stages=first.depth,
        data_parallel=len(plan.pipelines),
        parts=parts,
        micro_batch_size=first.microbatch_size,
        gradient_accumulation_steps=first.num_microbatches,
        activation_checkpoint_interval=1 if recompute == {True} else 0,
    )


def deepspeed_precision(
    plan: Plan,
    spec: ModelSpec,
    backend: str,
    device_bf16: Callable[[], bool] | None = None,
    requested: str = "auto",
) -> Precision:
    """One training precision for every rank of ``plan`` (pure but for ``device_bf16``).

    fp32 on the CPU (gloo). On GPUs, the job's precision where something fixes it, taken as
    Sailor's engine takes it (``precision.plan_precision``): the training config's
    (``requested``, unless ``'auto'``), else the plan's recorded ``plan.precision``, else a
    model asking fp32 (``spec.precision``); a conflict between them or a GPU type that cannot
    run it is refused by field and value. fp32 on a GPU runs without DeepSpeed's bf16/fp16
    section, so DeepSpeed steps the adapter's AdamW itself and checkpoints work.

    Otherwise (a plan without a recorded precision) bf16 where every GPU type of the plan
    has bf16 units (the catalog's ``peak_tflops_bf16 > 0``; V100, T4, RTX-2080 have none),
    else fp16 with dynamic loss scaling. A GPU type the catalog does not know is then asked
    of the device itself (``device_bf16``, e.g. ``precision.native_bf16``: not emulated);
    without it, it counts as lacking bf16 (fp16 runs everywhere). A planned plan records
    its precision, so this is the rule for hand-written plans.
    """
    if backend != "nccl":
        return "fp32"
    if requested != "auto" or plan.precision is not None or spec.precision == "fp32":
        return plan_precision(plan, spec, requested)
    known = catalog.gpus()
    for gpu_type in sorted({s.replica.gpu_type for p in plan.pipelines for s in p.stages}):
        if is_cpu_type(gpu_type):
            continue
        gpu = known.get(gpu_type)
        has_bf16 = gpu.peak_tflops_bf16 > 0 if gpu else bool(device_bf16 and device_bf16())
        if not has_bf16:
            return "fp16"
    return "bf16"


def deepspeed_config(
    layout: DeepSpeedLayout, plan: Plan, precision: Precision = "fp32"
) -> dict[str, Any]:
    """The DeepSpeed JSON config of a layout (optimizer passed as an object).

    ``precision`` adds DeepSpeed's ``bf16`` section, or its ``fp16`` section with dynamic
    loss scaling (``loss_scale: 0``; DeepSpeed's documented defaults for the window,
    hysteresis and initial scale 2**16; ``min_loss_scale`` 1).
    """
    cfg: dict[str, Any] = {
        "train_batch_size": plan.global_batch_size,
        "train_micro_batch_size_per_gpu": layout.micro_batch_size,
        "gradient_accumulation_steps": layout.gradient_accumulation_steps,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        # DeepSpeed clips the global gradient norm to 1.0 unless told otherwise
        # (runtime/constants.py GRADIENT_CLIPPING_DEFAULT; engine._take_model_step), and
        # Sailor's engine does not clip: with clipping, AdamW sees each step's gradients
        # scaled by another factor and drifts from the reference by ~0.4 lr per element.
        "gradient_clipping": 0.0,
    }
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif precision == "fp16":
        cfg["fp16"] = {
            "enabled": True,
            "loss_scale": 0,
            "initial_scale_power": 16,
            "loss_scale_window": 1000,
            "hysteresis": 2,
            "min_loss_scale": 1,
        }
    return cfg


def deepspeed_env(
    plan: Plan, rank: int, world_size: int, master: str, backend: str
) -> dict[str, str]:
    """The environment DeepSpeed reads for ``rank`` (pure).

    ``LOCAL_RANK`` is the rank's GPU on its node (``first_gpu`` + TP rank), not its global
    rank: DeepSpeed makes ``cuda:LOCAL_RANK`` current. On the CPU it is 0.
    """
    addr, port = master.rsplit(":", 1)
    addr = addr.strip("[]")  # an IPv6 rendezvous: [fd00::17]:29507
    local = local_device(plan, rank) if backend == "nccl" else 0
    return {
        "MASTER_ADDR": addr,
        "MASTER_PORT": port,
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(local),
    }


def device_sync(device: torch.device) -> Callable[[], None]:
    """What to call before reading the clock: wait for the device's queued kernels (a no-op
    on the CPU, where work is done when the call returns)."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


@torch.no_grad()
def _init_layer(module: nn.Module, spec: ModelSpec, layer: int, seed: int) -> None:
    """Draw each parameter of global layer ``layer`` in place, where it is (the layer's
    device), a chunk at a time (``init_rng``): the numbers of Sailor's engine for the same
    seed and parameter key, and no host copy of a whole parameter."""
    for name, p in module.named_parameters():
        init_block_(p.data, spec, f"{layer}.{name}", tuple(p.shape), (0,) * p.dim(), seed)


def _on(device: torch.device | None) -> AbstractContextManager[object]:
    """Allocate on ``device``; None: on the current default device."""
    return contextlib.nullcontext() if device is None else device


class DSEmbedding(Embedding):
    def __init__(self, spec: ModelSpec, seed: int, device: torch.device | None = None) -> None:
        with _on(device):  # allocated, then drawn, on the rank's device
            super().__init__(spec)
        _init_layer(self, spec, 0, seed)


class DSBlock(Block):
    def __init__(
        self, spec: ModelSpec, layer: int, seed: int, device: torch.device | None = None
    ) -> None:
        with _on(device):
            super().__init__(spec, TPContext())
        _init_layer(self, spec, layer, seed)


class DSHead(Head):
    """The head without the loss: DeepSpeed applies ``loss_fn`` to its output."""

    def __init__(self, spec: ModelSpec, seed: int, device: torch.device | None = None) -> None:
        with _on(device):
            super().__init__(spec)
        _init_layer(self, spec, spec.num_all_layers - 1, seed)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        return self.logits(x)


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = logits.float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _screened(
    data: TokenSource, indices: range, labels: LabelWatch
) -> tuple[torch.Tensor, torch.Tensor]:
    """A microbatch, its ids outside the vocabulary noted in ``labels`` (and masked: the
    agreement raises before they are used), not raised on this rank alone."""
    if isinstance(data, IndexedTokens):
        x, y, problem = data.checked_batch(indices)
        if problem:
            labels.note(problem)
    else:
        x, y = data.batch(indices)
    return labels.screen_tokens(x), labels.screen(y)


def _build_module(
    plan: Plan, spec: ModelSpec, layout: DeepSpeedLayout, seed: int, device: torch.device
) -> nn.Module:
    from deepspeed.pipe import LayerSpec, PipelineModule
    from deepspeed.runtime.pipe.topology import ProcessTopology

    class SailorPipelineModule(PipelineModule):  # type: ignore[misc]
        """PipelineModule whose partition is the plan's, not one of DeepSpeed's methods."""

        def _partition_layers(self, method: str = "uniform") -> None:
            self.parts = list(layout.parts)
            stage = self._topo.get_coord(self.global_rank).pipe
            self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])

    # each layer this rank builds is allocated and drawn on its device (DeepSpeed builds
    # them on the host and moves them after)
    layers: list[Any] = [LayerSpec(DSEmbedding, spec, seed, device)]
    layers += [LayerSpec(DSBlock, spec, i, seed, device) for i in range(1, spec.num_layers + 1)]
    layers.append(LayerSpec(DSHead, spec, seed, device))
    # Sailor's rank order: rank = pipeline * depth + stage.
    topo = ProcessTopology(axes=["data", "pipe"], dims=[layout.data_parallel, layout.num_stages])
    module: nn.Module = SailorPipelineModule(
        layers=layers,
        topology=topo,
        loss_fn=_loss,
        activation_checkpoint_interval=layout.activation_checkpoint_interval,
    )
    return module


def check_train_config(tc: TrainingConfig | None) -> None:
    """Refuse, by field and value, what a training config asks that the adapter does not run
    (pure). It runs the config's model (no architecture file or imported weights), seed,
    data, AdamW (lr, betas, eps, weight decay and the kinds exempt from it), precision check
    (``allow_precision_change``), data check (``allow_data_change``) and checkpoints; not an
    LR schedule, clipping, evaluation,
    forced loss scaling or metrics files (each would otherwise be ignored
    silently and the run would drift from the engine's)."""
    if tc is None:
        return
    unsupported: list[tuple[str, object]] = []
    if tc.schedule != ScheduleConfig():
        unsupported.append(("schedule", tc.schedule.model_dump()))
    if tc.clipping.max_norm:
        unsupported.append(("clipping.max_norm", tc.clipping.max_norm))
    if tc.eval.every_steps:
        unsupported.append(("eval.every_steps", tc.eval.every_steps))
    if tc.loss_scaling.mode != "auto":
        unsupported.append(("loss_scaling.mode", tc.loss_scaling.mode))
    if tc.metrics.jsonl or tc.metrics.tensorboard_dir:
        unsupported.append(("metrics", tc.metrics.model_dump(exclude_defaults=True)))
    if unsupported:
        field, value = unsupported[0]
        raise UnsupportedPlanError(
            f"training config {field}={value!r}: the DeepSpeed adapter does not run it "
            "(run this job on Sailor's engine)"
        )


def check_args(args: argparse.Namespace, has_ckpt: bool, tc: TrainingConfig | None = None) -> None:
    """Refuse arguments the adapter cannot honour, by name, at start (pure): in-place
    reconfiguration; ``--load-step`` without ``--ckpt-dir`` and a load timeout or liveness
    that is not a positive number (``rank_args.check_load_step``/``check_load_waits``, the
    engine's checks); and without a checkpoint IO (``has_ckpt``) a resume or the training
    config's periodic checkpoints (``tc``), which would otherwise fail at their step."""
    if args.in_place or args.warm:
        raise UnsupportedPlanError(
            f"--in-place={args.in_place} --warm={args.warm}: the DeepSpeed adapter has no "
            "in-place reconfiguration (it resumes from a checkpoint)"
        )
    check_load_step(args)
    check_load_waits(args)
    if has_ckpt:
        return
    glue = "run `python -m sailor.training_process.deepspeed_glue`"
    if args.load_step >= 0:
        raise UnsupportedPlanError(
            f"load_step={args.load_step} (ckpt_dir={args.ckpt_dir!r}) needs a checkpoint "
            f"implementation: {glue}"
        )
    check_periodic_checkpoints(tc, has_ckpt, glue, UnsupportedPlanError)


def check_checkpoint_precision(
    precision: Precision, args: argparse.Namespace, tc: TrainingConfig | None
) -> None:
    """Refuse at start, by name, an fp16 run that may have to save or resume (pure): periodic
    checkpoints (``checkpoint.every_steps``), a ``--control`` file (the agent may ask it to
    save, at a reconfiguration) or a resume (``--load-step``). In fp16 DeepSpeed steps an
    ``FP16_UnfusedOptimizer`` whose fp32 master copies the adapter does not map
    (``deepspeed_master``): the save would otherwise fail only when it comes, after all the
    steps before it. fp32 and bf16 runs save and resume."""
    if precision != "fp16":
        return
    asks: list[str] = []
    if tc is not None and tc.checkpoint.dir is not None and tc.checkpoint.every_steps:
        asks.append(f"checkpoint.every_steps={tc.checkpoint.every_steps}")
    if args.control:
        asks.append(f"--control={args.control!r} (the agent may ask for a save)")
    if args.load_step >= 0:
        asks.append(f"--load-step={args.load_step}")
    if asks:
        raise UnsupportedPlanError(
            f"precision={precision!r} with {', '.join(asks)}: the DeepSpeed adapter saves and "
            "resumes fp32 and bf16 runs only (in fp16 DeepSpeed's FP16_UnfusedOptimizer keeps "
            "fp32 master copies it does not map to Sailor's checkpoints); set the training "
            "config's precision: bf16 on GPUs that have it, or fp32 (and "
            "allow_precision_change: true for a job that ran in another), or run this job on "
            "Sailor's engine"
        )


def ready_event(
    ds: DeepSpeedRun, backend: str, device: torch.device, load_s: float, load_wait_s: float
) -> dict[str, Any]:
    """The rank's ``ready`` progress line, once its state is built and restored. As the
    engine's worker's: ``data_changed`` when the restore accepted a checkpoint trained on
    other data (``allow_data_change``), which the agent logs (``worker_data_changed``);
    before, only the rank's stderr said it."""
    return {
        "event": "ready",
        "rank": ds.rank,
        "engine": "deepspeed",
        "backend": backend,
        "device": str(device),
        "precision": ds.precision,
        "start_step": ds.step,
        "consumed_samples": ds.consumed_samples,
        "load_s": load_s,
        "load_wait_s": load_wait_s,
        # a checkpoint trained on other data, resumed under allow_data_change
        **({"data_changed": ds.data_changes} if ds.data_changes else {}),
    }


def run(
    argv: list[str] | None = None,
    ckpt: DeepSpeedCheckpointIO | None = None,
    status: Status | None = None,
    precision: Precision | None = None,
) -> int:
    """One rank of a plan on DeepSpeed; progress, saves, stops and state dumps like the
    worker's (``ckpt``: Sailor's checkpoints, needed to resume or save). ``precision`` runs
    in it instead of :func:`deepspeed_precision`'s choice (tests: bf16 on the CPU, where the
    rule says fp32; DeepSpeed's CPU accelerator runs bf16, not fp16). ``--dump-state`` dumps
    the fp32 masters in bf16 (a collective: every rank is given it or none)."""
    args = build_parser().parse_args(argv)
    # before anything touches CUDA (the allocator reads it once; devices.cuda_alloc_env)
    os.environ.update(cuda_alloc_env(os.environ))
    status = status or Status(args.rank, sub_rank(args.error_file, args.rank))
    tc = load_train_config(args.train_config) if args.train_config else None
    check_args(args, ckpt is not None, tc)
    check_train_config(tc)
    plan = Plan.model_validate_json(Path(args.plan).read_text())
    base = Path(args.train_config).parent if args.train_config else Path.cwd()
    spec, arch, weights = model_of(args, tc, base, plan)
    if arch is not None or weights is not None:
        raise UnsupportedPlanError(
            f"model {spec.name!r} comes with an architecture or weights (a transformers "
            "model): the adapter builds Sailor's own blocks, fresh"
        )
    if spec.tie_embeddings:
        raise UnsupportedPlanError(f"model {spec.name!r} ties embeddings: not mapped to DeepSpeed")
    layout = deepspeed_layout(plan, spec)
    resume = args.load_step >= 0 and ckpt is not None  # with --ckpt-dir (check_args)
    if resume and ckpt is not None:
        args.start_step, args.consumed_samples = ckpt.position(args.ckpt_dir, args.load_step)
    backend = choose_backend(plan, args.backend, torch.cuda.is_available())
    torch.set_num_threads(args.threads)
    os.environ.update(deepspeed_env(plan, args.rank, args.world_size, args.master, backend))
    device = torch.device("cpu")
    if backend == "nccl":
        check_rank_device(plan, args.rank, torch.cuda.device_count())
        device = torch.device("cuda", local_device(plan, args.rank))
        torch.cuda.set_device(device)  # before the process group: NCCL binds to it
        os.environ.update(nccl_env(os.environ, read_nccl_conf(os.environ)))
    # decided from the plan, the model and the config alone, before the process group: every
    # rank refuses alike (the engine's rule), not some after the others entered a collective
    requested = tc.precision if tc is not None else "auto"
    if precision is None:
        precision = deepspeed_precision(plan, spec, backend, native_bf16, requested)
    check_checkpoint_precision(precision, args, tc)
    cfg = train_config(tc, args)
    # before the process group, as the engine's worker: a data set refused is refused by
    # every rank alike; and its identity is what the restore compares with the checkpoint's
    data = (
        build_dataset(tc.data, spec, tc.seed, base_dir=base)
        if tc is not None
        else SyntheticTokens(spec.vocab_size, spec.seq_length, cfg.seed)
    )
    sync = device_sync(device)
    from datetime import timedelta

    import deepspeed
    import deepspeed.comm.torch  # the module itself, looked up in sys.modules below

    # ``deepspeed.comm.torch`` as an attribute is shadowed by PyTorch itself; take the module.
    ds_torch_comm = sys.modules["deepspeed.comm.torch"]

    # DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce kernel on first use
    # (measured ~70 s with 4 ranks on this 2-core machine); gloo does the collectives
    # without it, so skip the build.
    ds_torch_comm.build_shm_op = lambda: None  # type: ignore[attr-defined]
    deepspeed.init_distributed(dist_backend=backend, timeout=timedelta(seconds=args.timeout_s))
    # From here until every rank has restored, the others may wait for this rank on the
    # rendezvous store rather than in a collective (load_barrier, as Sailor's engine): it
    # beats there, and main's handler writes any failure of its own (building the module,
    # DeepSpeed's initialisation, the restore) there. DeepSpeed initialised torch's default
    # group, whose store this is; one name on every rank of this world.
    barrier = worker_barrier(
        torch.distributed.distributed_c10d._get_default_store(), plan.plan_id, args, status
    )
    status.load_barrier = barrier
    module = _build_module(plan, spec, layout, cfg.seed, device)
    groups = param_groups(
        module.named_parameters(), cfg.weight_decay, cfg.no_decay, spec.tie_embeddings
    )
    optimizer = make_optimizer(groups, cfg)
    # deepspeed.initialize's first collective (its module broadcast) waits for every rank:
    # they arrive on the store first, and one that failed building its module or optimizer
    # ends the others here with its error; one failing inside initialize ends them from
    # their heartbeat threads (worker_barrier's status), not at NCCL's timeout
    barrier.formed(args.timeout_s)
    engine, _, _, _ = deepspeed.initialize(
        model=module, optimizer=optimizer, config=deepspeed_config(layout, plan, precision)
    )
    ds = DeepSpeedRun(
        plan, args.rank, module, optimizer, engine.optimizer, cfg, precision,
        args.start_step, args.consumed_samples, spec=spec, data=identity_of(data),
    )  # fmt: skip
    t_load = t_own = time.time()
    if resume and ckpt is not None:
        # The next collective (the first boundary's agreement) runs under --timeout-s: the
        # ranks that restored first wait for the slowest on the store instead, and a failed
        # or dead rank ends them. The restore itself holds no collective (a bf16 one writes
        # this rank's fragments).
        with barrier.loading():
            ckpt.restore(ds, args.ckpt_dir, args.load_step)
            t_own = time.time()
    else:  # every rank decides alike: with nothing to load, each still waits (a poll) for
        # every rank's deepspeed.initialize on the store: one failing inside it ends the
        # others here with its error, not in the first step's collectives at NCCL's timeout
        with barrier.loading():
            pass
    status.load_barrier = None
    t_loaded = time.time()
    pipe_idx = args.rank // layout.num_stages
    mbs = layout.micro_batch_size
    echo = args.rank == 0 or bool(args.control)
    progress = Progress(sub_rank(args.progress, args.rank), echo=echo)
    periodic = None
    if tc is not None and tc.checkpoint.dir is not None:
        root = tc.checkpoint.dir
        if "://" not in root and not Path(root).is_absolute():
            root = str(base / root)
        periodic = tc.checkpoint.model_copy(update={"dir": root})
    boundary = Boundary(args, status, progress, ckpt, device, periodic)
    progress.emit(ready_event(ds, backend, device, t_loaded - t_load, t_loaded - t_own))
    status.in_training, status.step = True, ds.step
    stop = boundary(ds)
    labels = LabelWatch(min(spec.vocab_size, vocab_bound(data)))
    while not stop:
        first = ds.consumed_samples + pipe_idx * mbs * layout.gradient_accumulation_steps
        batches = [
            _screened(data, range(first + m * mbs, first + (m + 1) * mbs), labels)
            for m in range(layout.gradient_accumulation_steps)
        ]
        # train_batch runs forward, backward and the update at once, with collectives in
        # between: the ranks agree on bad ids before it, and all raise the same error
        samples = range(ds.consumed_samples, ds.consumed_samples + plan.global_batch_size)
        agree_before_update(labels, device, ds.step + 1, training_batch(samples), pipe_idx)
        sync()
        t0 = time.perf_counter()
        skipped = engine.skipped_steps
        loss = engine.train_batch(data_iter=iter(batches))
        sync()
        dt = time.perf_counter() - t0
        ds.step += 1
        ds.skipped_steps += engine.skipped_steps - skipped  # bf16: a non-finite norm
        ds.consumed_samples += plan.global_batch_size
        progress.emit(
            {
                "event": "step",
                "rank": args.rank,
                "step": ds.step,
                "consumed_samples": ds.consumed_samples,
                "loss": float(loss),
                "samples_per_s": plan.global_batch_size / dt,
                "step_s": dt,
                "engine": "deepspeed",
                "precision": precision,
                "time": time.time(),
            }
        )
        stop = boundary(ds)
    if ckpt is not None:
        ckpt.close()
    if args.dump_state:
        state = {k: (w.cpu(), None) for k, w in ds.weights().items()}
        torch.save(state, args.dump_state.replace("{rank}", str(args.rank)))
    progress.emit({"event": "done", "rank": args.rank, "step": ds.step})
    torch.distributed.barrier()
    return 0


def main(
    argv: list[str] | None = None,
    ckpt: DeepSpeedCheckpointIO | None = None,
    precision: Precision | None = None,
) -> int:
    """Entry point; on failure writes the first cause like the worker and exits 1.

    ``ckpt`` saves and restores Sailor's checkpoints (``training_process.deepspeed_glue``
    passes its own); without one, a resume or a save request is refused. ``precision``:
    :func:`run`'s."""
    die_with_parent()  # an agent's worker ends with it (parent_death)
    import faulthandler

    from sailor.megatron_patch.errors import (
        failure_record,
        fault_path,
        write_error_file_within,
    )
    from sailor.megatron_patch.load_barrier import RECORD_WAIT_S

    args = build_parser().parse_args(argv)
    err = sub_rank(args.error_file, args.rank)
    if err:
        # NCCL's watchdog may abort() the process: leave the Python stacks for the parent.
        Path(err).parent.mkdir(parents=True, exist_ok=True)
        faulthandler.enable(file=fault_path(err).open("w"), all_threads=True)
    status = Status(args.rank, err)
    try:
        return run(argv, ckpt, status, precision)
    except BaseException as exc:  # the first cause of any failure is reported
        if status.load_barrier is not None:  # a closed peer's socket: that peer's error;
            # this rank's end is the handler's from here (no heartbeat's event after this one)
            exc = status.load_barrier.claim_end(exc)
        record = failure_record(
            exc, args.rank, status.failed_step, status.in_training, last_step=status.step
        )
        # the event first, then the record, bounded, as the engine does: a mount may hang
        print(json.dumps({"event": "failed", **record}), file=sys.stderr, flush=True)
        write_error_file_within(err, record, RECORD_WAIT_S)
        if status.load_barrier is not None:  # the others may be waiting for this rank's load
            status.load_barrier.fail(exc)
        os._exit(1)


if __name__ == "__main__":
    sys.exit(main())
