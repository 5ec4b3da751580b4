"""The verdicts of ``sailor check``: gathered facts in, one ok / warn / fail line per check out.

Pure: :func:`judge` takes :class:`~sailor.schemas.node_check.NodeFacts` and returns a
:class:`~sailor.schemas.node_check.CheckReport`; no torch, no I/O (``check_gather`` collects
the facts, the CLI and the agent print or act on the report). A line fails only when the node
cannot serve as configured (no GPU on a GPU node, a device the catalog does not know or that
is not the configured type, fewer GPUs than configured, a device torch's build has no kernels
for, a failed NCCL probe, a server that does not answer); it warns when the node serves but
a person should look (another process holds GPU memory, the probe or the servers were not
checked).

Node kinds: a config whose ``node.gpu_type`` is ``cpu`` is a CPU node (the demo's and the
tests' workers): its GPU checks are skipped and it passes on reachability alone. Any other
node is a GPU node; ``allow_cpu`` turns its "no GPU" from a failure into a warning, for a
person who runs the check on a machine without one to see the rest.
"""

from __future__ import annotations

from sailor.catalog.torch_builds import DEFAULT_BUILD, TORCH_VERSION, build_for, serving_arch, sm
from sailor.schemas.node_check import (
    CheckLine,
    CheckReport,
    DeviceFacts,
    EndpointFacts,
    NodeFacts,
    Verdict,
)

__all__ = ["FREE_MEMORY_WARN", "NEEDS_GPU", "judge"]

FREE_MEMORY_WARN = 0.9
"""Warn when less than this fraction of a device's memory is free at the check: a CUDA
context takes ~0.3-0.5 GiB (under 1% of a 40 GB card); more means another process."""

NEEDS_GPU = (
    "a GPU node needs an NVIDIA GPU with its driver (nvidia-smi lists it) and a CUDA build of "
    f"torch=={TORCH_VERSION} with NCCL (pip install --force-reinstall torch=={TORCH_VERSION} "
    f"--index-url {DEFAULT_BUILD.index_url}: it runs every catalog GPU); on a CPU host use a "
    "node config with gpu_type: cpu, or pass --allow-cpu to check the rest"
)

_GIB = float(1 << 30)


def judge(facts: NodeFacts, node_id: str = "", allow_cpu: bool = False) -> CheckReport:
    """The report of ``facts``: a line per check; ``serves`` when none failed."""
    lines = [_node_line(facts)]
    if facts.node_kind == "gpu":
        lines += _gpu_lines(facts, allow_cpu)
    lines += [
        _endpoint_line("nats", facts.nats, "nats_urls"),
        _endpoint_line("etcd", facts.etcd, "etcd_endpoints"),
    ]
    serves = not any(line.verdict == "fail" for line in lines)
    return CheckReport(node_id=node_id, lines=tuple(lines), facts=facts, serves=serves)


def _line(check: str, verdict: Verdict, detail: str, action: str = "") -> CheckLine:
    return CheckLine(check=check, verdict=verdict, detail=detail, action=action)


def _node_line(f: NodeFacts) -> CheckLine:
    if f.node_kind == "cpu":
        return _line("node", "ok", f"cpu node (config gpu_type: {f.gpu_type}): GPU checks skipped")
    if not f.gpu_type:
        return _line(
            "node",
            "warn",
            "no node config: checked as a GPU node of any catalog type; servers not checked",
            "pass --config agent.yaml to check the configured GPU type and count and reach "
            "NATS and etcd with this node's credentials",
        )
    return _line("node", "ok", f"gpu node: {f.gpus} x {f.gpu_type} configured")


def _gpu_lines(f: NodeFacts, allow_cpu: bool) -> list[CheckLine]:
    if not f.gathered:
        return [
            _line(
                "cuda",
                "warn",
                "GPU facts not gathered (the agent's check mode is off)",
                "run sailor check --config <agent config> on this node",
            )
        ]
    if not f.cuda_available:
        build = (
            f"torch {f.torch_version} is a CPU-only build"
            if not f.torch_cuda
            else f"torch {f.torch_version} (CUDA {f.torch_cuda}) sees no CUDA device"
        )
        why = f": {f.cuda_error}" if f.cuda_error and f.torch_cuda else ""
        return [_line("cuda", "warn" if allow_cpu else "fail", f"no GPU: {build}{why}", NEEDS_GPU)]
    out = [_line("cuda", "ok", f"CUDA {f.torch_cuda}, torch {f.torch_version}")]
    out.append(
        _line("driver", "ok", f"NVIDIA driver {f.driver_version}")
        if f.driver_version
        else _line(
            "driver",
            "warn",
            "driver version unknown (no /proc/driver/nvidia/version, no nvidia-smi)",
            "check the driver with nvidia-smi",
        )
    )
    out.append(
        _line("nccl", "ok", f"NCCL {f.nccl_version}")
        if f.nccl_version
        else _line(
            "nccl",
            "fail",
            "torch has no NCCL: GPUs of a job cannot communicate",
            f"install a CUDA build of torch=={TORCH_VERSION} (each ships its NCCL): pip install "
            f"--force-reinstall torch=={TORCH_VERSION} --index-url {DEFAULT_BUILD.index_url}",
        )
    )
    out.append(_count_line(f))
    out += [_device_line(d, f.gpu_type) for d in f.devices]
    out += _mixed_line(f)
    out += _arch_line(f)
    out.append(_precision_line(f.devices))
    out += _probe_lines(f)
    return out


def _count_line(f: NodeFacts) -> CheckLine:
    n = len(f.devices)
    if n == 0:
        return _line("devices", "fail", "CUDA is available but lists no device", NEEDS_GPU)
    if f.gpus and n < f.gpus:
        return _line(
            "devices",
            "fail",
            f"{n} GPU(s) visible, the config says {f.gpus}",
            f"check CUDA_VISIBLE_DEVICES and nvidia-smi, or set node.gpus: {n}",
        )
    if f.gpus and n > f.gpus:
        return _line(
            "devices",
            "warn",
            f"{n} GPUs visible, the config uses {f.gpus}: the others stay idle",
            f"set node.gpus: {n} to use them all",
        )
    return _line("devices", "ok", f"{n} GPU(s) visible")


def _device_line(d: DeviceFacts, expected: str) -> CheckLine:
    check = f"gpu{d.index}"
    mem = f"{d.memory_bytes / _GIB:.1f} GiB"
    what = f"{d.cuda_name!r}, {mem}, compute capability {d.capability[0]}.{d.capability[1]}"
    if not d.catalog_name:
        return _line(
            check,
            "fail",
            f"{what}: {d.name_error or 'no catalog GPU type'}",
            "add the GPU to the catalog (sailor/catalog/gpus.json and cuda_names.py), or "
            "profile it with --gpu-type NAME if it is a known type under another name",
        )
    if expected and d.catalog_name != expected:
        return _line(
            check,
            "fail",
            f"{what} is a {d.catalog_name}; the config says {expected}",
            f"set node.gpu_type: {d.catalog_name} in the agent config",
        )
    if d.free_bytes >= 0 and d.free_bytes < FREE_MEMORY_WARN * d.memory_bytes:
        used = (d.memory_bytes - d.free_bytes) / _GIB
        return _line(
            check,
            "warn",
            f"{what} = {d.catalog_name}; {used:.1f} GiB already in use",
            "another process holds GPU memory (nvidia-smi): plans assume the whole device",
        )
    return _line(check, "ok", f"{what} = {d.catalog_name}")


def _mixed_line(f: NodeFacts) -> list[CheckLine]:
    types = sorted({d.catalog_name for d in f.devices if d.catalog_name})
    if f.gpu_type or len(types) < 2:
        return []  # with a config, each device line compares against the configured type
    return [
        _line(
            "devices",
            "fail",
            f"mixed GPU types on one node: {', '.join(types)}",
            "a node has one GPU type: restrict CUDA_VISIBLE_DEVICES to one type per agent",
        )
    ]


def _arch_line(f: NodeFacts) -> list[CheckLine]:
    """Whether this torch build has kernels for every device: a device it has none for (no
    ``sm_XY`` of its major revision at or below its minor one, no PTX at or below its
    capability) fails at its first kernel with "no kernel image is available for execution
    on the device" (the PyPI build of torch 2.13 on a V100: CUDA 13 has no sm_70)."""
    if not f.devices:
        return []
    build = f"torch {f.torch_version} (CUDA {f.torch_cuda})"
    if not f.arch_list:
        return [
            _line(
                "arch",
                "warn",
                f"{build} reported no GPU architectures (torch.cuda.get_arch_list() empty)",
                "check that torch runs a kernel on each GPU: python -c 'import torch; "
                'torch.ones(1, device="cuda").sum()\'',
            )
        ]
    archs = ", ".join(f.arch_list)
    bad = [d for d in f.devices if serving_arch(f.arch_list, d.capability) is None]
    if not bad:
        served = sorted(
            {f"{sm(d.capability)} by {serving_arch(f.arch_list, d.capability)}" for d in f.devices}
        )
        return [_line("arch", "ok", f"{build} has kernels for every GPU: {', '.join(served)}")]
    found = "; ".join(
        f"gpu{d.index} {d.cuda_name!r}, compute capability {d.capability[0]}.{d.capability[1]} "
        f"({sm(d.capability)})"
        for d in bad
    )
    fix = build_for(d.capability for d in f.devices)
    wanted = ", ".join(sorted({sm(d.capability) for d in bad}))
    if fix is None:
        action = (
            f"no CUDA build of torch {TORCH_VERSION} known to Sailor has {wanted}: use GPUs of "
            "a catalog type (sailor/catalog/torch_builds.py lists the builds)"
        )
    else:
        action = (
            f"install the build that has {wanted} (CUDA {fix.cuda}, NCCL {fix.nccl}): pip "
            f"install --force-reinstall torch=={TORCH_VERSION} --index-url {fix.index_url} "
            "(cloud-init: SAILOR_TORCH_INDEX in /etc/sailor/install.env); every node of a job "
            "needs the same build, one NCCL version (docs/gpu.md)"
        )
    return [
        _line(
            "arch",
            "fail",
            f"{found}: {build} has kernels for {archs} only, so every kernel there fails "
            "with 'no kernel image is available for execution on the device'",
            action,
        )
    ]


def _precision_line(devices: tuple[DeviceFacts, ...]) -> CheckLine:
    none = [d.index for d in devices if not (d.bf16 or d.fp16)]
    if none:
        return _line(
            "precision",
            "fail",
            f"GPU(s) {none} have neither bf16 nor fp16 tensor math (compute capability < 7.0)",
            "use GPUs of compute capability 7.0 (V100) or newer",
        )
    fp16_only = [d.index for d in devices if not d.bf16]
    if fp16_only:
        return _line(
            "precision",
            "ok",
            f"fp16 only on GPU(s) {fp16_only} (no bf16): jobs using them train in fp16 with "
            "loss scaling",
        )
    return _line("precision", "ok", "bf16 and fp16 on every GPU")


def _probe_lines(f: NodeFacts) -> list[CheckLine]:
    p = f.probe
    if p is None:
        return [
            _line(
                "collective",
                "warn",
                "NCCL probe not run",
                "run sailor check without --no-probe to test NCCL among this node's GPUs",
            )
        ]
    fix = (
        "rerun with NCCL_DEBUG=INFO; check nvidia-smi topo -m, and that nvidia-fabricmanager "
        "runs on NVSwitch machines (A100/H100 SXM)"
    )
    if p.error:
        return [
            _line("collective", "fail", f"NCCL probe among {p.ranks} GPU(s) failed: {p.error}", fix)
        ]
    if not p.all_reduce_ok:
        return [_line("collective", "fail", "all-reduce returned a wrong sum", fix)]
    bw = f", bus bandwidth {p.bus_gbps:.1f} GB/s" if p.bus_gbps is not None else ""
    out = [_line("collective", "ok", f"{p.backend} all-reduce among {p.ranks} GPU(s) exact{bw}")]
    if p.ranks < 2:
        out.append(_line("p2p", "ok", "one GPU: no peer to send to"))
    elif p.p2p_ok:
        out.append(_line("p2p", "ok", f"{p.backend} send/recv ring among {p.ranks} GPUs exact"))
    else:
        out.append(_line("p2p", "fail", "send/recv ring delivered wrong data", fix))
    return out


def _endpoint_line(check: str, e: EndpointFacts | None, key: str) -> CheckLine:
    if e is None:
        return _line(check, "warn", "not checked", f"pass --config agent.yaml to reach {check}")
    how = "TLS with this node's certificate" if e.tls else "no TLS (security: not configured)"
    if e.reachable:
        return _line(check, "ok", f"{e.url} answered in {e.seconds:.2f} s ({how})")
    return _line(
        check,
        "fail",
        f"{e.url} did not answer ({how}): {e.error}",
        f"check {key} in the agent config, that the server runs and the port is open from "
        "here; with security, this node's certificate and NATS login (sailor certs issue)",
    )
