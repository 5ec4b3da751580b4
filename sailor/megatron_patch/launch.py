"""Run every rank of a plan as local worker processes (tests, benchmarks, single-node use).

Starts ``python -m sailor.megatron_patch.rank_main`` once per rank on this machine with a free
loopback port as the rendezvous, waits for all of them (bounded by ``deadline_s``: a rank
still alive then is killed and reported), and collects each rank's progress lines, error
file and exit status. It is what the agent does on many nodes, reduced to one.

The backend is the plan's (:func:`~sailor.megatron_patch.devices.choose_backend`: gloo for a
``cpu`` plan, NCCL for a GPU plan) unless the caller names one, and every rank gets it as
``--backend``. A GPU plan that was never placed gets consecutive GPUs of this host
(:func:`~sailor.megatron_patch.devices.pack_one_host`); any plan under NCCL is checked
against this host's GPUs before a rank starts. Like the agent's supervisor, it starts each
rank with the caching allocator's settings in its environment
(:func:`~sailor.megatron_patch.devices.worker_env`) and writes the error record of a rank
killed by a signal (which cannot write its own).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sailor.localnet import free_port
from sailor.megatron_patch.affinity import available_cores, format_cores, round_robin
from sailor.megatron_patch.devices import (
    backend_for,
    check_devices,
    choose_backend,
    pack_one_host,
    worker_env,
)
from sailor.megatron_patch.errors import (
    fault_path,
    read_error_file,
    signal_failure_record,
    write_error_file,
)
from sailor.schemas.plan import Plan

__all__ = ["LocalRun", "free_port", "launch_local"]


@dataclass
class LocalRun:
    """What the local ranks did."""

    returncodes: list[int | None] = field(default_factory=list)
    progress: list[list[dict[str, Any]]] = field(default_factory=list)
    errors: list[dict[str, Any] | None] = field(default_factory=list)
    exit_times_s: list[float] = field(default_factory=list)
    """Seconds from launch to each rank's exit."""
    stderr: list[str] = field(default_factory=list)
    killed: list[int] = field(default_factory=list)
    """Ranks still running at the deadline (killed)."""
    backend: str = ""
    """The backend every rank ran with."""

    def steps(self, rank: int = 0) -> list[dict[str, Any]]:
        return [e for e in self.progress[rank] if e.get("event") == "step"]

    @property
    def ok(self) -> bool:
        return all(rc == 0 for rc in self.returncodes)


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def launch_local(
    plan: Plan,
    steps: int,
    workdir: Path,
    model: str | None = None,
    extra_args: list[str] | None = None,
    per_rank_args: dict[int, list[str]] | None = None,
    deadline_s: float = 300.0,
    timeout_s: float = 60.0,
    module: str = "sailor.megatron_patch.rank_main",
    pin_cores: bool = False,
    backend: str | None = None,
) -> LocalRun:
    """Run all ranks of ``plan`` locally for ``steps`` iterations and collect their reports.

    ``module`` is the entry point run per rank (the worker, or the DeepSpeed adapter).
    ``pin_cores`` binds rank ``r`` to core ``r % cores`` of those this process may use
    (:mod:`~sailor.megatron_patch.affinity`). ``backend``: ``"gloo"`` or ``"nccl"``; None
    takes the plan's (a GPU plan then needs CUDA here: pass ``"gloo"`` to run it on CPU).
    """
    chosen, plan = _local_backend(plan, backend)
    workdir.mkdir(parents=True, exist_ok=True)
    plan_path = workdir / "plan.json"
    plan_path.write_text(plan.model_dump_json())
    world = len(plan.ranks())
    for attempt in range(1, RENDEZVOUS_ATTEMPTS + 1):
        run = _run_ranks(
            f"127.0.0.1:{free_port()}",
            _Launch(
                plan_path,
                world,
                steps,
                workdir,
                model,
                extra_args,
                per_rank_args,
                deadline_s,
                timeout_s,
                module,
                pin_cores,
                chosen,
            ),
        )
        if attempt == RENDEZVOUS_ATTEMPTS or not _port_taken(run):
            return run
        for r in range(world):  # the next attempt's ranks write these afresh
            for name in (f"progress-{r}.jsonl", f"error-{r}.json", f"stderr-{r}.txt"):
                (workdir / name).unlink(missing_ok=True)
    raise AssertionError("unreachable")


RENDEZVOUS_ATTEMPTS = 3
"""Launches of a local run whose rendezvous port was taken before any rank trained (another
process bound it between :func:`free_port` and rank 0's listener), each on a new port, as
the controller relaunches a generation (``controller/rendezvous_ports.py``)."""


def _port_taken(run: LocalRun) -> bool:
    """Some rank failed binding the rendezvous (origin ``rendezvous``) and none trained."""
    return any(e is not None and e.get("origin") == "rendezvous" for e in run.errors) and not any(
        run.steps(r) for r in range(len(run.progress))
    )


@dataclass(frozen=True)
class _Launch:
    """What every attempt of :func:`launch_local` starts its ranks with."""

    plan_path: Path
    world: int
    steps: int
    workdir: Path
    model: str | None
    extra_args: list[str] | None
    per_rank_args: dict[int, list[str]] | None
    deadline_s: float
    timeout_s: float
    module: str
    pin_cores: bool
    backend: str


def _run_ranks(master: str, a: _Launch) -> LocalRun:
    """Start every rank of one attempt with rendezvous ``master``; wait and collect."""
    plan_path, world, steps, workdir, model = a.plan_path, a.world, a.steps, a.workdir, a.model
    extra_args, per_rank_args, deadline_s, timeout_s = (
        a.extra_args,
        a.per_rank_args,
        a.deadline_s,
        a.timeout_s,
    )
    module, pin_cores, chosen = a.module, a.pin_cores, a.backend
    procs: list[subprocess.Popen[bytes]] = []
    placement = round_robin(world, available_cores()) if pin_cores else None
    t0 = time.monotonic()
    for r in range(world):
        cmd = [
            sys.executable,
            "-m",
            module,
            "--plan",
            str(plan_path),
            "--rank",
            str(r),
            "--world-size",
            str(world),
            "--master",
            master,
            "--steps",
            str(steps),
            "--timeout-s",
            str(timeout_s),
            "--progress",
            str(workdir / "progress-{rank}.jsonl"),
            "--error-file",
            str(workdir / "error-{rank}.json"),
            "--dump-state",
            str(workdir / "state-{rank}.pt"),
            "--backend",
            chosen,
        ]
        if model:
            cmd += ["--model", model]
        if placement is not None:
            cmd += ["--cpu-cores", format_cores(placement[r])]
        cmd += extra_args or []
        cmd += (per_rank_args or {}).get(r, [])
        err = (workdir / f"stderr-{r}.txt").open("wb")
        procs.append(
            subprocess.Popen(
                cmd,
                stdout=subprocess.DEVNULL,
                stderr=err,
                cwd=str(workdir),
                env=worker_env(os.environ),  # the allocator's settings before CUDA can start
            )
        )
        err.close()
    run = LocalRun(returncodes=[None] * world, exit_times_s=[float("nan")] * world, backend=chosen)
    while any(rc is None for rc in run.returncodes):
        for r, p in enumerate(procs):
            if run.returncodes[r] is None and p.poll() is not None:
                run.returncodes[r] = p.returncode
                run.exit_times_s[r] = time.monotonic() - t0
        if time.monotonic() - t0 > deadline_s:
            for r, p in enumerate(procs):
                if p.poll() is None:
                    p.kill()
                    p.wait()
                    run.killed.append(r)
                    run.returncodes[r] = p.returncode
            break
        time.sleep(0.05)
    for r in range(world):
        run.progress.append(_read_jsonl(workdir / f"progress-{r}.jsonl"))
        ef = workdir / f"error-{r}.json"
        rc = run.returncodes[r]
        if rc not in (None, 0) and r not in run.killed and read_error_file(ef) is None:
            _record_silent_death(workdir, r, rc, run.progress[r], procs[r].pid)
        run.errors.append(read_error_file(ef))
        run.stderr.append((workdir / f"stderr-{r}.txt").read_text(errors="replace"))
    return run


def _local_backend(plan: Plan, backend: str | None) -> tuple[str, Plan]:
    """The backend of a local run and the plan as the ranks get it (GPUs checked, an unplaced
    GPU plan packed onto this host's GPUs)."""
    if (backend or backend_for(plan)) != "nccl":
        return choose_backend(plan, backend, cuda_available=False), plan
    import torch  # only a GPU run needs to ask

    chosen = choose_backend(plan, backend, torch.cuda.is_available())
    packed = pack_one_host(plan)
    check_devices(packed, torch.cuda.device_count())
    return chosen, packed


def _record_silent_death(
    workdir: Path, rank: int, returncode: int, progress: list[dict[str, Any]], pid: int
) -> None:
    """Write the record of a rank that exited (by a signal) without writing its own."""
    steps = [int(e["step"]) for e in progress if e.get("event") == "step"]
    ef = workdir / f"error-{rank}.json"
    fault = ""
    with contextlib.suppress(OSError):
        fault = fault_path(ef).read_text(errors="replace")
    record = signal_failure_record(rank, returncode, steps[-1] if steps else -1, fault, pid=pid)
    write_error_file(ef, record)
    with (workdir / f"stderr-{rank}.txt").open("a") as f:
        f.write(json.dumps({"event": "failed", **record}) + "\n")
