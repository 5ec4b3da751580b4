"""One engine rank (``sailor.megatron_patch.rank_main``) that also records each step's CPU time.

For benchmarks on a shared machine: wall-clock step times swing by 2x when other jobs take the
cores; the CPU time a process spends on a step (all its threads, gloo's included) swings less
(shared caches and memory bandwidth still move it by ~20 % on the 2-core test machine).
``launch_local(..., module="cpu_timed_rank")`` with this directory on ``PYTHONPATH`` runs it;
rank ``r`` writes ``{"step", "cpu_s"}`` lines to ``cpu-r.jsonl`` in its working directory at
the end (nothing is written during the run).
The engine is unchanged: ``Trainer.train_step`` is wrapped, nothing else.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from sailor.megatron_patch import rank_main
from sailor.megatron_patch.engine import StepResult, Trainer


def _wrap(records: list[dict[str, float]]) -> None:
    step = Trainer.train_step

    def timed(self: Trainer) -> StepResult:
        c0 = time.process_time()
        res = step(self)
        records.append({"step": res.step, "cpu_s": time.process_time() - c0})
        return res

    Trainer.train_step = timed  # type: ignore[method-assign]


if __name__ == "__main__":
    rank = sys.argv[sys.argv.index("--rank") + 1]
    records: list[dict[str, float]] = []
    _wrap(records)
    code = rank_main.main()  # exits by itself on failure
    lines = "".join(json.dumps(r) + "\n" for r in records)
    (Path.cwd() / f"cpu-{rank}.jsonl").write_text(lines)
    sys.exit(code)
