"""What an agent establishes about its node before it joins: the node check (the GPU checks
of ``sailor check``, in a child process; CPU nodes and ``check.mode: off`` gather no GPU
facts), whose facts go with its ``NodeJoined`` or, in ``enforce`` mode, keep it from joining;
the torch build and NCCL version it registers with its node (``registered_node``); and,
when its configuration gives no address, the address it registers (``node_address``: the
local end of its route to the servers).

``AgentNodeCheck`` is a part of :class:`sailor.agent.daemon.Agent` (a mixin over the agent's
config and node; it sets ``refused``). Must never import the controller.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Sequence
from urllib.parse import urlsplit

import structlog

from sailor.agent.agent_config import AgentConfig
from sailor.agent.check_gather import gather_gpu_subprocess, node_facts
from sailor.agent.check_verdicts import judge
from sailor.schemas.device_kind import is_cpu_type
from sailor.schemas.hardware import NodeSpec, TorchRuntime
from sailor.schemas.node_check import NodeFacts

__all__ = [
    "AgentNodeCheck",
    "host_port",
    "node_address",
    "registered_node",
    "route_address",
]

_log = structlog.get_logger("sailor.agent")


def node_address(endpoints: Sequence[str], probe: Callable[[str], str] | None = None) -> str:
    """The address this node registers when its configuration gives none: the local address
    of the route to each server endpoint (``host:port``), the first that is not loopback;
    a loopback one only when every server is on this host (a one-machine cluster, where it is
    right); '' when none is found."""
    found = [(probe or route_address)(e) for e in endpoints]
    for addr in found:
        if addr and not ipaddress.ip_address(addr).is_loopback:
            return addr
    return next((a for a in found if a), "")


def registered_node(node: NodeSpec, facts: NodeFacts, release: str = "") -> NodeSpec:
    """What the agent registers: its configured node with the torch build and NCCL version
    its check found and the Sailor ``release`` its workers run (``NodeSpec.runtime``), by
    which the controller keeps one of each per job. Nothing gathered (a CPU node, check mode
    off): the node as configured, with its release."""
    runtime = facts.runtime()
    if runtime is None and not release:
        return node
    runtime = runtime or TorchRuntime()  # a CPU node, check mode off: its release alone
    if release:
        runtime = runtime.model_copy(update={"sailor_release": release})
    return node.model_copy(update={"runtime": runtime})


def host_port(url: str) -> str:
    """``host:port`` of a NATS URL (``nats://host:port``)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    return f"[{host}]:{parts.port or 4222}" if ":" in host else f"{host}:{parts.port or 4222}"


def route_address(endpoint: str) -> str:
    """The local address this host reaches ``endpoint`` (``host:port``) from: the one its
    peers on that network reach it at. No packet is sent (a UDP socket's connect only picks
    the route); '' when it cannot be found."""
    host, _, port = endpoint.rpartition(":")
    host = host.strip("[]")
    try:
        infos = socket.getaddrinfo(host, int(port or 0), type=socket.SOCK_DGRAM)
        family, _, _, _, addr = infos[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            return str(s.getsockname()[0])
    except (OSError, ValueError, IndexError):
        return ""


class AgentNodeCheck:
    """The node check of :class:`~sailor.agent.daemon.Agent` (``check_node``)."""

    cfg: AgentConfig
    node: NodeSpec
    refused: str

    async def check_node(self) -> NodeFacts | None:
        """The node's facts, or None when the check failed in ``enforce`` mode (the agent then
        does not join: ``refused`` says why). CPU nodes and mode ``off`` gather nothing."""
        settings = self.cfg.check
        if is_cpu_type(self.node.gpu_type) or settings.mode == "off":
            return node_facts(self.node)
        gpu = await gather_gpu_subprocess(probe=settings.probe, timeout_s=settings.timeout_s)
        facts = node_facts(self.node, gpu)
        report = judge(facts, node_id=self.node.node_id)
        bad = [line for line in report.lines if line.verdict == "fail"]
        for line in report.lines:
            if line.verdict != "ok" and line.check not in ("nats", "etcd"):
                _log.warning(
                    "node_check",
                    node=self.node.node_id,
                    check=line.check,
                    verdict=line.verdict,
                    detail=line.detail[:500],
                    action=line.action[:300],
                )
        if not bad:
            return facts
        why = "; ".join(f"{line.check}: {line.detail}" for line in bad)[:2000]
        if settings.mode == "report":
            _log.warning("node_check_failed_joining_anyway", node=self.node.node_id, why=why)
            return facts
        self.refused = why
        _log.error(
            "node_check_failed_not_joining",
            node=self.node.node_id,
            gpu_type=self.node.gpu_type,
            why=why,
            fix="run `sailor check --config <agent config>` on this node for what to do",
        )
        return None
