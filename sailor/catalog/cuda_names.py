"""CUDA device names -> catalog GPU types: what ``torch.cuda.get_device_name`` reports, mapped to
the name the planner, the profiles and the node configs use ("NVIDIA H100 80GB HBM3" -> "H100-80").

A pure lookup in a table of the real CUDA name strings, with the device's total memory to
tell variants apart that share a name (a GH200 with 96 GB or 144 GB of HBM both report
"NVIDIA GH200 480GB") and to refuse a device whose memory does not match its name (a MIG
slice, a cut-down card). Names are compared without case, surrounding and repeated spaces,
and without a leading "NVIDIA " (drivers before ~R470 report "GeForce RTX 2080 Ti", later
ones "NVIDIA GeForce RTX 2080 Ti"). Nothing is guessed: a name not in the table, or a known
GPU the catalog has no spec sheet for (V100 32 GB, A10G, H100 NVL), is refused with
:class:`UnknownGPUError`, which names the device, its memory and the catalog types it could
be; ``--gpu-type`` overrides the lookup where a person knows better.

Memory figures: a device reports its usable memory, below the nominal size on the spec sheet
(``torch.cuda.get_device_properties(i).total_memory``: A100 40 GB 39.4 GiB, H100 80 GB HBM3
79.1 GiB, T4 14.7 GiB, L4 21.4 GiB, RTX 2080 Ti 10.7 GiB of their 40, 80, 16, 24 and 11
GiB), hence the window of :data:`MEMORY_FRACTION`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from sailor.schemas import GPUSpec
from sailor.schemas.device_kind import is_cpu_type

__all__ = [
    "CUDA_NAMES",
    "MEMORY_FRACTION",
    "CudaName",
    "UnknownGPUError",
    "catalog_gpu_name",
    "normalize_cuda_name",
]

MEMORY_FRACTION = (0.85, 1.02)
"""A device's reported total memory as a fraction of its nominal size: the lowest seen is
the L4 (21.45 of 24 GiB, 0.89) and the T4 (14.75 of 16 GiB, 0.92); the upper bound leaves
room for rounding in the nominal figure."""

_GIB = 1 << 30


@dataclass(frozen=True)
class CudaName:
    """One CUDA device name with its nominal memory; ``catalog`` is its catalog type, or ""
    for a GPU the catalog has no spec sheet for (refused with ``note`` as the reason)."""

    cuda_name: str
    memory_gib: float
    catalog: str
    note: str = ""

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * _GIB)


_NOT_IN_CATALOG = "not in the catalog: add its spec sheet to sailor/catalog/gpus.json"

CUDA_NAMES: tuple[CudaName, ...] = (
    # A100: SXM4 and PCIe, 40 and 80 GB
    CudaName("NVIDIA A100-SXM4-40GB", 40, "A100-40"),
    CudaName("NVIDIA A100-PCIE-40GB", 40, "A100-40"),
    CudaName("NVIDIA A100-SXM4-80GB", 80, "A100-80"),
    CudaName("NVIDIA A100 80GB PCIe", 80, "A100-80"),
    # H100: SXM5 reports its memory kind, PCIe its form factor; NVL has 94 GB
    CudaName("NVIDIA H100 80GB HBM3", 80, "H100-80"),
    CudaName("NVIDIA H100 PCIe", 80, "H100-80"),
    CudaName("NVIDIA H100 NVL", 94, "", _NOT_IN_CATALOG),
    CudaName("NVIDIA H200", 141, "H200"),
    CudaName("NVIDIA H200 NVL", 141, "", _NOT_IN_CATALOG),
    # GH200: "480GB" is the Grace LPDDR5X plus HBM; the HBM (what CUDA allocates) tells apart
    CudaName("NVIDIA GH200 480GB", 96, "GH-96"),
    CudaName("NVIDIA GH200 480GB", 144, "", _NOT_IN_CATALOG),
    CudaName("NVIDIA GH200 144G HBM3e", 144, "", _NOT_IN_CATALOG),
    # V100: the catalog has the 16 GB card only
    CudaName("Tesla V100-SXM2-16GB", 16, "V100-16"),
    CudaName("Tesla V100-PCIE-16GB", 16, "V100-16"),
    CudaName("Tesla V100-SXM2-32GB", 32, "", _NOT_IN_CATALOG),
    CudaName("Tesla V100-PCIE-32GB", 32, "", _NOT_IN_CATALOG),
    CudaName("Tesla V100S-PCIE-32GB", 32, "", _NOT_IN_CATALOG),
    CudaName("Tesla T4", 16, "T4"),
    CudaName("NVIDIA L4", 24, "L4"),
    CudaName("NVIDIA A10G", 24, "", _NOT_IN_CATALOG),
    CudaName("NVIDIA A10", 24, "", _NOT_IN_CATALOG),
    # Workstation and consumer cards of the original artifact's cluster
    CudaName("NVIDIA GeForce RTX 3090", 24, "RTX-3090"),
    CudaName("NVIDIA TITAN RTX", 24, "Titan-RTX"),
    CudaName("NVIDIA GeForce RTX 2080 Ti", 11, "RTX-2080"),
)
"""Every catalog GPU's CUDA names (tests check that each catalog GPU but ``cpu`` has one)."""


class UnknownGPUError(ValueError):
    """A CUDA device that maps to no single catalog GPU type. Permanent: retrying gives the
    same answer; pass ``--gpu-type`` (or fix the catalog) instead."""

    def __init__(self, cuda_name: str, memory_bytes: int, why: str, candidates: Sequence[str]):
        could = ", ".join(candidates) if candidates else "none"
        super().__init__(
            f"GPU {cuda_name!r} with {memory_bytes / _GIB:.1f} GiB: {why} (catalog types it "
            f"could be: {could}); pass --gpu-type with its catalog name to override"
        )
        self.cuda_name = cuda_name
        self.memory_bytes = memory_bytes
        self.why = why
        self.candidates = tuple(candidates)


def normalize_cuda_name(name: str) -> str:
    """Lower case, single spaces, no leading "nvidia " (older drivers omit it)."""
    key = " ".join(name.split()).lower()
    return key.removeprefix("nvidia ")


def _fits(memory_bytes: int, nominal_bytes: int) -> bool:
    lo, hi = MEMORY_FRACTION
    return lo * nominal_bytes <= memory_bytes <= hi * nominal_bytes


def catalog_gpu_name(
    cuda_name: str,
    memory_bytes: int,
    gpus: Mapping[str, GPUSpec],
    table: Sequence[CudaName] = CUDA_NAMES,
) -> str:
    """The catalog type of a CUDA device named ``cuda_name`` with ``memory_bytes`` of total
    memory; :class:`UnknownGPUError` when the table does not know the name, the memory fits
    none or several of its variants, or the GPU is not in ``gpus`` (the catalog)."""
    key = normalize_cuda_name(cuda_name)
    rows = [r for r in table if normalize_cuda_name(r.cuda_name) == key]
    if not rows:
        return _refuse(cuda_name, memory_bytes, "not a CUDA device name Sailor knows", gpus)
    fit = [r for r in rows if _fits(memory_bytes, r.memory_bytes)]
    if not fit:
        sizes = " or ".join(f"{r.memory_gib:g} GB" for r in rows)
        return _refuse(cuda_name, memory_bytes, f"this name has {sizes} (MIG slice?)", gpus)
    types = sorted({r.catalog for r in fit})
    if len(types) > 1:
        return _refuse(
            cuda_name,
            memory_bytes,
            "ambiguous: its memory fits "
            + ", ".join(t or "a GPU not in the catalog" for t in types),
            gpus,
            [t for t in types if t],
        )
    row = fit[0]
    if not row.catalog:
        return _refuse(cuda_name, memory_bytes, row.note, gpus)
    if row.catalog not in gpus:
        return _refuse(cuda_name, memory_bytes, f"{row.catalog} is not in this catalog", gpus)
    return row.catalog


def _refuse(
    cuda_name: str,
    memory_bytes: int,
    why: str,
    gpus: Mapping[str, GPUSpec],
    candidates: Sequence[str] | None = None,
) -> str:
    """Raise, naming the catalog GPUs whose memory the device fits (or ``candidates``)."""
    if candidates is None:
        candidates = [
            n for n, g in gpus.items() if not is_cpu_type(n) and _fits(memory_bytes, g.memory_bytes)
        ]
    raise UnknownGPUError(cuda_name, memory_bytes, why, candidates)
