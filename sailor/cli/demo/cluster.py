"""The demo's cluster on one machine: a controller and agents as real ``sailor`` processes.

Every agent registers a ``cpu`` node (one "GPU": one worker rank over gloo; the demo's GPT-2
at tiny-gpt's sizes, ``demo.model``) in zone
``local-a``, with a file watcher for preemption notices. Why ``cpu`` and one zone: the
planner plans for what the nodes say they are; labelled GPUs (A100, V100…) or several zones
make it find a one-GPU layout best for a model this small (measured with
``SailorPlanner.plan``: 3 labelled nodes → 1 GPU used), so the demo would not show layouts
changing with membership. With ``cpu`` nodes in one zone it uses all of them (3 nodes: a
3-stage pipeline; 2 nodes: data parallel 2). The configs are the files an operator writes
(``sailor controller --config``, ``sailor agent --config``), each with its own certificate
and NATS login (security on, as in a deployment). Must never talk to the
servers itself; :mod:`sailor.cli.demo.observe` reads, this module only starts and injures.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from sailor.agent.agent_config import AgentConfig, WatcherConfig
from sailor.agent.worker_argv import DEFAULT_WORKER_ARGV
from sailor.cli.demo.processes import ProcessRegistry, children_of
from sailor.cli.demo.servers import free_port
from sailor.controller.config import ControllerConfig, OnlineCalibrationSettings
from sailor.controller.phases import PhaseDeadlines
from sailor.durable import write_durably
from sailor.localservers import LocalServers
from sailor.schemas.hardware import NodeSpec

__all__ = ["CONTROLLER", "JOB", "DemoCluster", "node_names", "run_job"]

JOB = "demo"


def run_job() -> str:
    """A job name of one demo run's own (``demo-`` and 6 hex digits): a node's CPU quota
    cgroup is ``sailor/<job>/<node>`` on the host (``agent/cgroup_layout.py``), and two
    demos at once under one name shared n1..n4's, each suspending and resuming the other's
    workers."""
    return f"{JOB}-{secrets.token_hex(3)}"


CONTROLLER = "demo-controller"
_SAILOR = (sys.executable, "-m", "sailor.cli.main")


def node_names(initial: int) -> list[str]:
    """n1 … n<initial + 1>: the first nodes and the one that joins later."""
    return [f"n{i + 1}" for i in range(initial + 1)]


@dataclass
class DemoCluster:
    """Starts the controllers and agents of one run and injects its faults.

    The demo runs one controller; the chaos suite (tests/chaos) also a standby, and uses the
    fault injections beyond the demo's (SIGKILL of a controller or a worker, SIGSTOP).
    """

    reg: ProcessRegistry
    servers: LocalServers
    root: Path
    global_batch_size: int
    min_step_s: float
    training_file: Path | None = None
    """The training config the controller hands every worker (``demo.model``); None: the
    plan's tiny-gpt on synthetic tokens."""
    kinds: dict[str, tuple[str, float | None]] = field(default_factory=dict)
    """Per node: its kind (``gpu_type``, e.g. ``cpu-slow``) and CPU quota in cores; a node not
    named is a ``cpu`` node without a quota."""
    online_calibration: OnlineCalibrationSettings | None = None
    """The controller's online calibration settings; None: the config's defaults."""
    model: str = "tiny-gpt"
    """What the controller plans (a catalog name or a ModelSpec file)."""
    calibration_file: Path | None = None
    """The controller's calibration file (the demo's prior for its kinds); None: the
    catalog's."""
    quota_from: Literal["exec", "ready"] = "exec"
    """When a worker comes under its node's quota (``AgentConfig.cpu_quota_from``)."""
    profiles: tuple[Path, ...] = ()
    """ProfileDB files the controller plans with (its prior: e.g. one per kind); none: the
    analytic estimates."""
    network: Path | None = None
    """A NetworkProfile file the controller plans with (e.g. ``sailor profile network`` on
    loopback); None: the default network."""
    cpu_quota_period_ms: float | None = None
    """The cgroup period of the nodes with a quota; None: the agent's default (100 ms)."""
    in_place: bool = True
    """Reconfigure in place (``ControllerConfig.in_place``: workers survive, move only what
    moved; docs/runtime.md#in-place-reconfiguration); False: restart the workers."""
    warm_spares: int = 1
    """Warm spare workers per agent (``AgentConfig.warm_spares``; used in place only)."""
    worker_extra: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Per node, options added to its workers' command line (the chaos suite's injected
    failures, e.g. ``--fail-relayout FILE``)."""
    job: str = JOB
    # one rendezvous base for every controller of the run (a standby launches like the leader)
    base_port: int = field(default_factory=free_port)

    @property
    def audit_log(self) -> Path:
        return self.audit_path(CONTROLLER)

    def audit_path(self, controller: str) -> Path:
        name = "audit.jsonl" if controller == CONTROLLER else f"audit-{controller}.jsonl"
        return self.root / name

    def audit_logs(self) -> list[Path]:
        """Every controller's audit log (``sailor audit`` merges them by time)."""
        return sorted(p for p in self.root.glob("audit*.jsonl") if p.is_file())

    @property
    def agents_dir(self) -> Path:
        return self.root / "agents"

    def controller_config(self, name: str = CONTROLLER) -> ControllerConfig:
        return ControllerConfig(
            job=self.job,
            identity=name,
            nats_urls=self.servers.nats_urls,
            etcd_endpoints=self.servers.etcd_endpoints,
            # R3 on a 3-server NATS cluster: losing one server loses no event
            event_stream_replicas=min(3, len(self.servers.nats_urls)),
            audit_log=self.audit_path(name),
            checkpoint_dir=str(self.root / "ckpt"),
            lease_ttl_s=2,
            debounce_s=0.05,
            resync_s=0.5,
            poll_s=0.1,
            # two steps of slack for the stop: the agents report steps ~0.2 s late
            stop_ahead_steps=2,
            notice_margin_s=1.0,
            deadlines=PhaseDeadlines(quiesce=20, checkpoint=20, launch=15, load=60, verify=60),
            planner="sailor",
            model=self.model,
            global_batch_size=self.global_batch_size,
            training=self.training_file,
            calibration=self.calibration_file,
            profiles=self.profiles,
            network=self.network,
            **(
                {"online_calibration": self.online_calibration}
                if self.online_calibration is not None
                else {}
            ),
            base_port=self.base_port,
            in_place=self.in_place,
            security=self.servers.security(name),
        )

    def agent_config(
        self, node: str, gpu_type: str = "cpu", cpu_quota: float | None = None
    ) -> AgentConfig:
        """The agent config of ``node``: a ``cpu`` node without a quota by default; a CPU
        kind (``gpu_type="cpu-slow"``) and the quota its workers run under (``cpu_quota``,
        cores) make one machine host nodes of different speed (docs/runtime.md)."""
        return AgentConfig(
            job=self.job,
            node=NodeSpec(
                node_id=node,
                gpu_type=gpu_type,
                gpus=1,
                zone="local-a",
                spot=True,
                address="127.0.0.1",
            ),
            cpu_quota=cpu_quota,
            cpu_quota_from=self.quota_from,
            **(
                {"cpu_quota_period_ms": self.cpu_quota_period_ms}
                if self.cpu_quota_period_ms is not None
                else {}
            ),
            nats_urls=self.servers.nats_urls,
            etcd_endpoints=self.servers.etcd_endpoints,
            lease_ttl_s=2,
            work_dir=self.agents_dir,
            # paced steps leave the 2 shared cores to the control plane; a short collective
            # timeout bounds how long survivors of a lost node wait on it
            worker_argv=(
                *DEFAULT_WORKER_ARGV,
                *("--min-step-s", str(self.min_step_s), "--timeout-s", "30"),
                *self.worker_extra.get(node, ()),
            ),
            watchers=(WatcherConfig(kind="file", target=str(self.notice_file(node))),),
            watch_poll_s=0.1,
            warm_spares=self.warm_spares if self.in_place else 0,
            security=self.servers.security(node),
        )

    def notice_file(self, node: str) -> Path:
        return self.root / f"preempt-{node}"

    @staticmethod
    def controller_process(name: str = CONTROLLER) -> str:
        return "controller" if name == CONTROLLER else f"controller-{name}"

    def start_controller(self, name: str = CONTROLLER) -> None:
        path = self.root / f"{self.controller_process(name)}.json"
        path.write_text(self.controller_config(name).model_dump_json(indent=2))
        cmd = [*_SAILOR, "controller", "--config", str(path)]
        self.reg.start(self.controller_process(name), cmd)

    def start_agent(self, node: str) -> None:
        path = self.root / f"agent-{node}.json"
        kind, quota = self.kinds.get(node, ("cpu", None))
        path.write_text(self.agent_config(node, kind, quota).model_dump_json(indent=2))
        self.reg.start(f"agent-{node}", [*_SAILOR, "agent", "--config", str(path)])

    def set_quota(self, node: str, cores: float | None) -> None:
        """Change the CPU quota of ``node``'s workers from outside its agent (a node that
        becomes slow mid-run, as under a noisy neighbour or thermal throttling)."""
        from sailor.agent.cpu_quota import node_cgroup

        node_cgroup(self.job, node).set_quota(cores)

    def preempt(self, node: str, in_s: float) -> float:
        """Drop a spot-preemption notice where the node's file watcher looks; return its time."""
        t = time.time()
        write_durably(self.notice_file(node), json.dumps({"in_s": in_s}).encode())
        return t

    def lose(self, node: str) -> float:
        """SIGKILL the node's agent and its workers, without notice; return the time."""
        t = time.time()
        self.reg.kill_node(f"agent-{node}")
        return t

    def kill_controller(self, name: str = CONTROLLER) -> float:
        """SIGKILL a controller (no resignation: a standby waits for its lease to expire)."""
        t = time.time()
        self.reg.kill_node(self.controller_process(name))
        return t

    def kill_worker(self, node: str) -> int:
        """SIGKILL one training worker of ``node`` (its agent stays); return its pid."""
        workers = children_of(self.reg.procs[f"agent-{node}"].pid)
        if not workers:
            raise LookupError(f"{node} runs no worker")
        os.kill(workers[0], signal.SIGKILL)
        return workers[0]

    def freeze(self, process: str) -> float:
        """SIGSTOP one process (e.g. ``agent-n2``): it neither talks nor answers (a partition)."""
        t = time.time()
        os.kill(self.reg.procs[process].pid, signal.SIGSTOP)
        return t

    def thaw(self, process: str) -> float:
        t = time.time()
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.reg.procs[process].pid, signal.SIGCONT)
        return t

    def stop(self) -> None:
        """SIGTERM agents (their workers stop with them), then the controllers."""
        for name in self.reg.procs:  # a frozen process cannot act on SIGTERM
            if name.startswith(("agent-", "controller")):
                self.thaw(name)
        agents = [n for n in self.reg.procs if n.startswith("agent-")]
        self.reg.stop(agents, grace_s=8.0)
        self.reg.stop([n for n in self.reg.procs if n.startswith("controller")], grace_s=5.0)
