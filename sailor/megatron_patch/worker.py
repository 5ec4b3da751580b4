"""``sailor worker``: run one rank of a plan (the process the agent launches).

Usage::

    python -m sailor.megatron_patch.worker --plan PLAN.json --rank R --world-size W \\
        --master 127.0.0.1:29500 --steps N [--model MODEL.json | tiny-gpt] \\
        [--progress progress-{rank}.jsonl] [--error-file error-{rank}.json]

``{rank}`` in a path is replaced by the rank. Progress is one JSON object per iteration
(``{"event": "step", "rank", "step", "consumed_samples", "loss", "samples_per_s", "step_s",
"compute_s", "sync_s", "optim_s", "time"}``) plus ``{"event": "ready", "setup_s", ...}`` once
the groups and the stage are built and ``{"event": "done", ...}`` at the end; rank 0 also
prints them to stdout. On failure the first cause goes to the error file (``errors``) and
the process exits with status 1 at once (``os._exit``: never wait on dead peers), so with
the short collective timeout (``--timeout-s``, default 60 s) a crashed stage makes every
rank exit within a bounded time.

Backend: NCCL when CUDA is available (device ``cuda:LOCAL_RANK``, the replica group's
``first_gpu`` plus the TP rank), else gloo on CPU; ``--backend`` overrides.

The ``sailor`` CLI's ``worker`` subcommand is a thin wrapper around :func:`main`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, TextIO

_T_START = time.time()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from sailor.megatron_patch.engine import StepResult, TrainConfig, Trainer  # noqa: E402
from sailor.megatron_patch.errors import (  # noqa: E402
    InjectedFailureError,
    failure_record,
    write_error_file,
)
from sailor.megatron_patch.groups import build_process_groups  # noqa: E402
from sailor.megatron_patch.model import TINY_MODELS, tiny_model  # noqa: E402
from sailor.megatron_patch.roles import role_of  # noqa: E402
from sailor.megatron_patch.state import stage_state  # noqa: E402
from sailor.schemas.model import ModelSpec  # noqa: E402
from sailor.schemas.plan import Plan  # noqa: E402

__all__ = ["build_parser", "load_model", "main"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sailor worker", description="Run one rank of a plan.")
    p.add_argument("--plan", required=True, help="Plan JSON file.")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--master", required=True, help="ADDR:PORT of the rendezvous store.")
    p.add_argument("--steps", type=int, required=True, help="Iterations to run.")
    p.add_argument("--model", default=None, help="ModelSpec JSON file or a tiny model name.")
    p.add_argument("--start-step", type=int, default=0)
    p.add_argument("--consumed-samples", type=int, default=0, help="Global data position.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--timeout-s", type=float, default=60.0, help="Collective/p2p timeout.")
    p.add_argument("--backend", choices=["gloo", "nccl"], default=None)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads on CPU.")
    p.add_argument("--progress", default=None, help="JSON-lines progress file.")
    p.add_argument("--error-file", default=None, help="Where the first cause is written.")
    p.add_argument("--dump-state", default=None, help="torch.save the final stage_state here.")
    p.add_argument("--fail-at-step", type=int, default=None, help="Testing: raise there.")
    return p


def load_model(arg: str | None, plan: Plan) -> ModelSpec:
    """A ModelSpec from a JSON file, a tiny model name, or the plan's model name."""
    name = arg or plan.model
    if name in TINY_MODELS:
        return tiny_model(name, plan.global_batch_size)
    path = Path(name)
    if not path.exists():
        raise ValueError(f"--model={name!r}: neither a file nor a tiny model {sorted(TINY_MODELS)}")
    spec = ModelSpec.model_validate_json(path.read_text())
    if spec.global_batch_size != plan.global_batch_size:
        spec = spec.model_copy(update={"global_batch_size": plan.global_batch_size})
    return spec


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
    if backend != "nccl":
        return torch.device("cpu")
    pi, si, t = plan.ranks()[rank]
    local = plan.pipelines[pi].stages[si].replica.first_gpu + t
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


class _Status:
    """Where the worker is, for the failure record."""

    def __init__(self) -> None:
        self.in_training = False
        self.step = -1


def run(args: argparse.Namespace, status: _Status) -> int:
    """Run the worker; raises on failure (``main`` turns that into the error file)."""
    plan = Plan.model_validate_json(Path(args.plan).read_text())
    spec = load_model(args.model, plan)
    role = role_of(plan, args.rank)
    if role.world_size != args.world_size:
        raise ValueError(f"--world-size={args.world_size}: the plan has {role.world_size} ranks")
    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "gloo":
        torch.set_num_threads(args.threads)
    progress = _Progress(_sub(args.progress, args.rank), echo=args.rank == 0)
    cfg = TrainConfig(seed=args.seed, lr=args.lr, weight_decay=args.weight_decay)
    t0 = time.time()
    dist.init_process_group(
        backend,
        init_method=f"tcp://{args.master}",
        rank=args.rank,
        world_size=args.world_size,
        timeout=timedelta(seconds=args.timeout_s),
    )
    device = _device(backend, plan, args.rank)
    groups = build_process_groups(plan, role, spec.tie_embeddings, args.timeout_s)
    t_groups = time.time()
    trainer = Trainer(plan, spec, role, groups, cfg, device, args.start_step, args.consumed_samples)
    status.in_training, status.step = True, trainer.step
    progress.emit(
        {
            "event": "ready",
            "rank": args.rank,
            "backend": backend,
            "init_s": t0 - _T_START,
            "group_setup_s": t_groups - t0,
            "setup_s": time.time() - _T_START,
            "num_groups": groups.num_groups_created,
            "pipeline": role.pipeline,
            "stage": role.stage,
            "tp_rank": role.tp_rank,
            "layers": [role.first_layer, role.last_layer],
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
                "since_start_s": time.time() - _T_START,
                "time": time.time(),
            }
        )

    def hook(tr: Trainer) -> bool:
        status.step = tr.step
        if args.fail_at_step is not None and tr.step == args.fail_at_step:
            raise InjectedFailureError(f"injected failure at step {tr.step} on rank {args.rank}")
        return bool(tr.step >= args.start_step + args.steps)

    trainer.run(args.steps, hook=hook, on_step=on_step)
    dump = _sub(args.dump_state, args.rank)
    if dump:
        torch.save({k: (t.cpu(), d) for k, (t, d) in stage_state(trainer.stage).items()}, dump)
    progress.emit({"event": "done", "rank": args.rank, "step": trainer.step})
    dist.barrier()
    dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status (never returns on failure: exits at once)."""
    args = build_parser().parse_args(argv)
    status = _Status()
    try:
        return run(args, status)
    except BaseException as exc:  # the first cause of any failure is reported
        record = failure_record(exc, args.rank, status.step, status.in_training)
        write_error_file(_sub(args.error_file, args.rank), record)
        print(json.dumps({"event": "failed", **record}), file=sys.stderr, flush=True)
        # Never run destructors or barriers that could wait on dead peers.
        os._exit(1)


if __name__ == "__main__":
    sys.exit(main())
