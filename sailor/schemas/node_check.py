"""What ``sailor check`` finds on a node, and its verdict: the facts (CUDA, driver, NCCL, the
devices and what the catalog calls them, a one-node collective probe, reachability of NATS
and etcd) and one line per check (ok / warn / fail, why, what to do).

``NodeFacts`` travels with the agent's ``NodeJoined`` event, so the controller's audit log
says what hardware each node brought; ``CheckReport`` is what ``sailor check --json`` prints.
Pure data: gathered by ``sailor.agent.check_gather``, judged by ``sailor.agent.check_verdicts``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from sailor.schemas._base import Frozen, WireMessage, field_error
from sailor.schemas.hardware import TorchRuntime
from sailor.schemas.redact import redact_text

__all__ = [
    "CheckLine",
    "CheckReport",
    "DeviceFacts",
    "EndpointFacts",
    "NodeFacts",
    "ProbeFacts",
    "Verdict",
]

Verdict = Literal["ok", "warn", "fail"]
"""ok: ready; warn: serves, but look at it; fail: this node cannot serve as configured."""


class DeviceFacts(Frozen):
    """One CUDA device as torch sees it."""

    index: int = Field(ge=0, description="CUDA device index (after CUDA_VISIBLE_DEVICES).")
    cuda_name: str = Field(description="torch.cuda.get_device_name, e.g. 'NVIDIA H100 80GB HBM3'.")
    catalog_name: str = Field(
        default="", description="Catalog GPU type it maps to; '' when it maps to none."
    )
    name_error: str = Field(default="", description="Why it maps to no catalog type.")
    memory_bytes: int = Field(ge=0, description="Total device memory, bytes.")
    free_bytes: int = Field(default=-1, ge=-1, description="Free memory at the check; -1 unknown.")
    capability: tuple[int, int] = Field(description="Compute capability (major, minor).")
    bf16: bool = Field(description="bf16 tensor math supported (compute capability >= 8.0).")
    fp16: bool = Field(description="fp16 tensor math supported (compute capability >= 7.0).")


class ProbeFacts(Frozen):
    """A one-node NCCL probe: an all-reduce among all local GPUs, and a ring of send/recv."""

    ranks: int = Field(ge=0, description="Ranks (one per GPU) the probe ran; 0: not run.")
    backend: str = Field(default="nccl", description="Process group backend used.")
    all_reduce_ok: bool = Field(default=False, description="All-reduce result was exact.")
    p2p_ok: bool = Field(default=False, description="Every rank received its peer's tensor.")
    bus_gbps: float | None = Field(
        default=None, ge=0, description="All-reduce bus bandwidth of the largest message, GB/s."
    )
    seconds: float = Field(default=0.0, ge=0, description="Wall time of the probe, s.")
    error: str = Field(default="", max_length=4096, description="First failure, if any.")


class EndpointFacts(Frozen):
    """Whether a server answered with this node's own credentials."""

    url: str = Field(
        description="NATS URL or etcd host:port tried (several: joined by commas), a "
        "password or token in it shown as *** (schemas.redact)."
    )
    reachable: bool = Field(description="Connected, authenticated and answered a request.")
    tls: bool = Field(default=False, description="Connected with TLS (security: configured).")
    seconds: float = Field(default=0.0, ge=0, description="Time to connect and answer, s.")
    error: str = Field(default="", max_length=1024, description="Why not reachable.")

    @field_validator("url", "error")
    @classmethod
    def _no_credentials(cls, value: str) -> str:
        # facts travel in NodeJoined (event stream, audit log) and are printed by the
        # check: whoever built them, a URL's password never goes along
        return redact_text(value)


class NodeFacts(Frozen):
    """Everything the check gathered on one node (no verdicts: see ``CheckReport``)."""

    node_kind: Literal["gpu", "cpu"] = Field(
        description="gpu: the node is configured with a GPU type; cpu: a CPU node (no GPU probes)."
    )
    gpu_type: str = Field(default="", description="GPU type the node config names ('' none).")
    gpus: int = Field(default=0, ge=0, description="GPUs the node config names (0 none).")
    hostname: str = Field(default="", description="Host the check ran on.")
    torch_version: str = Field(default="", description="torch.__version__ ('' not gathered).")
    torch_cuda: str = Field(
        default="", description="CUDA version torch was built with ('' CPU-only build)."
    )
    gathered: bool = Field(
        default=False, description="GPU facts were gathered (false on cpu nodes: skipped)."
    )
    cuda_available: bool = Field(default=False, description="torch.cuda.is_available().")
    cuda_error: str = Field(default="", max_length=1024, description="Why CUDA is unavailable.")
    driver_version: str = Field(default="", description="NVIDIA driver version ('' unknown).")
    nccl_version: str = Field(default="", description="torch.cuda.nccl.version ('' none).")
    arch_list: tuple[str, ...] = Field(
        default=(),
        description="torch.cuda.get_arch_list(): the GPU architectures this torch build has "
        "kernels (sm_XY) or PTX (compute_XY) for; () not gathered or no CUDA.",
    )
    devices: tuple[DeviceFacts, ...] = Field(default=(), description="Visible CUDA devices.")
    probe: ProbeFacts | None = Field(default=None, description="NCCL probe; None: not run.")
    nats: EndpointFacts | None = Field(default=None, description="NATS; None: not checked.")
    etcd: EndpointFacts | None = Field(default=None, description="etcd; None: not checked.")
    cpu_quota: float | Literal["unavailable"] | None = Field(
        default=None,
        description="CPU quota of the node's workers at join, cores' worth ('unavailable': "
        "configured, but no writable cpu controller here, so unthrottled; None: no quota).",
    )

    @model_validator(mode="after")
    def _indices(self) -> NodeFacts:
        idx = [d.index for d in self.devices]
        if idx != list(range(len(idx))):
            raise field_error("devices", idx, "device indices must be 0..n-1 in order")
        return self

    def runtime(self) -> TorchRuntime | None:
        """The torch build and NCCL the node registers; None when nothing was gathered."""
        if not self.gathered or not self.torch_version:
            return None
        return TorchRuntime(
            torch_version=self.torch_version,
            torch_cuda=self.torch_cuda,
            nccl_version=self.nccl_version,
        )

    def summary(self) -> dict[str, object]:
        """A few fields for a log or audit record: kind, GPU types, driver, NCCL, probe."""
        out: dict[str, object] = {"kind": self.node_kind}
        if self.gathered:
            out["cuda"] = self.cuda_available
            out["gpus"] = [d.catalog_name or d.cuda_name for d in self.devices]
            out["driver"] = self.driver_version
            out["nccl"] = self.nccl_version
        if self.cpu_quota is not None:
            out["cpu_quota"] = self.cpu_quota
        if self.probe is not None:
            out["probe_ok"] = (
                not self.probe.error and self.probe.all_reduce_ok and self.probe.p2p_ok
            )
            out["bus_gbps"] = self.probe.bus_gbps
        return out


class CheckLine(Frozen):
    """One verdict: what was checked, the finding, and what to do when it is not ok."""

    check: str = Field(min_length=1, description="What was checked, e.g. 'cuda', 'nats'.")
    verdict: Verdict = Field(description="ok, warn or fail.")
    detail: str = Field(description="What was found.")
    action: str = Field(default="", description="What to do about it ('' when ok).")


class CheckReport(WireMessage):
    """``sailor check``'s answer for one node: the facts and a verdict per line."""

    node_id: str = Field(default="", description="Node id from the config ('' without one).")
    lines: tuple[CheckLine, ...] = Field(min_length=1, description="One verdict per check.")
    facts: NodeFacts = Field(description="What was gathered.")
    serves: bool = Field(description="No line failed: the node can serve as configured.")

    @model_validator(mode="after")
    def _serves(self) -> CheckReport:
        failed = any(line.verdict == "fail" for line in self.lines)
        if self.serves == failed:
            why = "a line failed" if failed else "no line failed"
            raise field_error("serves", self.serves, f"must be {not failed}: {why}")
        return self

    @property
    def verdict(self) -> Verdict:
        """The worst line."""
        order: dict[Verdict, int] = {"ok": 0, "warn": 1, "fail": 2}
        return max((line.verdict for line in self.lines), key=order.__getitem__)
