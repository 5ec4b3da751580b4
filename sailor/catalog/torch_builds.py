"""Which torch build runs which GPU: the compute capabilities of the catalog's GPU types, the
CUDA builds of the pinned torch release with the architectures they carry, and the rule that
decides whether a build's kernels run on a device.

Why it matters: torch ships one wheel per CUDA version, each compiled for a fixed list of
GPU architectures (``torch.cuda.get_arch_list()``). A device whose architecture is not
served by that list fails at its first kernel ("no kernel image is available for execution
on the device"). The PyPI wheel of torch 2.13.0 is the CUDA 13.0 build, and CUDA 13 dropped
Volta (sm_70): every V100 rank would die on it. The CUDA 12.6 build still has sm_70. Each
build also bundles its own NCCL, and NCCL promises nothing for mixed versions in one
communicator: so one job runs one build on every node (``sailor.controller.runtime_admission``).

Sources (checked 2026-11): the support matrix of the PyTorch releases (RELEASE.md, "PyTorch
CUDA Support Matrix" and "Release Compatibility Matrix", the 2.13 row: CUDA 12.6 with NCCL
2.29.3, CUDA 13.0 with NCCL 2.29.7; the RFCs pytorch/pytorch#172352 and #190355 list the
architectures per build); the torch 2.13.0 wheel on PyPI requires ``cuda-toolkit==13.0.3``
and ``nvidia-nccl-cu13==2.29.7`` (its metadata, read with ``pip install --dry-run
--report``); NVIDIA's compute capabilities (developer.nvidia.com/cuda-gpus) and the CUDA
programming guide's binary compatibility rule (below). The arch lists here are the matrix's,
not read from the wheels: the check itself compares a device with the arch list of the torch
it runs (``sailor check``); these lists only choose the build to point an operator at.

Pure: no torch, no I/O. Must never import torch (the controller and the CLI read it).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = [
    "BUILDS",
    "CATALOG_CAPABILITY",
    "DEFAULT_BUILD",
    "TORCH_VERSION",
    "TorchBuild",
    "build_for",
    "serving_arch",
    "sm",
]

TORCH_VERSION = "2.13.0"
"""The torch release pinned in pyproject.toml (a test keeps the two equal)."""


@dataclass(frozen=True)
class TorchBuild:
    """One CUDA build of :data:`TORCH_VERSION`: where pip finds it and what it carries."""

    tag: str
    cuda: str
    nccl: str
    arch_list: tuple[str, ...]
    index_url: str
    on_pypi: bool = False


CU126 = TorchBuild(
    tag="cu126",
    cuda="12.6",
    nccl="2.29.3",
    # "CUDA 12.6.3: Maxwell(5.0), Pascal(6.0), Volta(7.0), Turing(7.5), Ampere(8.0, 8.6),
    # Hopper(9.0)"
    arch_list=("sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"),
    index_url="https://download.pytorch.org/whl/cu126",
)
CU130 = TorchBuild(
    tag="cu130",
    cuda="13.0",
    nccl="2.29.7",
    # "CUDA 13.0: Turing(7.5), Ampere(8.0, 8.6), Hopper(9.0), Blackwell(10.0, 12.0+PTX)"
    arch_list=("sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120", "compute_120"),
    index_url="https://download.pytorch.org/whl/cu130",
    on_pypi=True,
)

BUILDS: tuple[TorchBuild, ...] = (CU126, CU130)
"""The builds an operator is pointed at, in order of preference."""

DEFAULT_BUILD = CU126
"""What a deployment installs unless told otherwise (cloud-init's ``SAILOR_TORCH_INDEX``):
the build that runs every GPU type of the catalog, V100 (7.0) included, so a pool that mixes
them gets one build and one NCCL. A test checks it against :data:`CATALOG_CAPABILITY`."""

CATALOG_CAPABILITY: dict[str, tuple[int, int]] = {
    "V100-16": (7, 0),
    "T4": (7, 5),
    "Titan-RTX": (7, 5),
    "RTX-2080": (7, 5),
    "A100-40": (8, 0),
    "A100-80": (8, 0),
    "RTX-3090": (8, 6),
    "L4": (8, 9),
    "H100-80": (9, 0),
    "H200": (9, 0),
    "GH-96": (9, 0),
}
"""Compute capability of each GPU type of ``catalog/gpus.json`` (NVIDIA's CUDA GPUs list);
``cpu`` has none. A test keeps the keys equal to the catalog's GPU types."""

_ARCH = re.compile(r"(sm|compute)_(\d+)(\d)([af]?)")


def sm(capability: tuple[int, int]) -> str:
    """``sm_XY`` of a compute capability (7, 0) -> 'sm_70', (10, 0) -> 'sm_100'."""
    return f"sm_{capability[0]}{capability[1]}"


def _serves(entry: str, capability: tuple[int, int]) -> bool:
    m = _ARCH.fullmatch(entry.strip())
    if m is None:
        return False
    kind, major, minor, suffix = m.group(1), int(m.group(2)), int(m.group(3)), m.group(4)
    cap_major, cap_minor = capability
    if suffix == "a":  # architecture-specific code runs on that exact capability only
        return (major, minor) == capability
    if kind == "sm" or suffix == "f":
        # a cubin runs on devices of its major revision and the same or a higher minor one
        # (CUDA programming guide, "Binary Compatibility"); family code ('f') likewise
        return major == cap_major and minor <= cap_minor
    # PTX is compiled by the driver for the device at load time: any later capability
    return (major, minor) <= capability


def serving_arch(arch_list: Iterable[str], capability: tuple[int, int]) -> str | None:
    """The entry of ``arch_list`` (``torch.cuda.get_arch_list()``) whose code runs on a device
    of ``capability``: the newest cubin that fits (as the CUDA runtime picks), else the newest
    PTX the driver can JIT from; None when no entry does (its first kernel would fail)."""
    entries = sorted((e for e in arch_list if _serves(e, capability)), key=_version, reverse=True)
    cubins = [e for e in entries if e.startswith("sm_")]
    best = cubins or entries
    return best[0] if best else None


def _version(entry: str) -> tuple[int, int]:
    m = _ARCH.fullmatch(entry.strip())
    return (int(m.group(2)), int(m.group(3))) if m else (0, 0)


def build_for(capabilities: Iterable[tuple[int, int]]) -> TorchBuild | None:
    """The first build of :data:`BUILDS` that runs every one of ``capabilities``; None if none."""
    caps = list(capabilities)
    for build in BUILDS:
        if all(serving_arch(build.arch_list, c) is not None for c in caps):
            return build
    return None
