"""The agent's worker command line, as the worker parses it."""

from __future__ import annotations

import math

from sailor.agent.worker_argv import DEFAULT_WORKER_ARGV, worker_options
from sailor.megatron_patch.load_barrier import LOAD_TIMEOUT_S
from sailor.megatron_patch.rank_args import build_parser

_FILLED = {
    "plan": "p.json",
    "rank": "3",
    "world_size": "8",
    "master": "10.0.0.1:29500",
    "control": "c.json",
    "load_dir": "",
    "load_step": "-1",
    "error_file": "e.json",
    "run_dir": "/run",
}


def test_the_agent_s_workers_leave_slow_loads_to_the_controller_s_load_deadline() -> None:
    argv = tuple(a.format(**_FILLED) for a in DEFAULT_WORKER_ARGV)
    args = build_parser().parse_args(worker_options(argv))  # what a held worker re-parses too
    assert math.isinf(args.load_timeout_s)
    # a worker started by hand keeps its own bound
    alone = build_parser().parse_args(
        ["--plan", "p", "--rank", "0", "--world-size", "1", "--master", "m"]
    )
    assert alone.load_timeout_s == LOAD_TIMEOUT_S
