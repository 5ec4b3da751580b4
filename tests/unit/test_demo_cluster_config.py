"""DemoCluster's configs: the prior profiles reach the controller, the quota period the agents."""

from __future__ import annotations

from pathlib import Path

from sailor.agent.cgroup_layout import cgroup_relpath
from sailor.cli.demo.cluster import DemoCluster, run_job
from sailor.cli.demo.processes import ProcessRegistry
from sailor.coordination.names import check_job
from sailor.localservers import Identities, LocalServers, ServerProcess


def _cluster(tmp_path: Path, **kw: object) -> DemoCluster:
    def server(name: str, port: int) -> ServerProcess:
        return ServerProcess(name=name, argv=[], port=port, log=tmp_path / f"{name}.log")

    servers = LocalServers(
        nats=server("nats", 4222), etcd=server("etcd", 2379), identities=Identities(), pki_dir=None
    )
    return DemoCluster(
        reg=ProcessRegistry(log_dir=tmp_path / "logs"),
        servers=servers,
        root=tmp_path,
        global_batch_size=4,
        min_step_s=0.05,
        base_port=29500,
        **kw,  # type: ignore[arg-type]
    )


def test_defaults_plan_analytically_at_the_kernels_period(tmp_path: Path) -> None:
    c = _cluster(tmp_path, kinds={"n1": ("cpu-slow", 0.4)})
    assert c.controller_config().profiles == () and c.controller_config().network is None
    assert c.agent_config("n1", "cpu-slow", 0.4).cpu_quota_period_ms == 100


def test_prior_profiles_network_and_quota_period(tmp_path: Path) -> None:
    prior = (tmp_path / "full.json", tmp_path / "slow.json")
    net = tmp_path / "net.json"
    c = _cluster(tmp_path, profiles=prior, network=net, cpu_quota_period_ms=20.0)
    assert c.controller_config().profiles == prior and c.controller_config().network == net
    cfg = c.agent_config("n1", "cpu-slow", 0.4)
    assert cfg.cpu_quota == 0.4 and cfg.cpu_quota_period_us == 20_000


def test_each_run_has_a_job_of_its_own_and_its_nodes_a_cgroup_of_their_own(
    tmp_path: Path,
) -> None:
    """Two demos at once under one job name shared the nodes' CPU quota cgroups
    (``sailor/<job>/<node>`` on the host): each suspended and resumed the other's workers."""
    jobs = {run_job() for _ in range(20)}
    assert len(jobs) == 20
    for job in jobs:
        assert check_job(job) == job and job.startswith("demo-")
    a, b = sorted(jobs)[:2]
    assert cgroup_relpath(a, "n1") != cgroup_relpath(b, "n1")
    c = _cluster(tmp_path, job=a)
    assert c.controller_config().job == a and c.agent_config("n1", "cpu-slow", 0.4).job == a
