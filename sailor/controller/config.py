"""The controller's configuration file (YAML, TOML or JSON), validated on load."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, field_validator, model_validator

from sailor.controller.decision_types import MAX_BASE_PORT
from sailor.controller.node_health import ExclusionPolicy
from sailor.controller.phases import PhaseDeadlines
from sailor.coordination.endpoints import ServerEndpoints, distinct_nats_servers
from sailor.coordination.names import check_job
from sailor.coordination.security import SecurityConfig
from sailor.coordination.stream_limits import EVENT_MAX_BYTES, EVENT_MAX_MSG_SIZE
from sailor.schemas._base import Frozen, field_error

MODEL_FILE_SUFFIXES = (".json", ".yaml", ".yml")
"""A ``ControllerConfig.model`` ending so is a model file, else a catalog model name."""

__all__ = [
    "MODEL_FILE_SUFFIXES",
    "ControllerConfig",
    "OnlineCalibrationSettings",
    "load_mapping",
]

DEFAULT_TIME_BETWEEN_CHANGES_S = 475.0
"""Expected seconds between membership changes when nothing else is configured: the shortest
mean of the reference data's A100 spot availability traces (``traces/a100_trace_original.json``
475 s, ``a100_trace_16.json`` 483 s, ``a100_trace.json`` 1,186 s between changes;
``tests/unit/test_controller_recalibrate.py`` re-derives it when the data is present). The
shortest: a shorter horizon asks more of a replan before it pays."""


def load_mapping(path: Path) -> dict[str, Any]:
    """Read a YAML, TOML or JSON file into a dict (by suffix; YAML otherwise)."""
    text = path.read_text()
    try:
        if path.suffix == ".json":
            data = json.loads(text)
        elif path.suffix == ".toml":
            data = tomllib.loads(text)
        else:
            data = yaml.safe_load(text)
    except RecursionError as exc:  # the parsers' own depth limit
        raise ValueError(f"{path}: nested too deep to read") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path}: must hold a mapping, got {type(data).__name__}")
    return data


class OnlineCalibrationSettings(Frozen):
    """Online calibration (docs/runtime.md, "Online calibration"): fit the running cluster's
    cost-model constants from the workers' step timings, keep them in etcd, plan with them,
    and replan when the fitted model says it pays (``controller/recalibrate.py``)."""

    enabled: bool = Field(
        default=True,
        description="Fit, keep and plan with the fitted calibration (planner 'sailor' only: "
        "the data-parallel stand-in prices nothing).",
    )
    replan: bool = Field(
        default=True, description="Reconfigure when the rule says so (else fit and audit only)."
    )
    min_steps: int = Field(
        default=5, ge=2, description="Steps every rank's medians must span before a fit."
    )
    interval_s: float = Field(default=10.0, gt=0, description="Least time between two fits, s.")
    stable_tolerance: float = Field(
        default=0.1,
        gt=0,
        description="A fit is stable when no compute scale moved by more than this fraction "
        "(or its own uncertainty, if larger) since the previous fit; a new calibration version "
        "is kept only when one moved more than that since the kept one.",
    )
    stable_reports: int = Field(
        default=3, ge=1, description="Consecutive stable fits of a generation before a replan."
    )
    min_improvement: float = Field(
        default=0.05, ge=0, lt=1, description="Least relative improvement that may replan."
    )
    margin: float = Field(
        default=0.5,
        ge=0,
        description="Hysteresis: the time saved must exceed the downtime x (1 + margin).",
    )
    default_downtime_s: float = Field(
        default=30.0,
        ge=0,
        description="Reconfiguration downtime assumed until this controller has measured one "
        "(docs/runtime.md: 3-11 s for tiny-gpt on CPU workers; real models load for longer).",
    )
    time_between_changes_s: float = Field(
        default=DEFAULT_TIME_BETWEEN_CHANGES_S,
        gt=0,
        description="Expected seconds between membership changes (the horizon a replan must "
        "pay off within); see membership_trace.",
    )
    membership_trace: Path | None = Field(
        default=None,
        description='An availability trace ([{"Time": s, "GPUs": n}, ...]) whose mean time '
        "between changes replaces time_between_changes_s. Relative: to the config file.",
    )


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
        "single server. More than one on a server in no cluster stops the controller at its "
        "start (a standby too: the server's INFO names no cluster); more than the servers "
        "several nats_urls list is refused on load; "
        "fewer servers up than replicas is waited for and shown (event_stream_deadline_s).",
    )
    event_stream_max_bytes: int = Field(
        default=EVENT_MAX_BYTES,
        ge=EVENT_MAX_MSG_SIZE,
        le=1 << 40,
        description="Bytes the job's event stream keeps at most, oldest dropped first "
        "(64 MiB: a join of 1000 nodes at the largest event). JetStream reserves it on "
        "each replica's server out of max_file_store when the stream is made: a server "
        "with 8 GB holds ~120 jobs' streams. A reservation that does not fit stops the "
        "controller naming max_file_store; an existing stream whose update it refuses is "
        "consumed with its old limits (docs/operations.md, 'Event stream limits').",
    )
    event_stream_deadline_s: float = Field(
        default=300.0,
        gt=0,
        le=86_400,
        description="How long the event stream may stay unplaced (too few NATS servers up "
        "for its replicas) before the leader reports it overdue: an error in the journal "
        "and the audit log, 'overdue' in `sailor status` and the systemd status. It goes "
        "on leading and retrying (docs/runtime.md, 'Event stream placement'); a stream "
        "refused for want of max_file_store fails the controller then instead.",
    )
    audit_log: Path = Field(default=Path("sailor-audit.jsonl"), description="Audit log path.")
    audit_max_bytes: int = Field(default=64 << 20, gt=0, description="Rotate beyond this size.")
    checkpoint_dir: str = Field(default="checkpoints", description="Checkpoint root for workers.")
    keep_checkpoints: int | None = Field(
        default=1,
        ge=1,
        description="Recorded checkpoints (a reconfiguration's or a periodic one's) a new save "
        "leaves in place under ``checkpoint_dir``; the committer deletes older ones (and the "
        "controller their records) once the new one commits, so at most this + 1 are on disk "
        "(this + 2 under checkpoint_every_s: a periodic save prunes only below the oldest "
        "recorded step, so the records it drops lose their files with the next save). "
        "None: keep all.",
    )
    checkpoint_every_s: float = Field(
        default=3600.0,
        ge=0,
        description="Wall-clock seconds between the controller's periodic checkpoints of the "
        "running job (no stop or relaunch: training waits for the save's snapshot, and at the "
        "next iteration boundary until the save is durable, so a write longer than one "
        "iteration stalls training for the rest; recorded as commits a crash relaunch loads, "
        "pruned by keep_checkpoints as any commit): a node lost without notice costs at most "
        "about this much training. 0: none (only reconfigurations and notices checkpoint).",
    )
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
    in_place: bool = Field(
        default=False,
        description="Reconfigure in place: workers survive a layout change, keep the layers "
        "they keep and fetch the ones they gain from their peers (docs/runtime.md#in-place-"
        "reconfiguration); any failure of that path falls back to the restart path for the "
        "next launch. False: every reconfiguration restarts the workers.",
    )
    base_port: int = Field(
        default=29500,
        gt=0,
        le=MAX_BASE_PORT,
        description="Rendezvous port base: a generation's master port is base_port + "
        f"generation % 1000, so at most {MAX_BASE_PORT} (the last is then 65535).",
    )
    exclusion: ExclusionPolicy = Field(
        default_factory=ExclusionPolicy,
        description="When a node whose workers keep failing is left out of the layouts, and "
        "for how long: at once on a failure whose record says retry false, else after "
        "`failures` in a row that began there; `exclude_s`, doubling per exclusion up to "
        "`max_exclude_s`. The same policy holds the whole job when most placed nodes fail "
        "alike, and excludes at once a node that holds up a teardown past "
        '`deadlines.teardown` (docs/runtime.md, "Failing nodes").',
    )
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
        default="tiny-gpt",
        description="Catalog model name (e.g. tiny-gpt) or ModelSpec file (.json, .yaml, "
        ".yml; relative: to this file).",
    )
    profiles: tuple[Path, ...] = Field(
        default=(), description="ProfileDB files (else analytic); relative: to this file."
    )
    network: Path | None = Field(
        default=None, description="NetworkProfile file; relative: to this file."
    )
    prices: Path | None = Field(
        default=None, description="PriceTable file (else the catalog's); relative: to this file."
    )
    calibration: Path | None = Field(
        default=None, description="Calibration file; relative: to this file."
    )
    objective: Literal["throughput", "cost", "throughput_per_cost"] = Field(
        default="throughput", description="Planner objective."
    )
    risk: Literal["optimistic", "median", "robust"] = Field(
        default="robust",
        description="What the sailor planner bets on (docs/planner.md, 'Robust planning'): "
        "robust = fit and meet every limit in every corner of the cost model's uncertainty "
        "set, ranked by the worst case; median/optimistic = that one corner. Replans keep it.",
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

    online_calibration: OnlineCalibrationSettings = Field(
        default_factory=OnlineCalibrationSettings,
        description="Online calibration and calibration-driven replanning.",
    )

    @model_validator(mode="after")
    def _replicas_within_the_listed_cluster(self) -> ControllerConfig:
        # Several nats_urls are the cluster's members (docs/operations.md lists every one):
        # more replicas than they name can never be placed. One URL may be a DNS name, a
        # load balancer or a Service in front of a cluster of any size: not judged here;
        # JetStream's refusal then shows at run time as a shortage, overdue past
        # event_stream_deadline_s (docs/runtime.md, "Event stream placement").
        listed = distinct_nats_servers(self.nats_urls)
        if listed > 1 and self.event_stream_replicas > listed:
            raise field_error(
                "event_stream_replicas",
                self.event_stream_replicas,
                f"more than the {listed} NATS servers nats_urls lists (a list names every "
                "member of the cluster); lower it, or list every member",
            )
        return self

    @field_validator("job")
    @classmethod
    def _job_name(cls, v: str) -> str:
        return check_job(v)

    @field_validator("checkpoint_dir")
    @classmethod
    def _reachable_scheme(cls, v: str) -> str:
        # a URL's filesystem must be installed: found here, not by the workers' first save
        # (a preemption's), when there is no checkpoint to fall back to
        if "://" in v:
            import fsspec

            scheme = v.split("://", 1)[0]
            try:
                fsspec.get_filesystem_class(scheme)
            except (ImportError, ValueError) as exc:
                raise field_error(
                    "checkpoint_dir", v, f"no filesystem for {scheme}:// here ({exc})"
                ) from None
        return v

    @classmethod
    def load(cls, path: Path) -> ControllerConfig:
        return cls.model_validate(load_mapping(path)).anchored(path)

    def anchored(self, config_file: Path) -> ControllerConfig:
        """This config with the relative paths of the files it reads (``training``, the
        membership trace, ``profiles``, ``network``, ``prices``, ``calibration``, a
        ``model`` file, the ``security`` files) taken from ``config_file``'s directory (the
        file it was read from): under systemd the working directory is ``/``. What it
        writes (``audit_log``, ``checkpoint_dir``) is left as given: give those absolute."""
        base = config_file.absolute().parent

        def under(p: Path | None) -> Path | None:
            return p if p is None or p.is_absolute() else base / p

        oc = self.online_calibration.model_copy(
            update={"membership_trace": under(self.online_calibration.membership_trace)}
        )
        return self.model_copy(
            update={
                "training": under(self.training),
                "online_calibration": oc,
                "profiles": tuple(base / p if not p.is_absolute() else p for p in self.profiles),
                "network": under(self.network),
                "prices": under(self.prices),
                "calibration": under(self.calibration),
                "model": _model_under(base, self.model),
                "security": None if self.security is None else self.security.anchored(base),
            }
        )


def _model_under(base: Path, model: str) -> str:
    """``model`` as the controller will read it: a catalog name as given, a relative model
    file (by its suffix, as ``load_model_spec`` tells them apart) under ``base``."""
    path = Path(model)
    if path.suffix in MODEL_FILE_SUFFIXES and not path.is_absolute():
        return str(base / path)
    return model
