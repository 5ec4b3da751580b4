"""Hardware: GPU types, zones, nodes and the pool of nodes a plan may use."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator

from sailor.schemas._base import SCHEMA_VERSION, Frozen, WireMessage, field_error
from sailor.schemas.zones import region_of

__all__ = ["MAX_GPUS_PER_NODE", "GPUSpec", "NodeSpec", "Pool", "PoolEntry", "TorchRuntime", "Zone"]


class GPUSpec(Frozen):
    """Spec-sheet figures of one GPU type (one device, not one node)."""

    name: str = Field(description="Canonical name, e.g. 'A100-40'.")
    memory_bytes: int = Field(gt=0, description="Device memory in bytes (spec sheet).")
    peak_tflops_fp16: float = Field(
        ge=0, description="Dense fp16 tensor-core peak, TFLOP/s (fp32 accumulate)."
    )
    peak_tflops_bf16: float = Field(
        ge=0, description="Dense bf16 peak, TFLOP/s; 0 when the GPU has no bf16 units."
    )
    peak_tflops_fp32: float = Field(gt=0, description="Dense fp32 (non-tensor) peak, TFLOP/s.")
    memory_bandwidth_gbps: float = Field(gt=0, description="Device memory bandwidth, GB/s.")
    intra_node_link_gbps: float = Field(
        gt=0, description="Per-GPU bandwidth to the other GPUs of its node (NVLink/PCIe), GB/s."
    )
    intra_node_link: str = Field(description="Kind of intra-node link, e.g. 'NVLink3', 'PCIe4'.")
    intra_node_pair_link_gbps: float | None = Field(
        default=None,
        gt=0,
        description="Bandwidth between one pair of GPUs of a node whose GPUs are linked "
        "directly to each other (a mesh, no switch), GB/s: a group of n of them reaches "
        "n-1 pair links at most (link_gbps_among). None: a switch (NVSwitch, a PCIe "
        "switch) gives every GPU its whole link to any group of peers.",
    )
    default_gpus_per_node: int = Field(gt=0, description="GPUs per node of the usual VM shape.")
    source: str = Field(description="Where these figures come from.")

    def link_gbps_among(self, gpus: int) -> float:
        """Per-GPU bandwidth to its peers in a group of ``gpus`` GPUs of one node: the whole
        link, or on a mesh the ``gpus - 1`` pair links it has to the group, if fewer."""
        if self.intra_node_pair_link_gbps is None or gpus < 2:
            return self.intra_node_link_gbps
        return min(self.intra_node_link_gbps, self.intra_node_pair_link_gbps * (gpus - 1))

    def peak_tflops(self, precision: str) -> float:
        """Peak for a training precision; fp16 stands in where bf16 is missing."""
        if precision == "bf16":
            return self.peak_tflops_bf16 or self.peak_tflops_fp16
        if precision == "fp16":
            return self.peak_tflops_fp16
        return self.peak_tflops_fp32


ZONE_NAME = r"^\S+$"
"""A zone name: non-empty, without spaces (as :meth:`Zone.parse` requires)."""


class Zone(Frozen):
    """A cloud zone. Two zones of one region share the region's cheaper network."""

    cloud: str = Field(description="Cloud provider, e.g. 'gcp', 'aws', 'local'.")
    region: str = Field(description="Region, e.g. 'us-central1'.")
    name: str = Field(description="Zone name, e.g. 'us-central1-a'.")

    @classmethod
    def parse(cls, text: str, cloud: str = "gcp") -> Zone:
        """Zone from its name (``us-central1-a``, ``us-east-1a``; region: ``schemas.zones``)."""
        if not text or any(c.isspace() for c in text):
            raise field_error("zone", text, "must be a non-empty name without spaces")
        region = region_of(text)
        return cls(cloud=cloud, region=region, name=text)


class TorchRuntime(Frozen):
    """The torch build a node's workers run, as its agent's node check found it. Each CUDA
    build of torch bundles its own NCCL, and NCCL promises nothing for one communicator of
    mixed versions, and the workers of one job must run one Sailor release: the controller
    places the nodes of one runtime in a job (``controller/runtime_admission``)."""

    # 64 characters: a local version such as '2.13.0a0+git1a2b3c4.cu126' is ~30; what is
    # longer is not a version, and every node's record is read on every controller pass
    torch_version: str = Field(
        default="", max_length=64, description="torch.__version__, e.g. '2.13.0+cu126'."
    )
    torch_cuda: str = Field(
        default="",
        max_length=64,
        description="CUDA version torch was built with ('' CPU-only build).",
    )
    nccl_version: str = Field(
        default="",
        max_length=64,
        description="torch.cuda.nccl.version(), e.g. '2.29.3' ('' none).",
    )
    sailor_release: str = Field(
        default="",
        max_length=128,
        description="The Sailor release its workers run: the package's version and a digest "
        "of its code, e.g. '0.1.0+3f2a9c1e0b7d' ('' unknown). A job's workers run one "
        "(controller/runtime_admission).",
    )


class NodeSpec(WireMessage):
    """One node (VM) as the runtime sees it: what its agent registers under ``nodes/<id>``.
    Versioned like every wire message, so a field a newer agent adds is dropped by an older
    controller during a rolling upgrade instead of making the node unreadable.

    Also a section of the agent's config file, which may carry the version it was written
    with: a node is always read as this release's version (an older one has no field this
    release lacks), so what an agent registers says what it writes, and two readings of
    the same node compare equal whatever version wrote them."""

    @model_validator(mode="before")
    @classmethod
    def _as_this_release(cls, data: Any) -> Any:
        if isinstance(data, dict):
            v = data.get("schema_version")
            if isinstance(v, int) and not isinstance(v, bool) and 1 <= v < SCHEMA_VERSION:
                return data | {"schema_version": SCHEMA_VERSION}
        return data

    node_id: str = Field(min_length=1, description="Unique id of the node.")
    gpu_type: str = Field(description="GPU type name from the catalog.")
    gpus: int = Field(gt=0, description="GPUs on this node.")
    zone: str = Field(pattern=ZONE_NAME, description="Zone name (no spaces).")
    spot: bool = Field(default=True, description="Spot/preemptible VM.")
    address: str = Field(default="", description="Reachable address (host or host:port).")
    runtime: TorchRuntime | None = Field(
        default=None,
        description="The node's torch build and NCCL version, filled by its agent from the "
        "node check before it registers (wire version 5). None: not gathered (a CPU node, "
        "check mode off, an agent of an older release): placed with any version. In an "
        "agent config it stands only where the check gathers nothing (tests).",
    )


MAX_POOL_NODES = 100_000
"""Nodes of one pool entry at most: far beyond any cluster, short of what makes the planner
run out of memory instead of answering."""
MAX_GPUS_PER_NODE = 64
"""GPUs per node at most (today's largest VM shapes have 16)."""


class PoolEntry(Frozen):
    """A number of identical nodes available in one zone."""

    gpu_type: str = Field(description="GPU type name from the catalog.")
    zone: str = Field(pattern=ZONE_NAME, description="Zone name, e.g. 'us-central1-a'.")
    # strict: `nodes: true` or `spot: "yes"` is a mistake, not 1 node or spot
    nodes: int = Field(
        ge=0, le=MAX_POOL_NODES, strict=True, description="Number of nodes available."
    )
    gpus_per_node: int = Field(
        gt=0, le=MAX_GPUS_PER_NODE, strict=True, description="GPUs per node."
    )
    spot: bool = Field(
        default=True, strict=True, description="Whether these are spot nodes (price)."
    )

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


class Pool(Frozen):
    """The resources a plan may draw from."""

    entries: tuple[PoolEntry, ...] = Field(description="Available nodes per type and zone.")

    @field_validator("entries")
    @classmethod
    def _unique(cls, v: tuple[PoolEntry, ...]) -> tuple[PoolEntry, ...]:
        seen: set[tuple[str, str, int, bool]] = set()
        for e in v:
            key = (e.gpu_type, e.zone, e.gpus_per_node, e.spot)
            if key in seen:
                raise field_error("entries", key, "duplicate (gpu_type, zone, gpus_per_node, spot)")
            seen.add(key)
        return v

    @property
    def total_gpus(self) -> int:
        return sum(e.gpus for e in self.entries)

    def gpus_by_type(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for e in self.entries:
            out[e.gpu_type] = out.get(e.gpu_type, 0) + e.gpus
        return out

    @classmethod
    def from_nodes(cls, nodes: list[NodeSpec] | tuple[NodeSpec, ...]) -> Pool:
        """Aggregate concrete nodes into a pool."""
        counts: dict[tuple[str, str, int, bool], int] = {}
        for n in nodes:
            key = (n.gpu_type, n.zone, n.gpus, n.spot)
            counts[key] = counts.get(key, 0) + 1
        return cls(
            entries=tuple(
                PoolEntry(gpu_type=g, zone=z, gpus_per_node=k, spot=s, nodes=c)
                for (g, z, k, s), c in sorted(counts.items())
            )
        )
