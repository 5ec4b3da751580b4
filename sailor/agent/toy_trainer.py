"""A toy training process speaking the agent's worker protocol (no torch): a stand-in for training.

Used where real training is beside the point: protocol tests, large simulated clusters in
the benchmarks, and runs on machines without torch. It "trains" a 4-parameter model on a
deterministic data stream, so its loss at a step depends only on the step (any layout gives
the same loss curve), and it checkpoints that state per rank with an atomic commit by rank 0.

Protocol (shared with the real worker's adapter):
- stdout: one JSON object per line: ``{"event": "ready"}``, ``{"event": "step", "step",
  "loss"}``, ``{"event": "saved", "step"}``, ``{"event": "stopped", "step"}``;
- ``--control FILE``: JSON ``{"stop_at_step": S, "save_step": S, "save_dir": DIR}``, re-read
  at every iteration boundary (written atomically by the agent);
- ``--error-file FILE``: the first failure cause, JSON, written before a non-zero exit;
- ``--train-config FILE``: the job's training config, which the agent appends to any worker's
  argv. Validated as the real worker does (an invalid one fails the rank before ``ready``,
  naming field and value), otherwise unused: the toy model has nothing to configure;
- ``--slowness "KIND=X,..."`` (or the environment's ``SAILOR_TOY_SLOWNESS``): each step line
  also carries the timings online calibration reads (``fwd_s``, ``bwd_s``, ``p2p_s``,
  ``sync_s``, ``optim_s``, ``step_s``, ``microbatches``), made up from the cost model for a
  cluster whose GPU types KIND compute X times slower than profiled, with ``--timing-noise``
  relative noise (:mod:`toy_timings`: simulated, not measured; the toy's own pace stays
  ``--step-s``). Without it, step lines carry no timings, as before.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sailor.agent.toy_timings import ToyTimings

__all__ = ["main"]


def _target(step: int) -> list[float]:
    return [math.sin(0.1 * step + i) for i in range(4)]


def _write_atomic(path: Path, data: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(data)
    with tmp.open("rb") as fh:
        os.fsync(fh.fileno())
    tmp.replace(path)


def _emit(obj: dict[str, object]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _ckpt_dir(root: str, step: int) -> Path:
    return Path(root) / "sim" / f"step-{step:08d}"


def _save(root: str, step: int, w: list[float], rank: int, world: int, timeout: float) -> None:
    d = _ckpt_dir(root, step)
    _write_atomic(d / f"rank-{rank}.json", json.dumps({"step": step, "w": w}))
    if rank != 0:
        return
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if all((d / f"rank-{r}.json").exists() for r in range(world)):
            _write_atomic(d / "state.json", json.dumps({"step": step, "w": w}))
            _write_atomic(d / "COMMIT", str(step))
            return
        time.sleep(0.01)
    raise TimeoutError(f"not every rank saved step {step} within {timeout}s")


def _check_train_config(path: str) -> None:
    """Refuse an invalid training config like the real worker (imported only when given:
    pydantic adds to the start-up of the many toy workers that run without one)."""
    from sailor.schemas.training import parse_training_config

    parse_training_config(Path(path).read_text(), path)


def _timings(a: argparse.Namespace) -> ToyTimings:
    """The made-up step timings of this rank (imported only when asked: see toy_timings)."""
    from sailor.agent.toy_timings import ToyTimings, parse_slowness

    return ToyTimings(Path(a.plan), a.rank, parse_slowness(a.slowness), a.timing_noise)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="sailor-toy-trainer")
    p.add_argument("--plan", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--master", default="")
    p.add_argument("--control", required=True)
    p.add_argument("--load-dir", default="")
    p.add_argument("--load-step", type=int, default=-1)
    p.add_argument("--step-s", type=float, default=0.05)
    p.add_argument("--max-steps", type=int, default=1_000_000)
    p.add_argument("--error-file", default="")
    p.add_argument("--fail-at-step", type=int, default=-1)
    p.add_argument("--train-config", default="")
    p.add_argument("--slowness", default=os.environ.get("SAILOR_TOY_SLOWNESS"))
    p.add_argument("--timing-noise", type=float, default=0.02)
    a = p.parse_args(argv)
    try:
        if a.train_config:
            _check_train_config(a.train_config)
        step, w = 0, [0.0, 0.0, 0.0, 0.0]
        if a.load_dir and a.load_step >= 0:
            d = _ckpt_dir(a.load_dir, a.load_step)
            if not (d / "COMMIT").exists():
                raise FileNotFoundError(f"no committed checkpoint at {d}")
            state = json.loads((d / "state.json").read_text())
            step, w = int(state["step"]), [float(x) for x in state["w"]]
        timings = _timings(a) if a.slowness is not None else None
        _emit({"event": "ready", "rank": a.rank, "start_step": step})
        control = Path(a.control)
        while step < a.max_steps:
            time.sleep(a.step_s)
            tgt = _target(step)
            w = [wi - 0.3 * (wi - ti) for wi, ti in zip(w, tgt, strict=True)]
            loss = sum((wi - ti) ** 2 for wi, ti in zip(w, tgt, strict=True))
            step += 1
            if step == a.fail_at_step:
                raise RuntimeError(f"injected failure at step {step}")
            line: dict[str, object] = {"event": "step", "rank": a.rank, "step": step}
            line["loss"] = round(loss, 10)
            if timings is not None:
                line.update(timings.step(step))
            _emit(line)
            try:
                ctl = json.loads(control.read_text() or "{}")
            except (OSError, ValueError):
                ctl = {}
            if ctl.get("save_step") == step and ctl.get("save_dir"):
                _save(str(ctl["save_dir"]), step, w, a.rank, a.world_size, timeout=30.0)
                _emit({"event": "saved", "rank": a.rank, "step": step})
            stop = ctl.get("stop_at_step")
            if stop is not None and step >= int(stop):
                _emit({"event": "stopped", "rank": a.rank, "step": step})
                return 0
        return 0
    except Exception as exc:
        if a.error_file:
            _write_atomic(
                Path(a.error_file),
                json.dumps({"rank": a.rank, "error": type(exc).__name__, "message": str(exc)}),
            )
        return 1


if __name__ == "__main__":
    sys.exit(main())
