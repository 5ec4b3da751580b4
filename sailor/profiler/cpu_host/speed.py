"""CPU test scaffolding: is this host running at its usual speed right now? Every core checked.

A profile describes the host as it was while it was measured. On a dedicated machine that
holds; on a cloud VM whose cores are shared with other tenants it does not, and the drift is
large and fast. On the 2-vCPU machine this project is developed on, one rank of the tiny
GPT's training step, alone on its core, took 6.9-7.6 ms in some seconds and 11-15 ms in the
next, for tens of seconds at a time, with no steal time reported to the guest; a plan's step
moved as much between two runs a minute apart. A comparison of the simulator with a run is
only meaningful when the profile and the run saw the same host.

:class:`SpeedProbe` keeps one process per core, bound to it, holding the model as one stage
and its optimizer, warmed up and then idle (blocked on a pipe: no CPU while waiting).
:meth:`SpeedProbe.check` takes ~``(cores + 1) x window_s``: each core runs the model's
training step alone for a window, then all cores at once; a :class:`SpeedCheck` holds the
mean step time of every core in both. Comparing checks (:func:`drift`, :func:`same_speed`,
over stretches: :func:`mean_check`) says whether the host kept its speed during a
measurement and whether two measurements saw the same host; :func:`nominal` is the fastest
seen (the host undisturbed). The benchmark ``simulator_vs_cpu.py`` checks before and after
every profile part and every run, and reports which runs saw the host of their profile.

The processes compute only inside a check; between checks they do not run at all, so they do
not disturb what is measured in between.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType

from sailor.schemas import ModelSpec

__all__ = ["SpeedCheck", "SpeedProbe", "drift", "mean_check", "nominal", "same_speed"]

_READY = "ready"


@dataclass(frozen=True)
class SpeedCheck:
    """One check: the model's mean training-step time on every core, alone and all at once."""

    at_s: float
    """When it was taken (monotonic clock)."""
    alone_s: tuple[float, ...]
    together_s: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.alone_s or len(self.alone_s) != len(self.together_s):
            raise ValueError(
                f"alone_s={self.alone_s}, together_s={self.together_s}: need one time per "
                "core in both"
            )
        if any(t <= 0 for t in (*self.alone_s, *self.together_s)):
            raise ValueError(
                f"alone_s={self.alone_s}, together_s={self.together_s}: times must be > 0"
            )

    def slowest_ratio(self, reference: SpeedCheck) -> float:
        """The largest ratio of a time of this check to the same time in ``reference``."""
        if len(reference.alone_s) != len(self.alone_s):
            raise ValueError(
                f"reference has {len(reference.alone_s)} cores, this check {len(self.alone_s)}"
            )
        pairs = zip(
            (*self.alone_s, *self.together_s),
            (*reference.alone_s, *reference.together_s),
            strict=True,
        )
        return max(t / r for t, r in pairs)

    def describe(self) -> str:
        ms = "/".join(f"{t * 1e3:.2f}" for t in self.alone_s)
        together = "/".join(f"{t * 1e3:.2f}" for t in self.together_s)
        return f"alone {ms} ms, all cores {together} ms"


def _per_core(checks: Sequence[SpeedCheck], reduce: Callable[[list[float]], float]) -> SpeedCheck:
    """``reduce`` over the checks of each core's time alone and together; the latest time."""
    if not checks:
        raise ValueError("checks: need at least one speed check")
    cores = len(checks[0].alone_s)
    if any(len(c.alone_s) != cores for c in checks):
        raise ValueError("checks: all must cover the same cores")
    return SpeedCheck(
        at_s=max(c.at_s for c in checks),
        alone_s=tuple(reduce([c.alone_s[i] for c in checks]) for i in range(cores)),
        together_s=tuple(reduce([c.together_s[i] for c in checks]) for i in range(cores)),
    )


def nominal(checks: Sequence[SpeedCheck]) -> SpeedCheck:
    """The host at its usual speed: per core, the fastest time seen alone and together.

    Other tenants only ever slow a core down, so the fastest of many checks is the host
    undisturbed (a core cannot run the same work faster than it can)."""
    return _per_core(checks, min)


def mean_check(checks: Sequence[SpeedCheck]) -> SpeedCheck:
    """The mean of several checks, time by time (the host over a longer stretch)."""
    return _per_core(checks, lambda ts: sum(ts) / len(ts))


def drift(a: SpeedCheck, b: SpeedCheck) -> float:
    """How far apart two checks are: the largest ratio between the same time in both, minus
    one (0: the same host speed; 1: some time doubled)."""
    return max(a.slowest_ratio(b), b.slowest_ratio(a)) - 1.0


def same_speed(a: SpeedCheck, b: SpeedCheck, tolerance: float = 0.2) -> bool:
    """Whether the host ran at the same speed in both checks, within ``tolerance``."""
    if tolerance < 0:
        raise ValueError(f"tolerance={tolerance}: must be >= 0")
    return drift(a, b) <= tolerance


class SpeedProbe:
    """One idle measuring process per core; :meth:`check` wakes them for one check.

    Use as a context manager (the processes are stopped on exit)."""

    def __init__(
        self,
        spec: ModelSpec,
        mbs: int = 2,
        cores: Sequence[int] | None = None,
        threads: int = 1,
        timeout_s: float = 120.0,
    ) -> None:
        if mbs < 1:
            raise ValueError(f"mbs={mbs}: must be >= 1")
        self.cores = list(cores) if cores is not None else sorted(os.sched_getaffinity(0))
        if not self.cores:
            raise ValueError("cores: need at least one core")
        self.timeout_s = timeout_s
        config = json.dumps({"spec": spec.model_dump(mode="json"), "mbs": mbs, "threads": threads})
        self._procs: list[subprocess.Popen[str]] = []
        try:
            for core in self.cores:
                p = subprocess.Popen(
                    [sys.executable, "-m", __name__, "--core", str(core)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
                self._procs.append(p)
                self._send(p, config)
            for core, p in zip(self.cores, self._procs, strict=True):
                line = self._read(p)
                if line != _READY:
                    raise RuntimeError(f"speed probe on core {core}: expected ready, got {line!r}")
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> SpeedProbe:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        for p in self._procs:
            if p.stdin is not None and not p.stdin.closed:
                p.stdin.close()
        for p in self._procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self._procs = []

    def _send(self, p: subprocess.Popen[str], line: str) -> None:
        if p.stdin is None:
            raise RuntimeError("speed probe: no pipe to the process")
        p.stdin.write(line + "\n")
        p.stdin.flush()

    def _read(self, p: subprocess.Popen[str]) -> str:
        if p.stdout is None:
            raise RuntimeError("speed probe: no pipe from the process")
        line = p.stdout.readline()
        if not line:
            raise RuntimeError(f"speed probe process exited with {p.wait(self.timeout_s)}")
        return line.strip()

    def _window(self, which: list[int], window_s: float) -> list[float]:
        # a common start a little ahead, so that processes woken one after the other still
        # compute together
        start = time.monotonic() + 0.02
        for i in which:
            self._send(self._procs[i], json.dumps({"start": start, "seconds": window_s}))
        return [float(json.loads(self._read(self._procs[i]))["mean_s"]) for i in which]

    def check(self, window_s: float = 0.2) -> SpeedCheck:
        """Every core alone for ``window_s``, one after the other, then all at once."""
        if window_s <= 0:
            raise ValueError(f"window_s={window_s}: must be > 0")
        if not self._procs:
            raise RuntimeError("speed probe is closed")
        at = time.monotonic()
        alone = tuple(self._window([i], window_s)[0] for i in range(len(self._procs)))
        together = tuple(self._window(list(range(len(self._procs))), window_s))
        return SpeedCheck(at_s=at, alone_s=alone, together_s=together)


# --- the measuring process -------------------------------------------------------------------


def _main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="one core of the host speed check (internal)")
    ap.add_argument("--core", type=int, required=True)
    args = ap.parse_args(argv)
    os.sched_setaffinity(0, {args.core})  # before torch starts its threads
    cfg = json.loads(sys.stdin.readline())

    import torch

    from sailor.megatron_patch.engine import TrainConfig, make_optimizer
    from sailor.megatron_patch.model import GPTStage

    torch.set_num_threads(int(cfg["threads"]))
    spec = ModelSpec.model_validate(cfg["spec"])
    mbs = int(cfg["mbs"])
    stage = GPTStage(spec, 0, spec.num_all_layers - 1, seed=0)
    opt = make_optimizer(stage.parameters(), TrainConfig())
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, spec.vocab_size, (mbs, spec.seq_length), generator=gen)
    labels = torch.randint(0, spec.vocab_size, (mbs, spec.seq_length), generator=gen)

    def step() -> None:
        opt.zero_grad(set_to_none=False)
        stage(tokens, labels).backward()
        opt.step()

    end = time.monotonic() + 0.3  # warm-up: allocator, autograd, optimizer state
    while time.monotonic() < end:
        step()
    print(_READY, flush=True)
    for line in sys.stdin:
        order = json.loads(line)
        start, seconds = float(order["start"]), float(order["seconds"])
        while time.monotonic() < start:
            pass
        steps, t0 = 0, time.perf_counter()
        while steps < 3 or time.monotonic() < start + seconds:
            step()
            steps += 1
        print(json.dumps({"mean_s": (time.perf_counter() - t0) / steps}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_main())
