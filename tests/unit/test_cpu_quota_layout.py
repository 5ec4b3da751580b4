"""CPU quotas: what the kernel's files say, which hierarchy is used, what is written.

Pure parts (``sailor.agent.cgroup_layout``) by tables, including the mountinfo of a host
like this one (cgroup v1 with the cpu controller, and a cgroup2 mount without it) and of a
container; the join-and-exec shell a worker starts through, run for real on a plain file;
and an agent's quota where no cpu controller exists, from a /proc that says so.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path, PurePosixPath

import pytest
from pydantic import ValidationError

from sailor.agent.agent_config import AgentConfig
from sailor.agent.cgroup_layout import (
    CandidateFacts,
    Hierarchy,
    cgroup_relpath,
    choose_hierarchy,
    cores_of,
    cpu_candidates,
    exec_prefix,
    parse_cpu_max,
    parse_cpu_stat,
    parse_mountinfo,
    parse_proc_cgroup,
    quota_us,
    v1_quota_writes,
    v2_cpu_max,
    validate_cores,
)
from sailor.agent.cpu_quota import CpuQuota, CpuQuotaUnavailableError, detect, process_quota
from sailor.schemas.hardware import NodeSpec
from sailor.schemas.node_check import NodeFacts
from sailor.schemas.runtime import AgentStatus

HOST_MOUNTINFO = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
33 31 0:30 / /sys/fs/cgroup/cpuacct rw,relatime - cgroup cgroup rw,cpuacct
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
"""This machine's cgroup mounts (the cpu controller on v1, none on v2)."""

HOST_CGROUP = """\
9:name=systemd:/
4:memory:/process_api/c6d275f82e6cf4381d2e3d6fc87e257b
2:cpuacct:/
1:cpu:/
0::/
"""

CONTAINER_MOUNTINFO = """\
1 0 0:40 /docker/abc /sys/fs/cgroup/cpu,cpuacct ro,nosuid - cgroup cgroup rw,cpu,cpuacct
2 0 0:41 / /sys/fs/cgroup/with\\040space rw shared:5 - cgroup2 cgroup2 rw,nsdelegate
"""

V2_ONLY = "25 1 0:22 / /sys/fs/cgroup rw,nosuid shared:4 - cgroup2 cgroup2 rw,nsdelegate\n"


def test_mountinfo_and_proc_cgroup_are_parsed() -> None:
    mounts = parse_mountinfo(HOST_MOUNTINFO + "garbage line\n")
    assert [m.mount_point for m in mounts][1:] == [
        "/sys/fs/cgroup/cpu",
        "/sys/fs/cgroup/cpuacct",
        "/sys/fs/cgroup/memory",
        "/sys/fs/cgroup/unified",
    ]
    assert mounts[1].fstype == "cgroup" and "cpu" in mounts[1].super_options
    assert "cpu" not in mounts[2].super_options  # cpuacct is another controller
    c = parse_mountinfo(CONTAINER_MOUNTINFO)
    assert c[0].root == "/docker/abc" and c[1].mount_point == "/sys/fs/cgroup/with space"
    own = parse_proc_cgroup(HOST_CGROUP)
    assert own["cpu"] == "/" and own[""] == "/" and own["name=systemd"] == "/"
    assert parse_proc_cgroup("3:cpu,cpuacct:/docker/abc/x\n")["cpuacct"] == "/docker/abc/x"


def test_candidates_look_at_v1_first_then_v2() -> None:
    found, missing = cpu_candidates(parse_mountinfo(HOST_MOUNTINFO), parse_proc_cgroup(HOST_CGROUP))
    assert found == [
        Hierarchy(1, PurePosixPath("/sys/fs/cgroup/cpu")),
        Hierarchy(2, PurePosixPath("/sys/fs/cgroup/unified")),
    ]
    assert missing == []
    # a container sees its own part of the hierarchy: its cgroup is the mount's root
    found, _ = cpu_candidates(
        parse_mountinfo(CONTAINER_MOUNTINFO), {"cpu": "/docker/abc/job", "": "/"}
    )
    assert found[0].base == PurePosixPath("/sys/fs/cgroup/cpu,cpuacct/job")
    found, missing = cpu_candidates(parse_mountinfo(V2_ONLY), {"": "/user.slice/x.scope"})
    assert found == [Hierarchy(2, PurePosixPath("/sys/fs/cgroup/user.slice/x.scope"))]
    assert missing == ["cgroup v1: no hierarchy mounted with the cpu controller"]
    assert cpu_candidates([], {}) == ([], [missing[0], "cgroup v2: no cgroup2 mount"])


V1 = Hierarchy(1, PurePosixPath("/c/cpu"))
V2 = Hierarchy(2, PurePosixPath("/c/unified"))


@pytest.mark.parametrize(
    ("facts", "chosen", "why"),
    [
        ([CandidateFacts(V1, True, None, True), CandidateFacts(V2, False, "", True)], V1, ""),
        (
            [CandidateFacts(V1, False, None, True), CandidateFacts(V2, False, "io cpu\n", True)],
            V2,
            "",
        ),
        (
            [CandidateFacts(V1, True, None, False), CandidateFacts(V2, False, "\n", True)],
            None,
            "cgroup v1 at /c/cpu: not writable by this user; "
            "cgroup v2 at /c/unified: cgroup.controllers lists nothing, not cpu",
        ),
        (
            [CandidateFacts(V2, False, "cpuset io memory", True)],
            None,
            "cgroup v2 at /c/unified: cgroup.controllers lists cpuset io memory, not cpu",
        ),
        ([CandidateFacts(V2, False, None, True)], None, "cgroup.controllers unreadable"),
        ([CandidateFacts(V2, False, "cpu", False)], None, "/c/unified: not writable"),
    ],
)
def test_the_first_usable_hierarchy_is_chosen_or_every_lack_is_named(
    facts: list[CandidateFacts], chosen: Hierarchy | None, why: str
) -> None:
    got = choose_hierarchy(facts, ["cgroup v1: none"] if len(facts) == 1 else [])
    if chosen is not None:
        assert got == chosen
    else:
        assert isinstance(got, str) and got.startswith("no writable cpu controller (")
        assert why in got


def test_quota_values() -> None:
    assert quota_us(0.4) == 40_000 and quota_us(2.5) == 250_000 and quota_us(0.01) == 1_000
    assert v1_quota_writes(0.3) == [("cpu.cfs_period_us", "100000"), ("cpu.cfs_quota_us", "30000")]
    assert v1_quota_writes(None) == [("cpu.cfs_quota_us", "-1")]
    assert v2_cpu_max(0.3) == "30000 100000" and v2_cpu_max(None) == "max 100000"
    assert parse_cpu_max("30000 100000\n") == pytest.approx(0.3)
    assert parse_cpu_max("max 100000") is None
    assert cores_of(40_000, 100_000) == pytest.approx(0.4) and cores_of(-1, 100_000) is None
    for bad in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="must be a number of cores > 0"):
            validate_cores(bad)
    with pytest.raises(ValueError, match="minimum quota of 1000 us"):
        validate_cores(0.005)
    stat = parse_cpu_stat("nr_periods 26\nnr_throttled 21\nthrottled_time 897532941\nbad\n")
    assert stat == {"nr_periods": 26, "nr_throttled": 21, "throttled_time": 897532941}


def test_cgroup_names_are_safe_directory_names() -> None:
    assert cgroup_relpath("demo", "n1") == PurePosixPath("sailor/demo/n1")
    assert cgroup_relpath("a/b", "n 1") == PurePosixPath("sailor/a_b/n_1")
    for job, node in (("..", "n1"), ("demo", "."), ("", "n1")):
        with pytest.raises(ValueError, match="not usable as a cgroup name"):
            cgroup_relpath(job, node)


def test_a_worker_joins_before_it_runs_and_keeps_the_shells_pid(tmp_path: Path) -> None:
    # a plain file stands in for cgroup.procs: the shell writes its pid, then execs python,
    # which prints its own pid: the same one
    procs = tmp_path / "cgroup.procs"
    argv = [sys.executable, "-c", "import os; print(os.getpid())"]
    out = subprocess.run(
        [*exec_prefix(PurePosixPath(procs)), *argv], capture_output=True, text=True, check=True
    )
    assert procs.read_text().strip() == out.stdout.strip()
    # a cgroup it cannot join: the worker never starts, and says why
    gone = tmp_path / "no-such-cgroup" / "cgroup.procs"
    res = subprocess.run(
        [*exec_prefix(PurePosixPath(gone)), *argv], capture_output=True, text=True, check=False
    )
    assert res.returncode == 125 and res.stdout == ""
    assert "cannot join the cgroup of" in res.stderr


def _fake_proc(tmp: Path, mountinfo: str, cgroup: str) -> Path:
    (tmp / "self").mkdir(parents=True)
    (tmp / "self" / "mountinfo").write_text(mountinfo)
    (tmp / "self" / "cgroup").write_text(cgroup)
    return tmp


def test_without_a_cpu_controller_the_quota_is_unavailable_and_says_why(tmp_path: Path) -> None:
    v2 = tmp_path / "cg"
    v2.mkdir()
    (v2 / "cgroup.controllers").write_text("cpuset io memory pids\n")
    info = f"25 1 0:22 / {v2} rw shared:4 - cgroup2 cgroup2 rw\n"
    proc = _fake_proc(tmp_path / "proc", info, "0::/\n")
    why = detect(proc)
    assert isinstance(why, str)
    assert "cgroup v1: no hierarchy mounted with the cpu controller" in why
    assert "lists cpuset io memory pids, not cpu" in why
    q = CpuQuota.start("demo", "n1", 0.4, proc=proc)
    assert not q.available and q.state() == "unavailable" and q.reason == why
    assert q.exec_prefix == ()  # the workers start as they are: unthrottled
    q.set(0.2)  # warns, changes nothing
    assert q.state() == "unavailable" and q.requested == 0.2
    q.adopt([1])
    assert q.close()
    with (
        pytest.raises(CpuQuotaUnavailableError, match="no writable cpu controller"),
        process_quota(0.4, "cpu-slow", proc=proc),
    ):
        pass
    assert "cannot read" in str(detect(tmp_path / "nowhere"))


def test_the_quota_setting_and_its_reports_are_validated() -> None:
    node = NodeSpec(node_id="n1", gpu_type="cpu-slow", gpus=1, zone="z")
    assert AgentConfig(node=node).cpu_quota is None  # a GPU node keeps none unless set
    assert AgentConfig(node=node, cpu_quota=0.4).cpu_quota == 0.4
    with pytest.raises(ValidationError, match="greater than 0"):
        AgentConfig(node=node, cpu_quota=0)
    with pytest.raises(ValidationError, match="minimum quota"):
        AgentConfig(node=node, cpu_quota=0.001)
    for value in (0.4, "unavailable", None):
        st = AgentStatus(node_id="n1", cpu_quota=value)
        assert AgentStatus.model_validate_json(st.model_dump_json()).cpu_quota == value
        facts = NodeFacts(node_kind="cpu", cpu_quota=value)
        assert facts.summary().get("cpu_quota") == value


def test_the_period_is_configurable_and_validated() -> None:
    node = NodeSpec(node_id="n1", gpu_type="cpu-slow", gpus=1, zone="z")
    cfg = AgentConfig(node=node, cpu_quota=0.4)
    assert cfg.cpu_quota_period_ms == 100 and cfg.cpu_quota_period_us == 100_000
    assert AgentConfig(node=node, cpu_quota=0.4, cpu_quota_period_ms=20).cpu_quota_period_us == (
        20_000
    )
    for bad in (0.5, 0, 1001):  # the kernel takes 1 ms to 1 s
        with pytest.raises(ValidationError, match="cpu_quota_period_ms"):
            AgentConfig(node=node, cpu_quota=0.4, cpu_quota_period_ms=bad)
    # 0.05 cores is 5 ms per 100 ms, but 0.5 ms per 10 ms: below the kernel's 1 ms
    assert AgentConfig(node=node, cpu_quota=0.05).cpu_quota == 0.05
    with pytest.raises(ValidationError, match="minimum quota"):
        AgentConfig(node=node, cpu_quota=0.05, cpu_quota_period_ms=10)


@pytest.mark.parametrize("version", [1, 2])
def test_a_node_cgroup_writes_its_period_and_an_outside_change_keeps_it(
    tmp_path: Path, version: int
) -> None:
    """Files stand in for the kernel's: the period the agent chose is written with the quota,
    and a quota set from outside (``node_cgroup``, which knows no period) keeps it."""
    from sailor.agent.cgroup_layout import Hierarchy
    from sailor.agent.cpu_quota import NodeCgroup

    h = Hierarchy(version=version, base=PurePosixPath(tmp_path))  # type: ignore[arg-type]
    rel = PurePosixPath("sailor/job/n1")
    for d in (tmp_path, tmp_path / "sailor", tmp_path / "sailor/job"):  # v2 hands cpu down
        d.mkdir(exist_ok=True)
        (d / "cgroup.subtree_control").write_text("cpu")
    cg = NodeCgroup.create(h, rel, 0.4, period_us=20_000)
    if version == 1:
        assert (cg.path / "cpu.cfs_period_us").read_text() == "20000"
        assert (cg.path / "cpu.cfs_quota_us").read_text() == "8000"
    else:
        assert (cg.path / "cpu.max").read_text() == "8000 20000"
    assert cg.period() == 20_000 and cg.quota() == pytest.approx(0.4)
    outside = NodeCgroup(h, rel)  # found by name, as node_cgroup() does
    outside.set_quota(0.1)
    assert cg.period() == 20_000 and cg.quota() == pytest.approx(0.1)
