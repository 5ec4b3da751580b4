"""Run a measurement as N real processes joined by a process group (gloo, or NCCL on GPUs).

The TP-degree layer measurements and the link probe need several ranks of
``torch.distributed``, as in training. Each rank is a fresh ``python -m <module>`` process
(not a fork: torch's thread pools and gloo do not survive ``fork``), started with
``--rank R --world-size W --master ADDR:PORT --out FILE --config JSON``; it writes its
result as JSON to ``FILE``. :func:`run_ranks` starts them, waits with a deadline (a rank
still running then is killed) and returns every rank's result, or raises
:class:`RankFailedError` with the stderr of the first rank that failed on its own (not one
killed because another failed: its stderr would hide the cause, e.g. a GPU out of memory).

Rank side: :func:`rank_args` parses those options; :func:`init_gloo` joins the group on the
CPU, :func:`join_group` with the backend of a device (:func:`check_devices` first, in the
parent, refuses a missing GPU before any rank starts).
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sailor.durable import write_durably
from sailor.localnet import free_port

if TYPE_CHECKING:
    import torch

__all__ = [
    "MasterUnreachableError",
    "PeerNotJoinedError",
    "RankFailedError",
    "check_devices",
    "init_gloo",
    "join_group",
    "rank_args",
    "rank_device",
    "resolve_master",
    "run_ranks",
    "wait_for_master",
    "write_result",
]


class RankFailedError(RuntimeError):
    """A measurement rank exited with an error or missed its deadline. Retrying may help
    only if the cause was a busy machine (deadline); an error in stderr will repeat."""

    def __init__(self, module: str, rank: int, why: str, stderr: str) -> None:
        tail = "\n".join(stderr.strip().splitlines()[-15:])
        super().__init__(f"{module} rank {rank}: {why}\n{tail}")
        self.module, self.rank, self.why, self.stderr = module, rank, why, stderr


class PeerNotJoinedError(RuntimeError):
    """The ranks here were ready to join their group, but the ranks on the other host did not
    join within the join timeout (``run_ranks(join_timeout_s=...)``): not started there, or
    unable to reach ``master``. The ranks here are killed."""

    def __init__(self, module: str, master: str, timeout_s: float) -> None:
        super().__init__(
            f"{module}: the other host's ranks did not join the group at {master} within "
            f"{timeout_s:g} s"
        )
        self.module, self.master, self.timeout_s = module, master, timeout_s


class MasterUnreachableError(RuntimeError):
    """Nothing accepted a connection at rank 0's ``host:port`` within the connect timeout:
    the ranks here would have waited for it until the measurement's deadline."""


def _split_master(master: str) -> tuple[str, int]:
    host, _, port = master.rpartition(":")
    return host.strip("[]"), int(port)


def resolve_master(master: str) -> None:
    """Refuse at once a ``host:port`` whose host does not resolve (a typo, a name only
    another network knows): the ranks' rendezvous would retry it until their deadline."""
    host, port = _split_master(master)
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise ValueError(
            f"master={master!r}: host {host!r} does not resolve ({exc}): give rank 0's IP "
            "address or a name this node resolves"
        ) from None


def wait_for_master(master: str, timeout_s: float, poll_s: float = 0.5) -> float:
    """Wait until something accepts a TCP connection at ``master`` (rank 0, started on its
    node before or after this one), trying every ``poll_s``; the seconds waited. Raises
    :class:`MasterUnreachableError` after ``timeout_s`` naming the last failure (refused,
    timed out, no route), or ``ValueError`` at once for a host that does not resolve."""
    resolve_master(master)
    host, port = _split_master(master)
    t0 = time.monotonic()
    while True:
        left = timeout_s - (time.monotonic() - t0)
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(5.0, left))):
                return time.monotonic() - t0
        except OSError as exc:
            last = exc.strerror or type(exc).__name__
        if time.monotonic() - t0 + poll_s > timeout_s:
            raise MasterUnreachableError(
                f"master={master!r}: nothing accepted a connection there within "
                f"{timeout_s:g} s (last try: {last}): start rank 0 there (it listens at that "
                "port), check the address and the firewall, or wait longer with "
                "--connect-timeout"
            )
        time.sleep(poll_s)


def rank_device(device: str, index: int, gpus: int) -> tuple[str, str]:
    """The backend and the device of a measurement rank (pure): gloo on the CPU, or NCCL with
    GPU ``index`` of the ``gpus`` this host has."""
    if device == "cpu":
        return "gloo", "cpu"
    if device != "cuda":
        raise ValueError(f"device={device!r}: use 'cpu' or 'cuda'")
    if not 0 <= index < gpus:
        raise ValueError(
            f"a rank needs GPU {index}, but this host has {gpus} GPU(s): one rank per GPU"
        )
    return "nccl", f"cuda:{index}"


def run_ranks(
    module: str,
    world: int,
    config: dict[str, Any],
    deadline_s: float = 600.0,
    extra_env: dict[str, str] | None = None,
    master: str | None = None,
    ranks: Sequence[int] | None = None,
    join_timeout_s: float | None = None,
) -> list[dict[str, Any]]:
    """Run ``python -m module`` as the ``world`` ranks of a group; each rank's JSON result, in
    order. ``ranks`` starts only some of them here (the others run on other hosts, joining at
    ``master``, ``host:port`` of rank 0); default: all of them, on loopback.

    ``join_timeout_s`` (with ranks elsewhere): once every rank here is about to join the
    group (its markers, :func:`_init_group`), the others have that long to join it; then the
    ranks here are killed and :class:`PeerNotJoinedError` raised. None: only the ranks' own
    rendezvous timeout and ``deadline_s`` bound the wait."""
    import os

    if world < 1:
        raise ValueError(f"world={world}: need at least one rank")
    mine = list(range(world)) if ranks is None else list(ranks)
    if not mine or any(not 0 <= r < world for r in mine):
        raise ValueError(f"ranks={mine}: need ranks in 0..{world - 1}")
    if master is None:
        if len(mine) != world:
            raise ValueError("master: ranks on other hosts need the address of rank 0")
        master = f"127.0.0.1:{free_port()}"
    env = {**os.environ, **(extra_env or {})}
    with tempfile.TemporaryDirectory(prefix="sailor-profile-") as tmp:
        d = Path(tmp)
        cfg = d / "config.json"
        cfg.write_text(json.dumps(config))
        procs: list[subprocess.Popen[bytes]] = []
        for r in mine:
            cmd = [
                sys.executable,
                "-m",
                module,
                "--rank",
                str(r),
                "--world-size",
                str(world),
                "--master",
                master,
                "--config",
                str(cfg),
                "--out",
                str(d / f"out-{r}.json"),
            ]
            err = (d / f"stderr-{r}.txt").open("wb")
            procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env))
            err.close()
        t0 = time.monotonic()
        late = False
        joining_since: float | None = None
        lonely = False
        while any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs):
                break  # one failed: the others would wait for it until their timeout
            if time.monotonic() - t0 > deadline_s:
                late = True
                break
            if join_timeout_s is not None:
                if joining_since is None and all(_marker(d, r, "joining") for r in mine):
                    joining_since = time.monotonic()
                if (
                    joining_since is not None
                    and time.monotonic() - joining_since > join_timeout_s
                    and not all(_marker(d, r, "joined") for r in mine)
                ):
                    lonely = True
                    break
            time.sleep(0.02)
        # the ranks that failed on their own come first: a rank killed below (waiting in a
        # collective for the failed one) has nothing to say about the cause
        first = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        if lonely and not first:
            raise PeerNotJoinedError(module, master, float(join_timeout_s or 0.0))
        order = first + [i for i in range(len(procs)) if i not in first]
        for i in order:
            r, p = mine[i], procs[i]
            stderr = (d / f"stderr-{r}.txt").read_text(errors="replace")
            if p.returncode != 0 or not (d / f"out-{r}.json").exists():
                why = f"missed the {deadline_s:.0f} s deadline" if late else f"exit {p.returncode}"
                raise RankFailedError(module, r, why, stderr)
        return [json.loads((d / f"out-{r}.json").read_text()) for r in mine]


def _marker(d: Path, rank: int, what: str) -> bool:
    """Whether rank ``rank`` left its ``joining`` or ``joined`` marker (:func:`_init_group`)
    beside its result file in ``d``."""
    return (d / f"out-{rank}.json.{what}").exists()


def rank_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, dict[str, Any]]:
    """The options :func:`run_ranks` passes, and the decoded config."""
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--master", required=True)
    p.add_argument("--config", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    return args, json.loads(Path(args.config).read_text())


def init_gloo(args: argparse.Namespace, timeout_s: float = 120.0) -> None:
    """Join the gloo group of the run (rank, world size, rendezvous from ``args``)."""
    _init_group(args, "gloo", timeout_s)


def check_devices(device: str, indices: Iterable[int]) -> None:
    """Refuse, before any rank starts, a device kind other than cpu or cuda, or a GPU index
    this host does not have (:func:`rank_device`)."""
    gpus = 0
    if device == "cuda":
        import torch

        gpus = torch.cuda.device_count()
    for index in indices:
        rank_device(device, index, gpus)


def join_group(
    args: argparse.Namespace, device: str, index: int, timeout_s: float = 120.0
) -> torch.device:
    """Join the run's process group with the backend of ``device`` (gloo on cpu; NCCL on
    cuda, GPU ``index`` made current) and return the rank's device."""
    import torch

    gpus = torch.cuda.device_count() if device == "cuda" else 0
    backend, name = rank_device(device, index, gpus)
    dev = torch.device(name)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    _init_group(args, backend, timeout_s)
    return dev


def _init_group(args: argparse.Namespace, backend: str, timeout_s: float) -> None:
    """Join the group; markers beside ``--out`` tell the parent when this rank starts to
    join (its imports done: rank 0 listens in a moment) and when it has joined
    (``run_ranks(join_timeout_s=...)`` times the other host's ranks from the first)."""
    import torch.distributed as dist

    out = Path(args.out)
    out.with_name(out.name + ".joining").touch()
    dist.init_process_group(
        backend,
        init_method=f"tcp://{args.master}",
        rank=args.rank,
        world_size=args.world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    out.with_name(out.name + ".joined").touch()


def write_result(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """Write this rank's result atomically and durably (:func:`sailor.durable.write_durably`;
    the parent treats a missing file as failure)."""
    write_durably(Path(args.out), json.dumps(result).encode())
