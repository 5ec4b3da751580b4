"""The training worker's command line: the templates the agent fills per rank
(``DEFAULT_WORKER_ARGV``, the real worker; ``TOY_TRAINER_ARGV``, the torch-free stand-in for
protocol tests; their placeholders are listed in :mod:`sailor.agent.supervisor`) and the
options part of a filled one that a held worker re-parses (``worker_options``). Values only:
must never start a process.
"""

from __future__ import annotations

import sys

__all__ = ["DEFAULT_WORKER_ARGV", "TOY_TRAINER_ARGV", "worker_options"]


DEFAULT_WORKER_ARGV: tuple[str, ...] = (
    sys.executable,
    "-m",
    "sailor.training_process",
    "--plan",
    "{plan}",
    "--rank",
    "{rank}",
    "--world-size",
    "{world_size}",
    "--master",
    "{master}",
    "--control",
    "{control}",
    "--ckpt-dir",
    "{load_dir}",
    "--load-step",
    "{load_step}",
    "--error-file",
    "{error_file}",
    "--progress",
    "{run_dir}/progress-{rank}.jsonl",
    "--load-timeout-s",
    "inf",
)
"""The real training worker (``sailor.training_process``: sailor.megatron_patch with layer-keyed
checkpoints). ``TOY_TRAINER_ARGV`` is the torch-free stand-in for protocol tests.

``--load-timeout-s inf``: under an agent the controller's LOAD deadline is what ends a load
that takes too long (it aborts the generation, charges the nodes that held it up and
stretches the next one: ``controller/plan_deadlines.py``, up to 3 h before its stretch),
not the worker's own 2 h, which could fail a load the controller still allows, on every
relaunch alike. The Launch does not carry that deadline (LOAD begins once every node has
acked its Launch, and is sized by the controller), so the worker sets none of its own; a
rank that dies while the world loads is still caught within ``--load-liveness-s``
(``megatron_patch.load_barrier``)."""

TOY_TRAINER_ARGV: tuple[str, ...] = (
    sys.executable,
    "-m",
    "sailor.agent.toy_trainer",
    "--plan",
    "{plan}",
    "--rank",
    "{rank}",
    "--world-size",
    "{world_size}",
    "--master",
    "{master}",
    "--control",
    "{control}",
    "--load-dir",
    "{load_dir}",
    "--load-step",
    "{load_step}",
    "--error-file",
    "{error_file}",
)


def worker_options(argv: tuple[str, ...]) -> list[str]:
    """The options of a worker's command line: from its first ``--`` argument on (what a
    held worker re-parses; the program part, e.g. ``python -m sailor.training_process``, is
    the process it already is)."""
    for i, a in enumerate(argv):
        if a.startswith("--"):
            return list(argv[i:])
    return []
