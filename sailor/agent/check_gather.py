"""The facts of ``sailor check``, gathered on this node: the I/O shell around ``check_verdicts``.

* :func:`gather_gpu` asks torch (in this process) for CUDA, the driver, NCCL, the build's
  GPU architectures (``get_arch_list``) and every device, maps each device's CUDA name to
  its catalog type, and runs :func:`probe_collectives`.
* :func:`gather_gpu_subprocess` does the same in a child process (``python -m
  sailor.agent.check_gather``), for the agent: a CUDA context in the long-lived agent would hold
  ~0.5 GiB of every GPU for as long as it runs, and a wedged driver call cannot hang it.
* :func:`probe_collectives` starts one rank per GPU (``sailor.agent.check_rank``, through the
  profiler's :func:`~sailor.profiler.procs.run_ranks`): an all-reduce and a send/recv ring
  with NCCL, each checked for exact results; gloo on the CPU for tests.
* :func:`reach_servers` connects to NATS and etcd with the node's own URL, endpoint and
  ``security`` (TLS, certificate, NATS login), through ``sailor.coordination`` as the agent
  does, and asks each one thing (a flush, a read of the revision).

Nothing here decides: the facts go to :func:`~sailor.agent.check_verdicts.judge`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sailor import catalog
from sailor.catalog.cuda_names import UnknownGPUError, catalog_gpu_name
from sailor.coordination import close_nats, connect_etcd, connect_nats
from sailor.coordination.security import SecurityConfig
from sailor.schemas.device_kind import is_cpu_type
from sailor.schemas.hardware import NodeSpec
from sailor.schemas.json_text import load_json
from sailor.schemas.node_check import DeviceFacts, EndpointFacts, NodeFacts, ProbeFacts
from sailor.schemas.redact import redact_urls

__all__ = [
    "PROBE_BYTES",
    "child_facts",
    "driver_version",
    "gather_gpu",
    "gather_gpu_subprocess",
    "node_facts",
    "probe_collectives",
    "reach_servers",
]

PROBE_BYTES = {"cuda": 64 << 20, "cpu": 1 << 20}
"""All-reduce size of the bandwidth figure: 64 MiB is past NCCL's latency-bound range on
NVLink and PCIe (its bus bandwidth levels off from a few MiB); 1 MiB keeps gloo quick."""


def node_facts(node: NodeSpec | None, gpu: dict[str, Any] | None = None) -> NodeFacts:
    """The facts of ``node`` (None: no config, a GPU node of any type) with the GPU facts
    ``gpu`` (from :func:`gather_gpu`; None or empty: not gathered)."""
    kind = "cpu" if node is not None and is_cpu_type(node.gpu_type) else "gpu"
    return NodeFacts(
        node_kind=kind,
        gpu_type=node.gpu_type if node is not None else "",
        gpus=node.gpus if node is not None else 0,
        hostname=socket.gethostname(),
        **(gpu or {}),
    )


def driver_version() -> str:
    """The NVIDIA kernel driver's version, from /proc or nvidia-smi; '' when neither says."""
    with contextlib.suppress(OSError):
        text = Path("/proc/driver/nvidia/version").read_text()
        m = re.search(r"Kernel Module\s+(?:for \S+\s+)?([0-9][0-9.]+)", text)
        if m:
            return m.group(1)
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return ""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(
            [smi, "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
        return out.strip().splitlines()[0] if out.strip() else ""
    return ""


def gather_gpu(probe: bool = True, deadline_s: float = 120.0) -> dict[str, Any]:
    """The GPU fields of :class:`NodeFacts`, asked of torch in this process."""
    import torch

    out: dict[str, Any] = {
        "gathered": True,
        "torch_version": str(torch.__version__),
        "torch_cuda": str(torch.version.cuda or ""),
    }
    try:
        available = bool(torch.cuda.is_available())
    except Exception as exc:  # a broken driver raises here; it is a finding, not a crash
        out["cuda_error"] = f"{type(exc).__name__}: {exc}"[:1000]
        return out
    if not available:
        out["cuda_error"] = _why_no_cuda(out["torch_cuda"])
        return out
    out["cuda_available"] = True
    out["driver_version"] = driver_version()
    with contextlib.suppress(Exception):
        v = torch.cuda.nccl.version()  # type: ignore[no-untyped-call]
        out["nccl_version"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    with contextlib.suppress(Exception):  # the architectures this build has kernels for
        out["arch_list"] = tuple(str(a) for a in torch.cuda.get_arch_list())
    gpus = catalog.gpus()
    devices = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        try:
            name, why = catalog_gpu_name(p.name, p.total_memory, gpus), ""
        except UnknownGPUError as exc:
            name, why = "", str(exc)
        free = -1
        with contextlib.suppress(Exception):
            free = int(torch.cuda.mem_get_info(i)[0])
        cap = (int(p.major), int(p.minor))
        devices.append(
            DeviceFacts(
                index=i,
                cuda_name=str(p.name),
                catalog_name=name,
                name_error=why,
                memory_bytes=int(p.total_memory),
                free_bytes=free,
                capability=cap,
                bf16=cap >= (8, 0),
                fp16=cap >= (7, 0),
            )
        )
    out["devices"] = tuple(devices)
    if probe and devices:
        out["probe"] = probe_collectives(len(devices), "cuda", deadline_s)
    return out


def _why_no_cuda(torch_cuda: str) -> str:
    if not torch_cuda:
        return "torch was built without CUDA"
    if not Path("/dev/nvidiactl").exists():
        return "no NVIDIA driver loaded (/dev/nvidiactl missing)"
    return "the driver lists no usable device (CUDA_VISIBLE_DEVICES? driver too old for CUDA?)"


def probe_collectives(ranks: int, device: str = "cuda", deadline_s: float = 120.0) -> ProbeFacts:
    """An all-reduce and a send/recv ring among ``ranks`` fresh processes, one per GPU (NCCL),
    or gloo ranks on the CPU; a failure (a rank's error, the deadline) is in ``error``."""
    from sailor.profiler.procs import RankFailedError, check_devices, run_ranks

    backend = "nccl" if device == "cuda" else "gloo"
    t0 = time.monotonic()
    try:
        check_devices(device, range(ranks))
        res = run_ranks(
            "sailor.agent.check_rank",
            ranks,
            {"device": device, "bytes": PROBE_BYTES[device]},
            deadline_s=deadline_s,
        )
    except (RankFailedError, ValueError, OSError) as exc:
        return ProbeFacts(
            ranks=ranks,
            backend=backend,
            seconds=time.monotonic() - t0,
            error=str(exc)[-4000:],
        )
    bus = [r["bus_gbps"] for r in res if r.get("bus_gbps") is not None]
    return ProbeFacts(
        ranks=ranks,
        backend=backend,
        all_reduce_ok=all(r["all_reduce_ok"] for r in res),
        p2p_ok=all(r["p2p_ok"] for r in res),
        bus_gbps=min(bus) if bus else None,
        seconds=time.monotonic() - t0,
    )


async def gather_gpu_subprocess(probe: bool = True, timeout_s: float = 300.0) -> dict[str, Any]:
    """:func:`gather_gpu` in a child process (see the module docstring); a child that fails
    or outlives ``timeout_s`` is reported in ``cuda_error``."""
    cmd = [sys.executable, "-m", "sailor.agent.check_gather", "--deadline", str(timeout_s / 2)]
    if not probe:
        cmd.append("--no-probe")
    # its own session: the probe's ranks are its children, and a kill takes them too
    proc = await asyncio.create_subprocess_exec(
        *cmd,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        return {"gathered": True, "cuda_error": f"the check process outlived {timeout_s:.0f} s"}
    finally:  # also on cancellation (the agent stopped during its check)
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
    if proc.returncode != 0:
        tail = err.decode(errors="replace").strip().splitlines()[-5:]
        why = f"the check process exited {proc.returncode}: " + " | ".join(tail)
        return {"gathered": True, "cuda_error": why[:1000]}
    return child_facts(out)


def child_facts(out: bytes) -> dict[str, Any]:
    """The GPU facts the check's child printed (``main``); output that is not its facts
    (not JSON, nested too deep to read, not an object, fields wrong) is reported in
    ``cuda_error`` like a failed child, rather than raised into the agent's check."""
    try:
        raw = load_json(out, "the check process's output")
        if not isinstance(raw, dict):
            raise ValueError(f"the check process printed {type(raw).__name__}, not its facts")
        facts = NodeFacts.model_validate({"node_kind": "gpu", **raw})
    except ValueError as exc:  # JSONDecodeError, JsonTooDeepError, ValidationError
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return {"gathered": True, "cuda_error": f"the check process printed no facts: {why}"[:1000]}
    return facts.model_dump(exclude={"node_kind", "gpu_type", "gpus", "hostname"})


async def reach_servers(
    nats_urls: str | Sequence[str],
    etcd_endpoints: str | Sequence[str],
    security: SecurityConfig | None,
    name: str,
    timeout_s: float = 5.0,
) -> tuple[EndpointFacts, EndpointFacts]:
    """Connect to NATS and etcd as this node (its ``security``) and ask each one thing; a
    list of servers (a cluster) is reached as the daemons reach it, through any member."""
    return await asyncio.gather(
        _reach_nats(_listed(nats_urls), security, name, timeout_s),
        _reach_etcd(_listed(etcd_endpoints), security, timeout_s),
    )


def _listed(urls: str | Sequence[str]) -> list[str]:
    return [urls] if isinstance(urls, str) else list(urls)


async def _reach_nats(
    urls: list[str], security: SecurityConfig | None, name: str, timeout_s: float
) -> EndpointFacts:
    url = redact_urls(urls)  # shown and stored (node facts): never with its password
    t0 = time.monotonic()
    try:
        nc = await connect_nats(urls, f"{name}-check", timeout=timeout_s, security=security)
        try:
            await nc.flush(timeout=max(1, int(timeout_s)))  # a round trip to the server
        finally:
            await close_nats(nc, timeout_s)
    except Exception as exc:  # any failure to connect is the finding
        return _unreachable(url, security, t0, exc)
    return EndpointFacts(
        url=url, reachable=True, tls=security is not None, seconds=time.monotonic() - t0
    )


async def _reach_etcd(
    endpoints: list[str], security: SecurityConfig | None, timeout_s: float
) -> EndpointFacts:
    endpoint = ",".join(endpoints)
    t0 = time.monotonic()
    try:
        store = await asyncio.wait_for(
            connect_etcd(endpoints, op_timeout=timeout_s, security=security),
            timeout_s * len(endpoints) + 1,
        )  # connect_etcd reads the revision: a round trip, authenticated
        await store.close()
    except Exception as exc:
        return _unreachable(endpoint, security, t0, exc)
    return EndpointFacts(
        url=endpoint, reachable=True, tls=security is not None, seconds=time.monotonic() - t0
    )


def _unreachable(
    url: str, security: SecurityConfig | None, t0: float, exc: BaseException
) -> EndpointFacts:
    why = str(exc) or type(exc).__name__
    return EndpointFacts(
        url=url,
        reachable=False,
        tls=security is not None,
        seconds=time.monotonic() - t0,
        error=f"{type(exc).__name__}: {why}"[:1000],
    )


def main(argv: list[str] | None = None) -> None:
    """Child side of :func:`gather_gpu_subprocess`: print the GPU facts as JSON."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m sailor.agent.check_gather")
    p.add_argument("--no-probe", action="store_true")
    p.add_argument("--deadline", type=float, default=120.0)
    args = p.parse_args(argv)
    facts = node_facts(None, gather_gpu(probe=not args.no_probe, deadline_s=args.deadline))
    sys.stdout.write(facts.model_dump_json())


if __name__ == "__main__":
    main()
