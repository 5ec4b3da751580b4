"""sd_notify against a real unix datagram socket, as systemd's notify socket behaves."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from sailor.coordination.sd_notify import SystemdNotifier


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[tuple[str, socket.socket]]:
    path = str(tmp_path / "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(2)
    try:
        yield path, sock
    finally:
        sock.close()


def _received(sock: socket.socket) -> list[str]:
    out = []
    sock.setblocking(False)
    try:
        while True:
            out.append(sock.recv(4096).decode())
    except BlockingIOError:
        pass
    finally:
        sock.settimeout(2)
    return out


def test_ready_status_stopping(notify_socket: tuple[str, socket.socket]) -> None:
    path, sock = notify_socket
    sd = SystemdNotifier.from_env({"NOTIFY_SOCKET": path})
    assert sd.enabled and not sd.watchdog_enabled
    assert sd.ready("standby:\n connected")
    assert sock.recv(4096).decode() == "READY=1\nSTATUS=standby: connected"
    assert sd.status("leader, epoch 7")
    assert sock.recv(4096).decode() == "STATUS=leader, epoch 7"
    assert sd.stopping()
    assert sock.recv(4096).decode() == "STOPPING=1"
    assert not sd.watchdog()  # no WATCHDOG_USEC: systemd did not ask for pings
    assert _received(sock) == []


def test_watchdog_is_rate_limited(notify_socket: tuple[str, socket.socket]) -> None:
    path, sock = notify_socket
    now = [100.0]
    sd = SystemdNotifier(path, watchdog_usec=3_000_000, monotonic=lambda: now[0])
    assert sd.watchdog_enabled and sd.watchdog_s == 3.0
    sent = []
    for _ in range(40):  # a loop calling it every 0.1 s for 4 s
        sent.append(sd.watchdog())
        now[0] += 0.1
    # at most one ping per second (a third of the 3 s interval): t = 100, 101, 102, 103
    assert sum(sent) == 4
    assert _received(sock) == ["WATCHDOG=1"] * 4


def test_watchdog_pid_of_another_process_disables_pings(
    notify_socket: tuple[str, socket.socket],
) -> None:
    path, _ = notify_socket
    env = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "1000000"}
    assert SystemdNotifier.from_env(env).watchdog_enabled
    mine = {**env, "WATCHDOG_PID": str(os.getpid())}
    assert SystemdNotifier.from_env(mine).watchdog_enabled
    other = {**env, "WATCHDOG_PID": str(os.getpid() + 1)}
    assert not SystemdNotifier.from_env(other).watchdog_enabled
    assert not SystemdNotifier.from_env({**env, "WATCHDOG_USEC": "junk"}).watchdog_enabled


def test_abstract_namespace_socket() -> None:
    name = f"sailor-test-{os.getpid()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.settimeout(2)
    try:
        assert SystemdNotifier.from_env({"NOTIFY_SOCKET": "@" + name}).ready()
        assert sock.recv(4096) == b"READY=1"
    finally:
        sock.close()


def test_no_socket_is_a_noop_and_a_dead_socket_does_not_raise(tmp_path: Path) -> None:
    off = SystemdNotifier.from_env({"WATCHDOG_USEC": "1000000"})
    assert not off.enabled and not off.watchdog_enabled
    assert not off.ready() and not off.watchdog() and not off.stopping()
    dead = SystemdNotifier(str(tmp_path / "nobody-listens"), watchdog_usec=1_000_000)
    assert not dead.ready()  # logged, never raised into the daemon
    assert not dead.watchdog()


def test_daemons_build_their_notifier_from_the_environment(
    notify_socket: tuple[str, socket.socket], monkeypatch: pytest.MonkeyPatch
) -> None:
    from sailor.agent.agent_config import AgentConfig
    from sailor.agent.daemon import Agent
    from sailor.controller.config import ControllerConfig
    from sailor.controller.daemon import Controller
    from sailor.controller.planning import DataParallelPlanner

    path, _ = notify_socket
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    cfg = ControllerConfig(audit_log=Path(path).parent / "audit.jsonl", planner="data_parallel")
    ctl = Controller(
        cfg, planner=DataParallelPlanner(cfg.model, cfg.num_layers, cfg.global_batch_size)
    )
    assert ctl.sd.address == path and ctl.sd.watchdog_s == 30.0
    ctl.audit.close()
    node = {"node_id": "n1", "gpu_type": "cpu", "gpus": 1, "zone": "z"}
    agent = Agent(AgentConfig.model_validate({"node": node, "work_dir": str(Path(path).parent)}))
    assert agent.sd.address == path and agent.sd.watchdog_enabled
