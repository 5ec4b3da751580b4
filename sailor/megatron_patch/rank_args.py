"""The command line of one training rank (``rank_main``, ``sailor worker``): ``build_parser``.

Every option a worker takes, with its default and help; ``rank_main`` parses the process's
argv with it, and again each relayout directive's argv (``--in-place``), as does the
DeepSpeed adapter (``deepspeed_adapter``). Parsing, and the checks both share
(:func:`check_load_step`, :func:`check_periodic_checkpoints`): what the options mean is
``rank_main``'s (and its module docstring's) business.
"""

from __future__ import annotations

import argparse

from sailor.megatron_patch.boundary import PERIODIC_SAVE_TIMEOUT_S
from sailor.megatron_patch.in_place import EXCHANGE_BUCKET_BYTES
from sailor.megatron_patch.load_barrier import LIVENESS_S, LOAD_POLL_S, LOAD_TIMEOUT_S
from sailor.schemas.training import TrainingConfig

__all__ = ["build_parser", "check_load_step", "check_load_waits", "check_periodic_checkpoints"]


def check_load_step(args: argparse.Namespace) -> None:
    """Refuse ``--load-step`` >= 0 without ``--ckpt-dir`` (pure): the step names a checkpoint
    to resume from, and without its root the rank would start fresh at step 0 silently. Not
    under ``--in-place``/``--warm``, where a relayout without a checkpoint takes the step the
    held ranks hold (``in_place.handshake``)."""
    if args.load_step >= 0 and not args.ckpt_dir and not (args.in_place or args.warm):
        raise ValueError(
            f"--load-step={args.load_step} without --ckpt-dir: a resume needs the checkpoint "
            "root (give --ckpt-dir, or --load-step -1 to start fresh)"
        )


def check_load_waits(args: argparse.Namespace) -> None:
    """Refuse a load timeout, liveness or poll, or a periodic save's timeout, that is not a
    positive number (pure), at start: not once the world formed and every rank began to
    load (or reached its first save; ``Boundary`` refuses it too, for a caller that builds
    one itself)."""
    for flag, value in (
        ("--load-timeout-s", args.load_timeout_s),
        ("--load-liveness-s", args.load_liveness_s),
        ("--load-poll-s", args.load_poll_s),
        ("--periodic-save-timeout-s", args.periodic_save_timeout_s),
    ):
        if not value > 0:  # NaN too
            raise ValueError(f"{flag}={value}: must be > 0 seconds")


def check_periodic_checkpoints(
    tc: TrainingConfig | None,
    has_ckpt: bool,
    fix: str,
    error: type[ValueError] = ValueError,
) -> None:
    """Refuse the training config's periodic checkpoints (``checkpoint.every_steps``) in a
    rank with no checkpoint implementation (``has_ckpt`` false: ``python -m
    sailor.megatron_patch.rank_main`` or ``deepspeed_adapter`` alone), by name, at start
    (pure). Otherwise the rank trains until the first save is due, which may be hours in, and
    fails there. ``fix`` says which entry point has one; ``error`` is the entry's refusal type
    (a ``ValueError``: a configuration error, not retried)."""
    if has_ckpt or tc is None or not tc.checkpoint.every_steps:
        return
    every = tc.checkpoint.every_steps
    raise error(
        f"training config checkpoint.every_steps={every} (dir={tc.checkpoint.dir!r}) needs a "
        f"checkpoint implementation, and this rank runs without one: {fix} (or set "
        f"checkpoint.every_steps: 0); its first save at step {every} would fail"
    )


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
    p.add_argument(
        "--timeout-s",
        type=float,
        default=600.0,
        help="Collective/p2p timeout (NCCL's own default). Loads at start (a checkpoint, an "
        "in-place relayout's reads, HF weights) are waited for outside it "
        "(--load-timeout-s); dead peers are the runtime's to detect (the agent sees the "
        "exit, the controller aborts).",
    )
    p.add_argument(
        "--load-timeout-s",
        type=float,
        default=LOAD_TIMEOUT_S,
        help="How long the ranks that loaded their stage first wait for the others, on the "
        "rendezvous store (not in a collective): default 2 h (megatron_patch.load_barrier); "
        "'inf' waits without a limit (the agent's workers: the controller's LOAD deadline "
        "ends a load that takes too long).",
    )
    p.add_argument(
        "--load-liveness-s",
        type=float,
        default=LIVENESS_S,
        help="A rank whose heartbeat on the rendezvous store stopped this long while the "
        "world starts and loads is dead (killed, crashed): its watchers name it and every "
        "rank fails with that, instead of waiting out --load-timeout-s (default 60 s).",
    )
    p.add_argument(
        "--load-poll-s",
        type=float,
        default=LOAD_POLL_S,
        help="How often a rank waiting on the rendezvous store for the others (before the "
        "world's first collective, after its load) reads their arrivals and failures "
        "(default 1 s: one request a poll per waiting rank on rank 0's store).",
    )
    p.add_argument(
        "--exchange-bucket-mb",
        type=float,
        default=EXCHANGE_BUCKET_BYTES / 2**20,
        help="In-place relayout: state a rank receives per batch of the exchange, MiB "
        "(every receive buffer of a batch is live until it completes; default 1024).",
    )
    p.add_argument(
        "--relayout-offload",
        choices=["auto", "always", "never"],
        default="auto",
        help="In-place relayout: move the held stage to host memory before the exchange "
        "(auto: on a GPU, when the new stage does not fit beside it; see docs/training.md).",
    )
    p.add_argument("--backend", choices=["gloo", "nccl"], default=None)
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads of this rank (host work: the CPU's compute under "
        "gloo; init, data and host copies on a GPU; torchrun's default is 1 too).",
    )
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
        "--periodic-save-timeout-s",
        type=float,
        default=PERIODIC_SAVE_TIMEOUT_S,
        help="A periodic save (the training config's checkpoint.every_steps, the controller's "
        "optional one) not durable on a rank within this is dropped as failed (the limit of "
        "failures in a row applies) instead of waiting for a hung write for good.",
    )
    p.add_argument(
        "--poll-s",
        type=float,
        default=0.02,
        help="Control-file poll while holding at a stop (the wait for a directive blocks on "
        "the file instead where it can: megatron_patch.file_wait).",
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
