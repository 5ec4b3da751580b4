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
"compute_s", "sync_s", "optim_s", "fwd_s", "bwd_s", "p2p_s", "microbatches", "precision",
"time"}``: ``fwd_s``/``bwd_s`` are this rank's compute per microbatch, ``p2p_s`` its time in
pipeline exchanges; the agent carries their medians to the controller for online
calibration) plus ``{"event": "ready", "setup_s", ...}`` once the groups and the stage are
built and ``{"event": "done", ...}`` at the end; rank 0 also prints them to stdout. On
failure the first cause goes to the error file (``errors``) and the process exits with
status 1 at once (``os._exit``: never wait on dead peers), so with the short collective
timeout (``--timeout-s``, default 60 s) a crashed stage makes every rank exit within a
bounded time.

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
a directive (``{"event": "warm", "pid"}``). Held or warm, SIGTERM exits 0. A failure
inside a relayout is an ordinary failure (error file, exit 1). A process that abandoned a
world ends with ``os._exit`` (blocked works must never be destroyed: ``sailor.comm.abort``).

Checkpoints go through a :class:`CheckpointIO` the caller passes to :func:`main` (this
package may not import ``sailor.checkpoint``); ``sailor worker`` / ``python -m
sailor.training_process`` pass the layer-keyed one of :mod:`sailor.training_process.ckpt_glue`.
The ``sailor`` CLI's ``worker`` subcommand is a thin wrapper around :func:`main`.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol, TextIO

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
from sailor.megatron_patch.architecture import Architecture  # noqa: E402
from sailor.megatron_patch.control import (  # noqa: E402
    ControlRequest,
    agree,
    agree_dir,
    read_control,
)
from sailor.megatron_patch.data import build_dataset  # noqa: E402
from sailor.megatron_patch.devices import (  # noqa: E402
    check_rank_device,
    choose_backend,
    local_device,
    nccl_error_env,
)
from sailor.megatron_patch.engine import (  # noqa: E402
    StepResult,
    TrainConfig,
    Trainer,
    make_optimizer,
)
from sailor.megatron_patch.errors import (  # noqa: E402
    InjectedFailureError,
    classify,
    failure_record,
    fault_path,
    write_error_file,
)
from sailor.megatron_patch.groups import build_process_groups  # noqa: E402
from sailor.megatron_patch.in_place import (  # noqa: E402
    Held,
    Peers,
    await_directive,
    exchange,
    handshake,
)
from sailor.megatron_patch.model import TINY_MODELS, tiny_model  # noqa: E402
from sailor.megatron_patch.precision import job_precision  # noqa: E402
from sailor.megatron_patch.relayout import schedule  # noqa: E402
from sailor.megatron_patch.roles import role_of  # noqa: E402
from sailor.megatron_patch.state import stage_state  # noqa: E402
from sailor.metrics import MetricsLogger, step_metrics  # noqa: E402
from sailor.schemas.model import ModelSpec  # noqa: E402
from sailor.schemas.plan import Plan  # noqa: E402
from sailor.schemas.training import (  # noqa: E402
    BuiltinModel,
    CheckpointConfig,
    HuggingFaceModel,
    SpecFileModel,
    TrainingConfig,
    parse_training_config,
)

__all__ = [
    "CheckpointIO",
    "build_parser",
    "load_architecture",
    "load_model",
    "main",
    "train_config",
]


class CheckpointIO(Protocol):
    """What the worker needs of a checkpoint implementation (called on every rank)."""

    def position(self, root: str, step: int) -> tuple[int, int]:
        """``(step, consumed_samples)`` of the committed checkpoint ``step`` under ``root``."""
        ...

    def restore(self, trainer: Trainer, root: str, step: int) -> None:
        """Load this rank's layers, sliced for its TP rank, and its AdamW moments."""
        ...

    def restore_layers(self, trainer: Trainer, root: str, step: int, layers: list[int]) -> None:
        """Like ``restore`` for ``layers`` (a subset of this rank's) only: an in-place
        relayout reads what no live rank holds."""
        ...

    def save(self, trainer: Trainer, root: str, keep: int | None = None) -> float:
        """Snapshot now (collective), persist in the background; returns the stall seconds.
        ``keep``: committed checkpoints kept under ``root`` (older ones deleted after the
        commit); None: the implementation's default."""
        ...

    def wait(self) -> None:
        """Block until this rank's part of the save in flight is durable (and committed)."""
        ...

    def close(self) -> None:
        """Finish the save in flight and release threads."""
        ...

    def reset(self) -> None:
        """Forget everything tied to the current world without waiting (it was abandoned:
        a save in flight may wait on dead peers); the next save starts afresh."""
        ...


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sailor worker", description="Run one rank of a plan.")
    p.add_argument("--plan", required=True, help="Plan JSON file.")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--master", required=True, help="ADDR:PORT of the rendezvous store.")
    p.add_argument("--steps", type=int, default=10**9, help="Iterations to run at most.")
    p.add_argument("--model", default=None, help="ModelSpec JSON file or a tiny model name.")
    p.add_argument("--start-step", type=int, default=0)
    p.add_argument("--consumed-samples", type=int, default=0, help="Global data position.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--dump-grads", default=None, help="torch.save the last step's gradients.")
    p.add_argument("--timeout-s", type=float, default=60.0, help="Collective/p2p timeout.")
    p.add_argument("--backend", choices=["gloo", "nccl"], default=None)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads on CPU.")
    p.add_argument("--progress", default=None, help="JSON-lines progress file.")
    p.add_argument("--error-file", default=None, help="Where the first cause is written.")
    p.add_argument("--dump-state", default=None, help="torch.save the final stage_state here.")
    p.add_argument("--fail-at-step", type=int, default=None, help="Testing: raise there.")
    p.add_argument(
        "--fail-relayout",
        default=None,
        metavar="FILE",
        help="Testing: fail the first in-place relayout of a held rank (after its new world "
        "formed, before the exchange) on any process of this job that finds no FILE; FILE is "
        "created first, so exactly one relayout fails.",
    )
    p.add_argument(
        "--abort-at-step",
        type=int,
        default=None,
        help="Testing: abort() there (SIGABRT, as NCCL's watchdog does: no Python exception).",
    )
    p.add_argument("--control", default=None, help="Agent control file (stop/save requests).")
    p.add_argument("--ckpt-dir", default="", help="Checkpoint root to resume from.")
    p.add_argument("--load-step", type=int, default=-1, help="Committed step to resume; -1 none.")
    p.add_argument(
        "--pause-timeout-s", type=float, default=600.0, help="Hold at a stop step this long."
    )
    p.add_argument(
        "--poll-s", type=float, default=0.02, help="Control-file poll while holding at a stop."
    )
    p.add_argument(
        "--cpu-cores",
        default=None,
        help="Bind this rank (and the threads it starts) to these cores, e.g. 0 or 0,2-3.",
    )
    p.add_argument(
        "--train-config",
        default=None,
        help="TrainingConfig file (YAML/JSON): model, data, optimizer, metrics; see "
        "`sailor schema training-config`.",
    )
    p.add_argument(
        "--in-place",
        action="store_true",
        help="Take part in in-place reconfiguration: hold after the stop step or a "
        "communication failure and run the next generation a relayout directive gives.",
    )
    p.add_argument(
        "--warm",
        action="store_true",
        help="A spare: import, build nothing, wait for a relayout directive on --control "
        "(--plan/--rank/--world-size/--master are then placeholders).",
    )
    p.add_argument(
        "--min-step-s",
        type=float,
        default=0.0,
        help="Pace iterations to at least this long (tests: leave CPU to the control plane).",
    )
    return p


def load_model(arg: str | None, plan: Plan) -> ModelSpec:
    """A ModelSpec from a JSON file, a tiny model name, or the plan's model name."""
    name = arg or plan.model
    if name in TINY_MODELS:
        return tiny_model(name, plan.global_batch_size)
    path = Path(name)
    if not path.exists():
        raise ValueError(f"--model={name!r}: neither a file nor a tiny model {sorted(TINY_MODELS)}")
    raw = json.loads(path.read_text())
    spec = ModelSpec.model_validate(raw["spec"] if "architecture" in raw else raw)
    if spec.global_batch_size != plan.global_batch_size:
        spec = spec.model_copy(update={"global_batch_size": plan.global_batch_size})
    return spec


def load_architecture(arg: str | None) -> Architecture | None:
    """The ``Architecture`` of a model file ``{"spec": ..., "architecture": ...}`` (written by
    ``hf.checkpoint.model_file``); None for a plain ModelSpec file or a tiny model."""
    if not arg or not Path(arg).is_file():
        return None
    raw = json.loads(Path(arg).read_text())
    return Architecture(**raw["architecture"]) if "architecture" in raw else None


def load_train_config(path: str) -> TrainingConfig:
    """The training config of ``--train-config``; a wrong field is a ``ValueError`` naming
    the file, the field and its value (a configuration error: not retried)."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"--train-config={path!r}: cannot read ({exc.strerror or exc})") from exc
    return parse_training_config(text, path)


def train_config(tc: TrainingConfig | None, args: argparse.Namespace) -> TrainConfig:
    """The engine's ``TrainConfig``: from the training config, else ``--seed/--lr/
    --weight-decay`` with the engine's defaults."""
    if tc is None:
        return TrainConfig(seed=args.seed, lr=args.lr, weight_decay=args.weight_decay)
    return TrainConfig.of(tc)


def _config_model(
    tc: TrainingConfig, base: Path, plan: Plan
) -> tuple[ModelSpec, Architecture | None, Path | None]:
    """The model of the config's source: ``(spec, architecture, weights directory)``."""
    src = tc.model
    gbs = {"global_batch_size": plan.global_batch_size}
    if isinstance(src, BuiltinModel):
        if src.name in TINY_MODELS:
            return tiny_model(src.name, plan.global_batch_size), None, None
        return catalog.model(src.name).model_copy(update=gbs), None, None
    if isinstance(src, SpecFileModel):
        if src.spec is not None:
            return src.spec.model_copy(update=gbs), None, None
        path = str(base / (src.path or ""))
        return load_model(path, plan), load_architecture(path), None
    # A Hugging Face directory: its config.json through transformers (seconds per rank;
    # launchers that start many ranks resolve it once into a model file: hf.model_file).
    from sailor.megatron_patch.hf.checkpoint import load_model as load_hf

    root = base / src.path
    spec, arch = load_hf(root, src.seq_length, plan.global_batch_size)
    return spec, arch, root if src.load_weights else None


def _model(
    args: argparse.Namespace, tc: TrainingConfig | None, base: Path, plan: Plan
) -> tuple[ModelSpec, Architecture | None, Path | None]:
    """The model: ``--model`` (a name, a ModelSpec file or a model file with its
    architecture) wins, else the training config's source, else the plan's model name."""
    if args.model is None and tc is not None:
        return _config_model(tc, base, plan)
    src = tc.model if tc is not None else None
    weights = base / src.path if isinstance(src, HuggingFaceModel) and src.load_weights else None
    return load_model(args.model, plan), load_architecture(args.model), weights


def _sub(path: str | None, rank: int) -> str | None:
    return path.replace("{rank}", str(rank)) if path else None


class _Progress:
    def __init__(self, path: str | None, echo: bool) -> None:
        self._f: TextIO | None = None
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._f = Path(path).open("a")  # noqa: SIM115 - open for the whole run
        self._echo = echo

    def emit(self, obj: dict[str, Any]) -> None:
        line = json.dumps(obj)
        if self._f is not None:
            self._f.write(line + "\n")
            self._f.flush()
        if self._echo:
            print(line, flush=True)


def _device(backend: str, plan: Plan, rank: int) -> torch.device:
    """The rank's device, made current (before the process group: NCCL binds to it)."""
    if backend != "nccl":
        return torch.device("cpu")
    check_rank_device(plan, rank, torch.cuda.device_count())
    local = local_device(plan, rank)
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


class _Status:
    """Where the worker is, for the failure record."""

    def __init__(self, rank: int = -1, error_file: str | None = None) -> None:
        self.in_training = False
        self.step = -1
        self.rank = rank
        """The rank of the current generation (in-place: it changes)."""
        self.error_file = error_file
        """Where the current generation's first cause goes."""
        self.holding = False
        """In-place: held (or warm), waiting for a directive; SIGTERM then exits 0."""
        self.terminated = False


class _Boundary:
    """The iteration-boundary hook: injected failure, control requests, save, stop, hold."""

    def __init__(
        self,
        args: argparse.Namespace,
        status: _Status,
        progress: _Progress,
        ckpt: CheckpointIO | None,
        device: torch.device,
        periodic: CheckpointConfig | None = None,
    ) -> None:
        self.args, self.status, self.progress, self.ckpt = args, status, progress, ckpt
        self.device = device
        self.periodic = periodic if periodic is not None and periodic.every_steps else None
        self.saved_requests: set[int] = set()
        self.pending_save = -1
        self.last_saved = -1
        self.stopped_at = -1
        self.last_boundary = time.monotonic()

    def _request(self) -> ControlRequest:
        if not self.args.control:
            return ControlRequest()
        return agree(read_control(self.args.control), self.device)

    def _finish_save(self) -> None:
        if self.pending_save < 0 or self.ckpt is None:
            return
        self.ckpt.wait()
        self.last_saved, self.pending_save = self.pending_save, -1
        self.progress.emit({"event": "saved", "rank": self.args.rank, "step": self.last_saved})

    def _periodic_save(self, tr: Trainer) -> None:
        """The training config's checkpoint every ``every_steps`` (its own directory and
        retention, apart from the agent's): a save that is durable before training goes on,
        reported as ``periodic_checkpoint`` (not ``saved``: the agent's protocol is about its
        own requests). Every rank takes the same decision from the step alone."""
        p = self.periodic
        if p is None or p.dir is None or tr.step == self.args.start_step or tr.step % p.every_steps:
            return
        if self.ckpt is None:
            raise RuntimeError("checkpoint.every_steps needs a checkpoint implementation")
        self.ckpt.save(tr, p.dir, keep=p.keep)
        self.ckpt.wait()
        self.progress.emit(
            {"event": "periodic_checkpoint", "rank": self.args.rank, "step": tr.step, "dir": p.dir}
        )

    def _maybe_save(self, tr: Trainer, req: ControlRequest, holding: bool) -> None:
        if not req.wants_save or req.save_step in self.saved_requests:
            return
        if tr.step < req.save_step and not holding:
            return
        self.saved_requests.add(req.save_step)
        root = agree_dir(req.save_dir)
        if not root or self.ckpt is None:
            raise RuntimeError(f"save of step {tr.step} requested without a checkpoint dir")
        self.ckpt.save(tr, root)
        self.pending_save = tr.step

    def __call__(self, tr: Trainer) -> bool:
        self.status.step = tr.step
        a = self.args
        if a.min_step_s > 0:
            left = a.min_step_s - (time.monotonic() - self.last_boundary)
            if left > 0:
                time.sleep(left)
            self.last_boundary = time.monotonic()
        if a.fail_at_step is not None and tr.step == a.fail_at_step:
            raise InjectedFailureError(f"injected failure at step {tr.step} on rank {a.rank}")
        if a.abort_at_step is not None and tr.step == a.abort_at_step:
            os.abort()
        # The save in flight overlapped one iteration; report it once durable.
        self._finish_save()
        self._periodic_save(tr)
        req = self._request()
        self._maybe_save(tr, req, holding=False)
        if req.wants_stop and tr.step >= req.stop_at_step:
            self._hold(tr, req)
            return True
        return bool(tr.step >= a.start_step + a.steps)

    def _hold(self, tr: Trainer, req: ControlRequest) -> None:
        """At the stop step: wait (in lockstep) until a save of this step is durable."""
        # A poll count, not a clock: every rank must leave the loop at the same poll, since
        # each poll is a collective.
        polls = int(self.args.pause_timeout_s / self.args.poll_s)
        while self.pending_save < 0 and self.last_saved < tr.step and polls > 0:
            polls -= 1
            time.sleep(self.args.poll_s)
            req = self._request()
            self._maybe_save(tr, req, holding=True)
        self._finish_save()
        self.stopped_at = tr.step
        self.progress.emit({"event": "stopped", "rank": self.args.rank, "step": tr.step})


def _metrics_logger(tc: TrainingConfig | None, base: Path, rank: int) -> MetricsLogger | None:
    """Rank 0's metrics logger (the figures are global per iteration), if the config asks."""
    if tc is None or rank != 0:
        return None
    m = tc.metrics
    if m.jsonl is None and m.tensorboard_dir is None:
        return None
    jsonl = base / (_sub(m.jsonl, rank) or "") if m.jsonl else None
    tb = base / m.tensorboard_dir if m.tensorboard_dir else None
    return MetricsLogger(jsonl, tb)


@dataclass
class _Outcome:
    """How a generation ended: the exit status, or held for the next generation."""

    code: int
    held: Held | None


def _comm_failure(exc: BaseException) -> bool:
    """A failure of the world (a peer died or the world was abandoned), not of this rank."""
    if isinstance(exc, comm_abort.CommAbortedError):
        return True
    return not isinstance(exc, InjectedFailureError) and classify(exc, True) == "peer"


def _held_line(h: Held) -> dict[str, Any]:
    line: dict[str, Any] = {"event": "held", "rank": h.old_rank, "step": h.step}
    line["broken"] = h.broken
    if h.broken:
        line["cause"] = h.cause
    return line


def _hold_broken(
    args: argparse.Namespace,
    status: _Status,
    trainer: Trainer,
    progress: _Progress,
    ckpt: CheckpointIO | None,
    generation: int,
    exc: BaseException,
) -> Held:
    """Leave a failed world at once (no waiting on dead peers) and hold, broken."""
    status.in_training, status.holding = False, True
    comm_abort.abandon_world()
    comm_abort.clear_abort()
    if ckpt is not None:
        ckpt.reset()
    comm.install_backend(comm.TorchBackend())  # a strict backend's log is of a dead world
    cause = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
    h = Held(None, args.rank, trainer.step, trainer.consumed_samples, True, generation, cause)
    progress.emit(_held_line(h))
    return h


def _teardown(held: Held | None) -> float:
    """Leave the previous generation's world (held unbroken: still initialised, idle)."""
    t = time.perf_counter()
    if held is not None and not held.broken and dist.is_initialized():
        dist.destroy_process_group()
    return time.perf_counter() - t


def _relayout(
    args: argparse.Namespace,
    trainer: Trainer,
    held: Held | None,
    peers: Peers,
    ckpt: CheckpointIO | None,
    device: torch.device,
    resume: bool,
) -> dict[str, Any]:
    """Fill the new stage: kept and received layers (every rank takes part in the
    exchange), then the layers no live rank holds from checkpoint ``--load-step``."""
    if args.fail_relayout and held is not None:
        mark = Path(args.fail_relayout)
        with contextlib.suppress(FileExistsError):
            mark.open("x").close()
            raise InjectedFailureError(f"injected relayout failure on rank {args.rank}")
    sched = schedule(peers.old_plan, peers.holders, trainer.plan)
    source = held.trainer if held is not None and args.rank in peers.holders else None
    t = time.time()
    st = exchange(trainer, source, sched, trainer.step, device)
    t_transfer = time.time()
    layers = st.checkpoint_layers
    if layers:
        if not resume or ckpt is None:
            raise RuntimeError(
                f"layers {layers} of rank {args.rank}: no live holder and no checkpoint "
                "(--ckpt-dir/--load-step)"
            )
        if layers == list(trainer.role.layers):
            ckpt.restore(trainer, args.ckpt_dir, args.load_step)
        else:
            ckpt.restore_layers(trainer, args.ckpt_dir, args.load_step, layers)
    n_ckpt = sum(1 for k, _p in trainer.stage.keyed_parameters() if int(k.split(".")[0]) in layers)
    return {
        "path": "in_place",
        "kept_keys": st.kept_keys,
        "received_keys": st.received_keys,
        "checkpoint_keys": n_ckpt,
        "bytes_received": st.bytes_received,
        "transfer_s": t_transfer - t,
        "load_s": time.time() - t_transfer,
    }


def _warm_up() -> None:
    """Pay torch's lazy imports ahead of need: the first AdamW built in a process imports
    ``torch._dynamo`` (1.53 s of a fresh rank's 1.72 s stage build, measured on this
    2-core machine), which a warm spare should not pay after its directive."""
    make_optimizer([torch.nn.Parameter(torch.zeros(1))], TrainConfig())


def _run_in_place(args: argparse.Namespace, status: _Status, ckpt: CheckpointIO | None) -> int:
    """Generations in one process: run one, hold, apply the next directive, and so on."""
    comm_abort.set_polling(True)
    _warm_up()

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
            return _leave(out.code)
        held = out.held
    while True:
        got = await_directive(
            args.control, generation, args.poll_s, args.pause_timeout_s, lambda: status.terminated
        )
        if got is None:
            if held is not None and held.broken and not status.terminated:
                raise RuntimeError(f"held broken without a relayout directive: {held.cause}")
            return _leave(0)
        generation, argv = got
        args = build_parser().parse_args(argv)
        args.in_place = True
        status.holding = False
        out = _generation(args, status, ckpt, held, generation)
        if out.held is None:
            return _leave(out.code)
        held = out.held


def _leave(code: int) -> int:
    """The end of an in-place process: with abandoned worlds, no destructors (they could
    join threads blocked on dead peers: ``sailor.comm.abort``)."""
    if comm_abort.abandoned():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if dist.is_initialized():  # held unbroken, told to exit: the idle world goes
        dist.destroy_process_group()
    return code


def run(args: argparse.Namespace, status: _Status, ckpt: CheckpointIO | None = None) -> int:
    """Run the worker; raises on failure (``main`` turns that into the error file)."""
    if args.in_place or args.warm:
        return _run_in_place(args, status, ckpt)
    return _generation(args, status, ckpt, None, -1).code


def _generation(
    args: argparse.Namespace,
    status: _Status,
    ckpt: CheckpointIO | None,
    held: Held | None,
    generation: int,
) -> _Outcome:
    """One generation: build the world and the stage, train, then finish (``code``) or, with
    ``--in-place``, hold for the next generation (``held``). Without ``--in-place`` this is
    the worker as it always was: the only generation of its process."""
    status.rank, status.error_file = args.rank, _sub(args.error_file, args.rank)
    t_gen = time.time()
    teardown_s = _teardown(held) if args.in_place else 0.0
    tc = load_train_config(args.train_config) if args.train_config else None
    plan = Plan.model_validate_json(Path(args.plan).read_text())
    base = Path(args.train_config).parent if args.train_config else Path.cwd()
    spec, arch, weights = _model(args, tc, base, plan)
    role = role_of(plan, args.rank)
    if role.world_size != args.world_size:
        raise ValueError(f"--world-size={args.world_size}: the plan has {role.world_size} ranks")
    resume = args.load_step >= 0 and bool(args.ckpt_dir)
    if resume and ckpt is None:
        raise ValueError("--load-step needs a checkpoint implementation (run `sailor worker`)")
    if resume and ckpt is not None:
        args.start_step, args.consumed_samples = ckpt.position(args.ckpt_dir, args.load_step)
    backend = choose_backend(plan, args.backend, torch.cuda.is_available())
    if backend == "gloo":
        torch.set_num_threads(args.threads)
    device = _device(backend, plan, args.rank)
    if backend == "nccl":
        os.environ.update(nccl_error_env(os.environ))
    echo = args.rank == 0 or bool(args.control)
    progress = _Progress(_sub(args.progress, args.rank), echo=echo)
    cfg = train_config(tc, args)
    train_data = build_dataset(tc.data, spec, tc.seed, base_dir=base) if tc is not None else None
    eval_data = None
    if tc is not None and tc.eval.every_steps:
        eval_data = build_dataset(tc.data, spec, tc.seed, "validation", base_dir=base)
    metrics = _metrics_logger(tc, base, args.rank)
    _t_start = _T_START
    t0 = time.time()
    if args.in_place and generation >= 0:  # init_s/setup_s from the directive, not the
        _t_start = t_gen  # process start (a process's first generation: from its start)
    dist.init_process_group(
        backend,
        init_method=f"tcp://{args.master}",
        rank=args.rank,
        world_size=args.world_size,
        timeout=timedelta(seconds=args.timeout_s),
        device_id=device if device.type == "cuda" else None,
    )
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
        precision=job_precision(plan, spec, device, tc.precision if tc else "auto"),
        arch=arch,
        data=train_data,
        eval_data=eval_data,
    )
    t_built = time.time()
    relayout: dict[str, Any] = {}
    if peers is not None and (peers.holders or resume):
        relayout = _relayout(args, trainer, held, peers, ckpt, device, resume)
        relayout["teardown_s"], relayout["build_s"] = teardown_s, t_built - t_groups
    elif resume and ckpt is not None:
        ckpt.restore(trainer, args.ckpt_dir, args.load_step)
    elif weights is not None:
        from sailor.megatron_patch.hf.checkpoint import load_stage

        load_stage(trainer.stage, weights)
    t_loaded = time.time()
    status.in_training, status.step = True, trainer.step
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
                "precision": trainer.precision,
                "since_start_s": time.time() - _T_START,
                "time": time.time(),
            }
        )
        if metrics is not None and res.step % metrics_every == 0:
            metrics.log(
                res.step,
                step_metrics(
                    plan,
                    spec,
                    step=res.step,
                    step_s=res.step_s,
                    loss=res.loss,
                    lr=res.lr,
                    precision=trainer.precision,
                    specs=catalog.gpus(),
                ),
            )

    metrics_every = tc.metrics.every_steps if tc is not None else 1
    periodic = None
    if tc is not None and tc.checkpoint.dir is not None:
        periodic = tc.checkpoint.model_copy(update={"dir": str(base / tc.checkpoint.dir)})
    boundary = _Boundary(args, status, progress, ckpt, device, periodic)
    try:
        trainer.run(args.steps, hook=boundary, on_step=on_step)
    except Exception as exc:
        if not (args.in_place and _comm_failure(exc)):
            raise
        return _Outcome(0, _hold_broken(args, status, trainer, progress, ckpt, generation, exc))
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
        progress.emit(_held_line(kept))
        return _Outcome(0, kept)
    dump = _sub(args.dump_state, args.rank)
    if dump:
        torch.save({k: (t.cpu(), d) for k, (t, d) in stage_state(trainer.stage).items()}, dump)
    dump_grads = _sub(args.dump_grads, args.rank)
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
    args = build_parser().parse_args(argv)
    err_file = _sub(args.error_file, args.rank)
    status = _Status(args.rank, err_file)
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
        if err_file:
            faulthandler.disable()
            with contextlib.suppress(OSError):
                if fault_path(err_file).stat().st_size == 0:
                    fault_path(err_file).unlink()
        return code
    except BaseException as exc:  # the first cause of any failure is reported
        record = failure_record(exc, status.rank, status.step, status.in_training)
        write_error_file(status.error_file, record)
        print(json.dumps({"event": "failed", **record}), file=sys.stderr, flush=True)
        # Never run destructors or barriers that could wait on dead peers.
        os._exit(1)


if __name__ == "__main__":
    sys.exit(main())
