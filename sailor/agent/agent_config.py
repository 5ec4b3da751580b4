"""The configuration of ``sailor agent``, the agent of one node: ``AgentConfig``, with its
preemption sources (``WatcherConfig``) and the node check it runs before joining
(``CheckSettings``).

Read from the agent's YAML by ``sailor agent``, ``sailor config`` and ``sailor check``, and
validated on construction (a CPU quota the kernel cannot enforce at its period is refused,
``cgroup_layout.validate_cores``). Values only: must never start, connect to or write anything.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from sailor.agent.cgroup_layout import CFS_PERIOD_US, MIN_QUOTA_US, validate_cores
from sailor.agent.killed_groups import TEARDOWN_TIMEOUT_S
from sailor.agent.worker_argv import DEFAULT_WORKER_ARGV
from sailor.coordination.endpoints import ServerEndpoints
from sailor.coordination.names import check_job, check_node_id
from sailor.coordination.security import SecurityConfig
from sailor.schemas._base import Frozen, field_error
from sailor.schemas.hardware import MAX_GPUS_PER_NODE, NodeSpec

__all__ = ["AgentConfig", "CheckSettings", "WatcherConfig"]


class WatcherConfig(Frozen):
    kind: str = Field(description="gcp, aws, azure or file.")
    target: str = Field(description="Metadata base URL, or a path for 'file'.")


class CheckSettings(Frozen):
    """The node check the agent runs before it joins (``sailor check``, docs/operations.md)."""

    mode: Literal["enforce", "report", "off"] = Field(
        default="enforce",
        description="enforce: a GPU node that fails the check does not join; report: it joins "
        "and logs the failures; off: no GPU checks (toy trainers standing in for GPUs on a CPU "
        "host). CPU nodes (gpu_type cpu or cpu-<kind>) skip the GPU checks in every mode.",
    )
    probe: bool = Field(default=True, description="Run the one-node NCCL collective probe.")
    timeout_s: float = Field(
        default=300.0, gt=0, description="Deadline of the GPU checks, probe included, s."
    )


class AgentConfig(ServerEndpoints):
    """Everything ``sailor agent`` needs."""

    job: str = Field(default="default", min_length=1, max_length=64, description="Job name.")
    node: NodeSpec = Field(description="This node (GPU type and count, zone, spot, address).")
    lease_ttl_s: int = Field(default=2, ge=1, description="Registration lease TTL.")
    work_dir: Path = Field(default=Path("sailor-agent"), description="Run files of workers.")
    worker_argv: tuple[str, ...] = Field(
        default=DEFAULT_WORKER_ARGV, description="Worker command template (see supervisor)."
    )
    warm_spares: int = Field(
        default=0,
        ge=0,
        le=64,
        description="Worker processes kept started and waiting (torch imported, nothing "
        "built) for in-place launches: a joining node's or a new rank's start-up then stays "
        "out of the reconfiguration's downtime; the controller counts a joined node once its "
        "spares are up (ControllerConfig.in_place). 0: none.",
    )
    teardown_timeout_s: float = Field(
        default=TEARDOWN_TIMEOUT_S,
        gt=0,
        description="After SIGKILL, how long a killed worker's processes (its whole process "
        "group) may take to go before this node reports a failure (retry false) and takes no "
        "rank: a rank in the GPU driver's teardown outlives SIGKILL for tens of seconds and "
        "holds its GPU meanwhile. No worker starts here while they go.",
    )
    watchers: tuple[WatcherConfig, ...] = Field(default=(), description="Preemption sources.")
    watch_poll_s: float = Field(default=0.5, gt=0, description="Watcher poll period.")
    preemption_drain_s: float = Field(
        default=25.0,
        ge=0,
        description="On SIGTERM with a preemption notice (GCP's preemption is an ACPI "
        "shutdown: systemd stops the agent as the notice starts), keep serving the "
        "controller this long at most, until its layout no longer uses this node (the "
        "checkpoint committed, the next generation launched) or the notice's deadline: "
        "below the unit's TimeoutStopSec (30 s). 0: stop at once.",
    )
    status_interval_s: float = Field(default=0.2, gt=0, description="Status write period.")
    security: SecurityConfig | None = Field(
        default=None, description="TLS and NATS login (docs/operations.md#security); off if absent."
    )
    check: CheckSettings = Field(
        default_factory=CheckSettings, description="The node check run before joining."
    )
    cpu_quota: float | None = Field(
        default=None,
        gt=0,
        description="CPU cores' worth this node's workers may use together (e.g. 0.4), "
        "enforced by the cgroup cpu controller (v1 cpu.cfs_quota_us or v2 cpu.max, 100 ms "
        "period): one machine hosts nodes of different speed, each of a CPU kind "
        "(node.gpu_type cpu-<kind>; docs/runtime.md). None: no quota (a GPU node has none "
        "unless set here). Where no writable cpu controller exists the agent warns and runs "
        "its workers unthrottled, and its status says cpu_quota: unavailable.",
    )

    cpu_quota_from: Literal["exec", "ready"] = Field(
        default="exec",
        description="When a worker comes under the quota. 'exec': before its first "
        "instruction (start-up, the torch import and the rendezvous are throttled too: a "
        "node's whole life is slow). 'ready': once it reports ready to train (groups built, "
        "checkpoint loaded), so the quota throttles training, checkpoint saves and the stop, "
        "and a slow node's start does not lengthen every reconfiguration's downtime "
        "(sailor demo; docs/runtime.md).",
    )

    cpu_quota_period_ms: float = Field(
        default=CFS_PERIOD_US / 1000,
        ge=MIN_QUOTA_US / 1000,
        le=1000,
        description="The cgroup's enforcement period, ms (the kernel takes 1 ms to 1 s; "
        "default 100, its own). Within a period a throttled worker runs at full speed until "
        "its quota is spent, then stalls: a shorter period spreads the quota more evenly "
        "over steps shorter than a few periods, at the cost of more preemptions.",
    )

    @field_validator("job")
    @classmethod
    def _job_name(cls, v: str) -> str:
        return check_job(v)

    @field_validator("node")
    @classmethod
    def _node_id(cls, v: NodeSpec) -> NodeSpec:
        # NodeSpec (a wire message) takes any id from an older peer; this node's own names
        # files in work_dir (its fence and run directory), a login and a NATS token
        check_node_id(v.node_id, "node.node_id")
        # the count is checked here, not on NodeSpec, for the same reason: a wire message an
        # older agent registered is read whatever its count, and the controller leaves such a
        # node out with the reason (controller/plannable.py); a config of this release is
        # refused before it joins
        if v.gpus > MAX_GPUS_PER_NODE:
            raise field_error(
                "node.gpus",
                v.gpus,
                f"over the {MAX_GPUS_PER_NODE} GPUs per node the planner takes "
                "(PoolEntry.gpus_per_node): the controller would leave this node out",
            )
        return v

    @model_validator(mode="after")
    def _enforceable(self) -> AgentConfig:
        if self.cpu_quota is not None:
            validate_cores(self.cpu_quota, self.cpu_quota_period_us)
        return self

    def anchored(self, config_file: Path) -> AgentConfig:
        """This config with the relative paths of the files it reads (the ``security``
        files) taken from ``config_file``'s directory: under systemd the working directory
        is ``/``. What it writes (``work_dir``) is left as given: give it absolute."""
        if self.security is None:
            return self
        base = config_file.absolute().parent
        return self.model_copy(update={"security": self.security.anchored(base)})

    @property
    def cpu_quota_period_us(self) -> int:
        """The period as the kernel takes it, whole microseconds."""
        return round(self.cpu_quota_period_ms * 1000)
