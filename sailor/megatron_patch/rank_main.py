"""``sailor worker``: run one rank of a plan (the process the agent launches).

Usage::

    python -m sailor.megatron_patch.rank_main --plan PLAN.json --rank R --world-size W \\
        --master 127.0.0.1:29500 --steps N [--model MODEL.json | tiny-gpt] \\
        [--progress progress-{rank}.jsonl] [--error-file error-{rank}.json] \\
        [--control control.json] [--ckpt-dir DIR --load-step S] [--cpu-cores 0,2-3] \\
        [--train-config run.yaml] [--in-place | --warm]

Training options come from ``--train-config`` (a ``TrainingConfig`` file, the one the
controller hands every rank): model source (a catalog name, a ModelSpec, or a local
``transformers`` directory of the GPT-2, OPT, GPT-NeoX or Llama family, optionally starting
from its safetensors weights, each rank reading only its layers: ``megatron_patch.hf``),
data, AdamW, LR schedule, clipping, evaluation, precision and metrics. Without one,
``--seed --lr --weight-decay`` set the engine's defaults. ``--model`` (a name, a ModelSpec
file, or a model file ``{"spec", "architecture"}`` that ``hf.model_file`` wrote, so ranks
need not import ``transformers``) wins over the config's model.

``{rank}`` in a path is replaced by the rank. Progress is one JSON object per iteration
(``{"event": "step", "rank", "step", "consumed_samples", "loss", "samples_per_s", "step_s",
"compute_s", "sync_s", "optim_s", "fwd_s", "bwd_s", "p2p_s", "microbatches", "skipped",
"loss_scale", "precision", "time"}``: ``skipped`` says every rank skipped the update for an
inf or NaN gradient (an overflow under ``loss_scale``); ``fwd_s``/``bwd_s`` are this rank's
compute per microbatch, ``p2p_s`` its time in
pipeline exchanges; the agent carries their medians to the controller for online
calibration) plus ``{"event": "ready", "setup_s", ...}`` once the groups and the stage are
built and ``{"event": "done", ...}`` at the end; rank 0 also prints them to stdout. On
failure the first cause goes to the error file (``errors``) and the process exits with
status 1 at once (``os._exit``: never wait on dead peers). In training, with the collective
timeout (``--timeout-s``, default 600 s, NCCL's own), a crashed stage makes every rank exit
within a bounded time (the agent sees a dead rank at once; the controller aborts the rest).
While the world loads at start the ranks wait for each other on the rendezvous store, not
in a collective (:mod:`load_barrier`; so they do before the world's first all-reduce), and
that bound is another: a rank that fails from its world's start to the end of its load is
raised by the others waiting, and ends the others held elsewhere (a collective, their load's
reads) from their heartbeat threads within a beat; one that dies without a word (SIGKILL,
the OOM killer) about ``--load-liveness-s`` (default 60 s) and a beat after its last
heartbeat, whatever its watchers are doing, at any world size; one alive but stuck in its
read only after ``--load-timeout-s`` (default 2 h; none under an agent, whose controller's
LOAD deadline ends it).

Backend (:mod:`devices`): from the plan, not the host: gloo for a plan on ``cpu`` replica
groups (even where CUDA is visible), NCCL for a GPU plan (refused where CUDA is missing);
``--backend gloo`` runs a GPU plan on the CPU. Under NCCL the rank uses GPU ``first_gpu`` +
TP rank of its replica group, checked against the node's GPUs and the other ranks placed
there, made current before the process group starts (``device_id``), and NCCL's async error
handling is set so a dead peer raises instead of aborting the process. A rank that still dies
by a signal leaves its Python stacks in ``<error file>.fault`` (``faulthandler``) and its
parent writes the error record (:func:`errors.signal_failure_record`). ``--cpu-cores``
binds the rank, and the threads it starts, to those cores (:mod:`affinity`); the ``ready``
record reports the cores it runs on (``cpu_cores``).

Agent protocol (``--control``, see :mod:`sailor.megatron_patch.control`): every rank then
also prints ``ready``/``step`` lines, plus ``{"event": "saved", "step"}`` once its part of a
checkpoint is durable (the committer rank: once the manifest is committed) and
``{"event": "stopped", "step"}`` before it exits at the agreed stop step. A rank that reaches
the stop step before any save was asked for holds at that boundary (polling the control file,
in lockstep with the other ranks) until a save request, SIGTERM or ``--pause-timeout-s``.
``--ckpt-dir DIR --load-step S`` resumes from the committed checkpoint of step ``S`` under any
layout: the trainer starts at its step and data position.

``--train-config FILE`` (a :class:`~sailor.schemas.training.TrainingConfig`, YAML or JSON) is
read and validated first, before the backend or any process group starts: a wrong field is a
configuration error naming the field and its value. It gives the model (unless ``--model``),
the seed and AdamW settings, the data set (synthetic or a Megatron indexed dataset, paths
relative to the file) and where rank 0 writes per-step metrics (JSON lines, TensorBoard:
:mod:`sailor.metrics`), the LR schedule, clipping, evaluation and precision, and periodic
checkpoints (``checkpoint.every_steps`` into ``checkpoint.dir`` with its own retention
``keep``, durable before training goes on, reported as ``periodic_checkpoint``; the agent's
save requests keep their own directory).

In-place reconfiguration (``--in-place``; the agent side: docs/runtime.md,
the worker's side: ``docs/training.md``): the process runs *generations*
(:func:`_generation`, one per world; without ``--in-place`` the only one, exactly the worker
as before). At the stop step, once its save is durable, the rank prints ``stopped`` then
``{"event": "held", "rank", "step", "broken": false}``, keeps its trainer and polls its
control file alone for ``{"relayout": {"generation": G, "argv": [...]}}``; a communication
failure in training (a peer died, or ``SIGUSR1``: every wait of ``sailor.comm`` leaves at
once) abandons the world without waiting and holds with ``"broken": true`` and the cause
(no error file). The directive's argv is re-parsed and run as the next generation in this
process: new world, one handshake, then :mod:`~sailor.megatron_patch.relayout` decides per
layer kept / received / checkpoint and :mod:`~sailor.megatron_patch.in_place` exchanges
(one ordered ``batch_isend_irecv``); the ``ready`` line adds ``path: "in_place"``, key
counts, ``bytes_received`` and the phase seconds. ``--warm``: a spare that only waits for
a directive (``{"event": "warm", "pid"}``); a directive without ``--in-place`` (a restart
launch's rank given to a spare) runs as a new process of the restart path would (no
handshake; its generation is its last). Held or warm, SIGTERM exits 0. A failure
inside a relayout is an ordinary failure (error file, exit 1). A process that abandoned a
world ends with ``os._exit`` (blocked works must never be destroyed: ``sailor.comm.abort``).

Checkpoints go through a :class:`CheckpointIO` the caller passes to :func:`main` (this
package may not import ``sailor.checkpoint``); ``sailor worker`` / ``python -m
sailor.training_process`` pass the layer-keyed one of :mod:`sailor.training_process.ckpt_glue`.
The ``sailor`` CLI's ``worker`` subcommand is a thin wrapper around :func:`main`.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import math
import os
import signal
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

_T_START = time.time()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from sailor import catalog  # noqa: E402
from sailor.comm import abort as comm_abort  # noqa: E402
from sailor.comm import api as comm  # noqa: E402
from sailor.comm import strict as strict_comm  # noqa: E402
from sailor.megatron_patch.affinity import (  # noqa: E402
    available_cores,
    bind,
    format_cores,
    parse_cores,
)
from sailor.megatron_patch.boundary import Boundary, Progress, Status, sub_rank  # noqa: E402
from sailor.megatron_patch.checkpoint_io import CheckpointIO  # noqa: E402
from sailor.megatron_patch.data import build_dataset, check_tokenizer, identity_of  # noqa: E402
from sailor.megatron_patch.devices import (  # noqa: E402
    check_rank_device,
    choose_backend,
    cuda_alloc_env,
    local_device,
    nccl_env,
)
from sailor.megatron_patch.engine import (  # noqa: E402
    StepResult,
    Trainer,
)
from sailor.megatron_patch.errors import (  # noqa: E402
    close_fault_file,
    failure_record,
    fault_path,
    write_error_file_within,
)
from sailor.megatron_patch.groups import build_process_groups  # noqa: E402
from sailor.megatron_patch.in_place import (  # noqa: E402
    Held,
    await_directive,
    check_held_data,
    handshake,
)
from sailor.megatron_patch.in_place_steps import (  # noqa: E402
    await_store,
    comm_failure,
    drop_old_grads,
    fill_stage,
    held_line,
    hold_broken,
    leave_process,
    leave_world,
    release,
    warm_up,
)
from sailor.megatron_patch.load_barrier import RECORD_WAIT_S, worker_barrier  # noqa: E402
from sailor.megatron_patch.model_source import (  # noqa: E402
    load_architecture,
    load_model,
    load_train_config,
    model_of,
    train_config,
)
from sailor.megatron_patch.nccl_conf import read_nccl_conf  # noqa: E402
from sailor.megatron_patch.parent_death import die_with_parent  # noqa: E402
from sailor.megatron_patch.precision import job_precision  # noqa: E402
from sailor.megatron_patch.rank_args import (  # noqa: E402
    build_parser,
    check_load_step,
    check_load_waits,
    check_periodic_checkpoints,
)
from sailor.megatron_patch.roles import role_of  # noqa: E402
from sailor.megatron_patch.state import stage_state  # noqa: E402
from sailor.metrics import MetricsLogger, step_metrics  # noqa: E402
from sailor.schemas.plan import Plan  # noqa: E402
from sailor.schemas.training import (  # noqa: E402
    TrainingConfig,
)

_Status = Status  # the name tests and older callers use

__all__ = [
    "CheckpointIO",
    "load_architecture",
    "load_model",
    "main",
    "optimizer_metrics",
    "train_config",
]


def optimizer_metrics(res: StepResult, skipped_steps: int) -> dict[str, float | int]:
    """What the metrics add to a step's throughput figures: the gradient norm (with
    clipping) and, with loss scaling, the scale the step ran under and the steps skipped so
    far (Megatron logs the same; a scale that keeps falling means overflowing gradients);
    without, the steps skipped for non-finite gradients once there is one."""
    out: dict[str, float | int] = {}
    if res.grad_norm is not None:
        out["grad_norm"] = res.grad_norm
    if res.loss_scale is not None:
        out["loss_scale"] = res.loss_scale
    if res.loss_scale is not None or skipped_steps:
        out["skipped_steps"] = skipped_steps
    return out


def _device(backend: str, plan: Plan, rank: int) -> torch.device:
    """The rank's device, made current (before the process group: NCCL binds to it)."""
    if backend != "nccl":
        return torch.device("cpu")
    check_rank_device(plan, rank, torch.cuda.device_count())
    local = local_device(plan, rank)
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def _under(base: Path, path: str) -> str:
    """``path`` taken from ``base`` if it is relative; absolute paths and URLs
    (``s3://bucket/prefix``: a checkpoint root) as they are."""
    return path if "://" in path or Path(path).is_absolute() else str(base / path)


def _metrics_logger(tc: TrainingConfig | None, base: Path, rank: int) -> MetricsLogger | None:
    """Rank 0's metrics logger (the figures are global per iteration), if the config asks."""
    if tc is None or rank != 0:
        return None
    m = tc.metrics
    if m.jsonl is None and m.tensorboard_dir is None:
        return None
    jsonl = base / (sub_rank(m.jsonl, rank) or "") if m.jsonl else None
    tb = base / m.tensorboard_dir if m.tensorboard_dir else None
    return MetricsLogger(jsonl, tb)


@dataclass
class _Outcome:
    """How a generation ended: the exit status, or held for the next generation."""

    code: int
    held: Held | None


def _run_in_place(args: argparse.Namespace, status: Status, ckpt: CheckpointIO | None) -> int:
    """Generations in one process: run one, hold, apply the next directive, and so on."""
    comm_abort.set_polling(True)
    warm_up()
    # the file main's faulthandler writes to: a directive's argv may name another
    fault_of = sub_rank(args.error_file, args.rank) or ""

    def on_usr1(_sig: int, _frame: Any) -> None:
        if status.in_training:  # a held (or warm, or relayouting) rank ignores it
            comm_abort.request_abort()

    def on_term(_sig: int, _frame: Any) -> None:
        if status.holding:
            status.terminated = True
            return
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # as without --in-place: the default
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGUSR1, on_usr1)
    signal.signal(signal.SIGTERM, on_term)
    held: Held | None = None
    generation = -1
    if args.warm:
        status.holding = True
        print(json.dumps({"event": "warm", "pid": os.getpid()}), flush=True)
    else:
        out = _generation(args, status, ckpt, None, generation)
        if out.held is None:
            return leave_process(out.code, fault_of)
        held = out.held
    while True:
        # a warm spare waits for its first directive until told to go (SIGTERM): its agent
        # keeps it for a launch that may come hours later; a held rank waits
        # --pause-timeout-s, then frees its GPU
        wait_s = math.inf if held is None else args.pause_timeout_s
        got = await_directive(
            args.control, generation, args.poll_s, wait_s, lambda: status.terminated
        )
        if got is None:
            if held is not None and held.broken and not status.terminated:
                raise RuntimeError(f"held broken without a relayout directive: {held.cause}")
            # a spare never had a rank: nothing to save, no world to leave
            return leave_process(0, fault_of, at_once=held is None)
        generation, argv = got
        # the directive's own mode: an in-place launch's argv has --in-place; a restart
        # launch's (a spare handed a rank of one) has not, and its other ranks, new
        # processes, run no in-place handshake: taken as in place, this rank waited in one
        # they never join until the LOAD deadline aborted the generation
        args = build_parser().parse_args(argv)
        status.holding = False
        out = _generation(args, status, ckpt, held, generation)
        if out.held is None:
            return leave_process(out.code, fault_of)
        held = out.held


def _allocator_settings() -> None:
    """The caching allocator's settings (``devices.cuda_alloc_env``) for a worker whose parent
    did not start it with them (``sailor worker`` by hand; the agent and ``launch_local``
    do: ``devices.worker_env``). The environment is read once, at the allocator's first
    use, which an import may already have made: where CUDA is present they are also handed
    to the allocator itself, which applies them from then on."""
    added = cuda_alloc_env(os.environ)
    os.environ.update(added)
    if added and torch.cuda.is_available():
        # torch's setter of the allocator's config (torch.cuda.memory._set_allocator_settings,
        # which PyTorch's expandable-segments tests call, forwards to it and is deprecated
        # since the config became device-generic); the old name for an older torch
        setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
        if setter is None:
            setter = torch.cuda.memory._set_allocator_settings
        setter(added["PYTORCH_CUDA_ALLOC_CONF"])


def run(args: argparse.Namespace, status: Status, ckpt: CheckpointIO | None = None) -> int:
    """Run the worker; raises on failure (``main`` turns that into the error file)."""
    _allocator_settings()
    check_load_step(args)
    check_load_waits(args)
    if args.in_place or args.warm:
        return _run_in_place(args, status, ckpt)
    return _generation(args, status, ckpt, None, -1).code


def _generation(
    args: argparse.Namespace,
    status: Status,
    ckpt: CheckpointIO | None,
    held: Held | None,
    generation: int,
) -> _Outcome:
    """One generation: build the world and the stage, train, then finish (``code``) or, with
    ``--in-place``, hold for the next generation (``held``). Without ``--in-place`` this is
    the worker as it always was: the only generation of its process."""
    status.rank, status.error_file = args.rank, sub_rank(args.error_file, args.rank)
    t_gen = time.time()
    teardown_s = leave_world(held) if args.in_place else 0.0
    drop_old_grads(held)
    tc = load_train_config(args.train_config) if args.train_config else None
    # before the plan, the process group and any step: not at the first save, hours in (a
    # relayout directive may name another config: checked per generation)
    check_periodic_checkpoints(
        tc, ckpt is not None, "run `sailor worker` (python -m sailor.training_process)"
    )
    plan = Plan.model_validate_json(Path(args.plan).read_text())
    base = Path(args.train_config).parent if args.train_config else Path.cwd()
    spec, arch, weights = model_of(args, tc, base, plan)
    role = role_of(plan, args.rank)
    if role.world_size != args.world_size:
        raise ValueError(f"--world-size={args.world_size}: the plan has {role.world_size} ranks")
    resume = args.load_step >= 0 and bool(args.ckpt_dir)
    if resume and ckpt is None:
        raise ValueError("--load-step needs a checkpoint implementation (run `sailor worker`)")
    if resume and ckpt is not None:
        args.start_step, args.consumed_samples = ckpt.position(args.ckpt_dir, args.load_step)
    backend = choose_backend(plan, args.backend, torch.cuda.is_available())
    # every backend: on a GPU node each rank would otherwise start a thread per core (8
    # ranks x all cores during init, data and host copies), which torchrun avoids the same
    # way (OMP_NUM_THREADS=1)
    torch.set_num_threads(args.threads)
    device = _device(backend, plan, args.rank)
    # decided from the plan and the config alone, before init_process_group: a plan in
    # another precision than the job's is refused by every rank alike, not by some after
    # the others entered their first collective
    precision = job_precision(plan, spec, device, tc.precision if tc else "auto")
    if backend == "nccl":  # an NVLS setting of NCCL's own files is theirs (nccl_conf)
        os.environ.update(nccl_env(os.environ, read_nccl_conf(os.environ)))
    echo = args.rank == 0 or bool(args.control)
    progress = Progress(sub_rank(args.progress, args.rank), echo=echo)
    cfg = train_config(tc, args)
    if tc is not None and weights is not None:  # a pretrained model reads its own token ids
        check_tokenizer(tc.data, weights, base_dir=base)
    train_data = build_dataset(tc.data, spec, tc.seed, base_dir=base) if tc is not None else None
    eval_data = None
    if tc is not None and tc.eval.every_steps:
        eval_data = build_dataset(tc.data, spec, tc.seed, "validation", base_dir=base)
    metrics = _metrics_logger(tc, base, args.rank)
    _t_start = _T_START
    t0 = time.time()
    if args.in_place and generation >= 0:  # init_s/setup_s from the directive, not the
        _t_start = t_gen  # process start (a process's first generation: from its start)
    if args.in_place and args.rank != 0:
        await_store(args.master, args.timeout_s)
    dist.init_process_group(
        backend,
        init_method=f"tcp://{args.master}",
        rank=args.rank,
        world_size=args.world_size,
        timeout=timedelta(seconds=args.timeout_s),
        device_id=device if device.type == "cuda" else None,
    )
    # from here until every rank has loaded, the others may wait for this rank on the store
    # rather than in a collective: it beats there, and a failure of its own before its load
    # is over (building the stage, the handshake, the load) is written there by main's
    # handler; one name on every rank of this world (a fresh rank and the held ones number
    # their generations differently, their plan and master are the same)
    barrier = worker_barrier(dist.distributed_c10d._get_default_store(), plan.plan_id, args, status)
    status.load_barrier = barrier
    strict = strict_comm.from_env(args.rank, device, args.world_size, comm.current_backend())
    previous_backend = None
    if strict is not None:  # opt-in (tests): record and check every call against NCCL's rules
        previous_backend = comm.install_backend(strict[0])
        if args.in_place:  # one log directory per world (its master address)
            strict = (strict[0], strict[1] / f"world-{args.master.replace(':', '-')}")
    groups = build_process_groups(plan, role, spec.tie_embeddings, args.timeout_s)
    # Under NCCL the first call on a communicator must involve all its ranks before a batched
    # p2p that only some of them post (torch's batch_isend_irecv contract): one world
    # all-reduce here instead of relying on whichever collective happens to come first.
    # Every rank arrives on the store first: one that failed since init_process_group ends
    # the others here with its error, not in this collective at NCCL's timeout (load_barrier).
    barrier.formed(args.timeout_s)
    comm.all_reduce(torch.zeros(1, device=device))
    peers = None
    if args.in_place:
        peers = handshake(held, args.load_step if resume else -1, args.rank, args.world_size)
        if peers.holders:
            if resume and (peers.step, peers.consumed_samples) != (
                args.start_step,
                args.consumed_samples,
            ):
                raise RuntimeError(
                    f"holders at (step, consumed_samples) = ({peers.step}, "
                    f"{peers.consumed_samples}), checkpoint {args.load_step} at "
                    f"({args.start_step}, {args.consumed_samples})"
                )
            args.start_step, args.consumed_samples = peers.step, peers.consumed_samples
        if args.rank not in peers.holders:
            release(held)  # not a source: its state is of no use to the new stage
    fill = peers is not None and bool(peers.holders or resume)
    # every parameter comes from the exchange, a checkpoint or imported weights: the stage is
    # built empty (on meta), not initialised at full size on every TP rank to be overwritten
    empty = fill or (resume and ckpt is not None) or weights is not None
    t_groups = time.time()
    trainer = Trainer(
        plan,
        spec,
        role,
        groups,
        cfg,
        device,
        args.start_step,
        args.consumed_samples,
        precision=precision,
        arch=arch,
        data=train_data,
        eval_data=eval_data,
        empty=empty,
    )
    t_built = time.time()
    if peers is not None and peers.holders:  # the held state's data against this config's
        trainer.data_changes = check_held_data(
            peers, identity_of(trainer.data), cfg.allow_data_change
        )
        if trainer.data_changes and args.rank == 0:
            print(
                "in-place relayout: continued on other data than the held state was trained "
                f"on (allow_data_change): {trainer.data_changes}",
                file=sys.stderr,
                flush=True,
            )
    if peers is not None and peers.scaling is not None:
        trainer.load_scaling_state(peers.scaling)  # before the exchange: its AdamW step
    relayout: dict[str, Any] = {}
    # the ranks that load first wait for the slowest on the store, not in the next
    # collective under the process groups' timeout; a failed or dead rank ends them
    # (load_barrier). A fresh start waits too, with nothing to load: its stage's build (the
    # initial draw, the optimizer: where a first run's out-of-memory comes) is the longest
    # phase before the first step, and a rank failing in it left the others in that step's
    # collectives until the process groups' timeout. At most a poll (1 s) of waiting.
    with barrier.loading():
        if peers is not None and fill:
            relayout = fill_stage(args, trainer, held, peers, ckpt, device, resume)
            relayout["teardown_s"], relayout["build_s"] = teardown_s, t_built - t_groups
        elif resume and ckpt is not None:
            trainer.materialize()  # every parameter restored (a missing one is an error)
            ckpt.restore(trainer, args.ckpt_dir, args.load_step)
        elif weights is not None:
            from sailor.megatron_patch.hf.checkpoint import load_stage

            trainer.materialize()  # every parameter loaded (load_stage refuses a missing one)
            load_stage(trainer.stage, weights)
        t_own = time.time()
    status.load_barrier = None
    release(held)  # the new stage holds everything now: free the old one's GPU memory
    t_loaded = time.time()
    status.in_training, status.step, status.in_iteration = True, trainer.step, False
    progress.emit(
        {
            "event": "ready",
            "rank": args.rank,
            "backend": backend,
            "device": str(device),
            "precision": trainer.precision,
            "init_s": t0 - _t_start,
            "group_setup_s": t_groups - t0,
            "load_s": t_loaded - t_groups,
            "load_wait_s": t_loaded - t_own,
            "setup_s": time.time() - _t_start,
            "start_step": trainer.step,
            "consumed_samples": trainer.consumed_samples,
            "num_groups": groups.num_groups_created,
            "pipeline": role.pipeline,
            "stage": role.stage,
            "tp_rank": role.tp_rank,
            "cpu_cores": format_cores(set(available_cores())),
            "layers": [role.first_layer, role.last_layer],
            **relayout,
            # a checkpoint trained on other data, resumed under allow_data_change
            **({"data_changed": trainer.data_changes} if trainer.data_changes else {}),
        }
    )

    def on_step(res: StepResult) -> None:
        progress.emit(
            {
                "event": "step",
                "rank": args.rank,
                "step": res.step,
                "consumed_samples": res.consumed_samples,
                "loss": res.loss,
                "samples_per_s": res.samples_per_s,
                "step_s": res.step_s,
                "compute_s": res.compute_s,
                "sync_s": res.sync_s,
                "optim_s": res.optim_s,
                "fwd_s": res.fwd_s,
                "bwd_s": res.bwd_s,
                "p2p_s": res.p2p_s,
                "microbatches": res.microbatches,
                "lr": res.lr,
                "grad_norm": res.grad_norm,
                "eval_loss": res.eval_loss,
                "skipped": res.skipped,
                "loss_scale": res.loss_scale,
                "precision": trainer.precision,
                "since_start_s": time.time() - _T_START,
                "time": time.time(),
            }
        )
        if metrics is not None and res.step % metrics_every == 0:
            values = step_metrics(
                plan,
                spec,
                step=res.step,
                step_s=res.step_s,
                loss=res.loss,
                lr=res.lr,
                precision=trainer.precision,
                specs=catalog.gpus(),
            )
            metrics.log(res.step, {**values, **optimizer_metrics(res, trainer.skipped_steps)})

    metrics_every = tc.metrics.every_steps if tc is not None else 1
    periodic = None
    if tc is not None and tc.checkpoint.dir is not None:
        periodic = tc.checkpoint.model_copy(update={"dir": _under(base, tc.checkpoint.dir)})
    boundary = Boundary(args, status, progress, ckpt, device, periodic)
    if args.control:  # every rank has one under an agent: agreed on each iteration's wait
        trainer.control_source = boundary.local_request
    try:
        trainer.run(args.steps, hook=boundary, on_step=on_step)
    except Exception as exc:
        if not (args.in_place and comm_failure(exc)):
            raise
        return _Outcome(0, hold_broken(args, status, trainer, progress, ckpt, generation, exc))
    if metrics is not None:
        metrics.close()
    if ckpt is not None:
        ckpt.close()
    if args.in_place and boundary.stopped_at >= 0:
        if strict is not None:
            strict[0].write(strict[1])
            comm.install_backend(previous_backend or comm.TorchBackend())
        status.in_training, status.holding = False, True
        kept = Held(trainer, args.rank, trainer.step, trainer.consumed_samples, False, generation)
        progress.emit(held_line(kept))
        return _Outcome(0, kept)
    dump = sub_rank(args.dump_state, args.rank)
    if dump:
        torch.save({k: (t.cpu(), d) for k, (t, d) in stage_state(trainer.stage).items()}, dump)
    dump_grads = sub_rank(args.dump_grads, args.rank)
    if dump_grads:
        grads = {
            k: p.grad.detach().cpu()
            for k, p in trainer.stage.keyed_parameters()
            if p.grad is not None
        }
        torch.save(grads, dump_grads)
    progress.emit({"event": "done", "rank": args.rank, "step": trainer.step})
    if strict is not None:
        strict[0].write(strict[1])
    comm.barrier()
    dist.destroy_process_group()
    return _Outcome(0, None)


def main(argv: list[str] | None = None, ckpt: CheckpointIO | None = None) -> int:
    """Entry point; returns the exit status (never returns on failure: exits at once).

    ``ckpt`` saves and restores checkpoints (needed for ``--load-step`` and save requests).
    """
    die_with_parent()  # an agent's worker ends with it (SAILOR_PARENT_PID; parent_death)
    args = build_parser().parse_args(argv)
    err_file = sub_rank(args.error_file, args.rank)
    status = Status(args.rank, err_file)
    if err_file:
        # A fatal signal (NCCL's watchdog abort, a segfault) skips the handler below: leave
        # the Python stacks where the parent looks when it writes the record instead.
        Path(err_file).parent.mkdir(parents=True, exist_ok=True)
        faulthandler.enable(file=fault_path(err_file).open("w"), all_threads=True)
    try:
        if args.cpu_cores is not None:
            # before the process group starts the backend's threads: they inherit the binding
            bind(parse_cores(args.cpu_cores))
        code = run(args, status, ckpt)
        close_fault_file(err_file or "")  # leave_process does it too, before os._exit
        return code
    except BaseException as exc:  # the first cause of any failure is reported
        if status.load_barrier is not None:  # a closed peer's socket: that peer's error;
            # this rank's end is the handler's from here (no heartbeat's event after this one)
            exc = status.load_barrier.claim_end(exc)
        record = failure_record(
            exc, status.rank, status.failed_step, status.in_training, last_step=status.step
        )
        # the event first (stderr is a pipe to the agent), then the record, bounded (a mount
        # may hang or fail), then the others told (peer_cause's look above and fail's store
        # calls wait load_barrier.STORE_WAIT_S at most)
        print(json.dumps({"event": "failed", **record}), file=sys.stderr, flush=True)
        write_error_file_within(status.error_file, record, RECORD_WAIT_S)
        if status.load_barrier is not None:  # the others may be waiting for this rank's load
            status.load_barrier.fail(exc)
        # Never run destructors or barriers that could wait on dead peers.
        os._exit(1)


if __name__ == "__main__":
    sys.exit(main())
