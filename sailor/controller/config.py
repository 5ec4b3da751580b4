"""The controller's configuration file (YAML, TOML or JSON), validated on load."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field

from sailor.controller.phases import PhaseDeadlines
from sailor.coordination.endpoints import ServerEndpoints
from sailor.coordination.security import SecurityConfig

__all__ = ["ControllerConfig", "load_mapping"]


def load_mapping(path: Path) -> dict[str, Any]:
    """Read a YAML, TOML or JSON file into a dict (by suffix; YAML otherwise)."""
    text = path.read_text()
    if path.suffix == ".json":
        data = json.loads(text)
    elif path.suffix == ".toml":
        data = tomllib.loads(text)
    else:
        data = yaml.safe_load(text)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: must hold a mapping, got {type(data).__name__}")
    return data


class ControllerConfig(ServerEndpoints):
    """Everything ``sailor controller`` needs."""

    job: str = Field(default="default", min_length=1, max_length=64, description="Job name.")
    identity: str = Field(default="controller", min_length=1, description="This controller.")
    event_stream_replicas: int = Field(
        default=1,
        ge=1,
        le=5,
        description="Copies of the JetStream event stream (and its consumer) on a NATS "
        "cluster: 3 on a 3-server cluster, so that losing a server loses no event; 1 on a "
        "single server (more than the cluster's servers cannot be placed).",
    )
    audit_log: Path = Field(default=Path("sailor-audit.jsonl"), description="Audit log path.")
    audit_max_bytes: int = Field(default=64 << 20, gt=0, description="Rotate beyond this size.")
    checkpoint_dir: str = Field(default="checkpoints", description="Checkpoint root for workers.")
    lease_ttl_s: int = Field(default=2, ge=1, description="Leader lease TTL (takeover ~2 TTLs).")
    debounce_s: float = Field(
        default=0.3,
        ge=0,
        description="Coalesce outside wake-ups (joins, leaves of unused nodes, status "
        "changes) once; preemption notices, the loss of a node a layout uses and the loop's "
        "own follow-ups are not debounced.",
    )
    resync_s: float = Field(default=1.0, gt=0, description="Reconcile at least this often.")
    poll_s: float = Field(default=0.1, gt=0, description="etcd revision poll period.")
    command_timeout_s: float = Field(default=1.0, gt=0, description="Wait for one ack.")
    resend_s: float = Field(default=0.5, gt=0, description="Re-send an unacked command after.")
    deadlines: PhaseDeadlines = Field(default_factory=PhaseDeadlines, description="Per phase.")
    notice_margin_s: float = Field(default=5.0, ge=0, description="Safety before a deadline.")
    max_notice_horizon_s: float = Field(
        default=3600.0, gt=0, description="Reject notices whose deadline is further out."
    )
    stop_ahead_steps: int = Field(default=1, ge=1, description="Stop this many steps ahead.")
    base_port: int = Field(default=29500, gt=0, description="Rendezvous port base.")
    planner: Literal["sailor", "data_parallel"] = Field(
        default="sailor",
        description="'sailor': sailor.planner search/replan; 'data_parallel': the stand-in.",
    )
    planner_process: bool = Field(
        default=True,
        description="Run planner 'sailor' in a warm worker process (not a thread sharing "
        "the loop's GIL); the worker keeps the search state replan starts from, and the "
        "node specs and plans it last saw, so a call sends only what changed. On by "
        "default: a planner thread holding the GIL starves the event loop (every system "
        "call of the loop waits out a switch interval), which made a 10,000-event burst "
        "wait 14-34 s at p50 against 12 ms with the process; decision latency is about "
        "the same either way (docs/runtime.md). False: plan in a thread.",
    )
    model: str = Field(
        default="tiny-gpt", description="Catalog model name (e.g. tiny-gpt) or ModelSpec file."
    )
    profiles: tuple[Path, ...] = Field(default=(), description="ProfileDB files (else analytic).")
    network: Path | None = Field(default=None, description="NetworkProfile file.")
    prices: Path | None = Field(default=None, description="PriceTable file (else the catalog's).")
    calibration: Path | None = Field(default=None, description="Calibration file.")
    objective: Literal["throughput", "cost", "throughput_per_cost"] = Field(
        default="throughput", description="Planner objective."
    )
    num_layers: int = Field(default=6, gt=0, description="Global layers (stand-in planner).")
    global_batch_size: int = Field(default=8, gt=0, description="Samples per iteration.")
    max_gpus: int = Field(default=0, ge=0, description="Cap for the stand-in planner; 0 = all.")
    security: SecurityConfig | None = Field(
        default=None, description="TLS and NATS login (docs/operations.md#security); off if absent."
    )
    training: Path | None = Field(
        default=None,
        description="TrainingConfig file (YAML or JSON; `sailor schema training-config`) "
        "handed to every worker. Relative: to this config file's directory (when read with "
        "`sailor controller --config`), else the working directory. Validated at start: an "
        "invalid one stops the controller. None: the workers' own defaults.",
    )

    @classmethod
    def load(cls, path: Path) -> ControllerConfig:
        return cls.model_validate(load_mapping(path)).anchored(path)

    def anchored(self, config_file: Path) -> ControllerConfig:
        """This config with a relative ``training`` path taken from ``config_file``'s
        directory (the file it was read from)."""
        if self.training is None or self.training.is_absolute():
            return self
        return self.model_copy(update={"training": config_file.absolute().parent / self.training})
