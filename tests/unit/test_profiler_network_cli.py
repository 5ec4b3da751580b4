"""``sailor profile network --device cuda`` on one node with several GPUs, checked on the CPU:
torch is told it has ``n`` GPUs and the rank processes are replaced by fakes at
``run_ranks``, so everything above them runs as on a GPU host (the device checks, the
endpoint, the section a curve goes into, what is written when)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from sailor.cli.main import app
from sailor.profiler import collective_probe, network_probe
from sailor.profiler.procs import RankFailedError
from sailor.profiler.timing import Stats
from sailor.schemas import Endpoint, NetworkProfile, ReplicaGroup

GPU = "H100-80"
_FAST = ["--min-bytes", "65536", "--max-bytes", "1048576", "--bytes-per-size", "1048576"]
_SIZES = ["--collective-sizes", "1048576"]


class _FakeRanks:
    """Stands in for the rank processes of both probes; records the world of each launch.
    ``fail_at``: the all-reduce rank count whose launch fails as a rank would."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, gpus: int, fail_at: int = 0) -> None:
        self.collective_worlds: list[int] = []
        self.link_world: int = 0
        self.link_ranks: list[int] | None = None
        self.link_launches = 0
        self.fail_at = fail_at
        monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
        monkeypatch.setattr(network_probe, "run_ranks", self._link)
        monkeypatch.setattr(collective_probe, "run_ranks", self._collective)

    def _link(self, module: str, world: int, cfg: dict[str, Any], **kw: Any) -> list[Any]:
        self.link_launches += 1
        self.link_world, self.link_ranks = world, kw.get("ranks")
        k = int(cfg.get("pairs", 1))
        here = kw.get("ranks") or list(range(world))

        def pts(r: int) -> list[dict[str, Any]]:
            # pair r is slower by r microseconds: the node pair's time is the slowest's
            times = [[20e-6 + r * 1e-6 + b / 150e9] * reps for b, reps in cfg["sizes"]]
            return [
                {"nbytes": b, "time": Stats.of(t).to_dict(), "times": t}
                for (b, _), t in zip(cfg["sizes"], times, strict=True)
            ]

        return [{"rank": r, "points": pts(r) if r < k else []} for r in here]

    def _collective(self, module: str, world: int, cfg: dict[str, Any], **_: Any) -> list[Any]:
        self.collective_worlds.append(world)
        if world == self.fail_at:
            raise RankFailedError(module, world - 1, "exit 1", "NCCL error: unhandled system error")
        one = {str(b): Stats.of([10e-6 * world + b / 100e9]).to_dict() for b in cfg["sizes"]}
        return [{"all": [one] * world}]


def _network(out: Path, *args: str) -> Any:
    return CliRunner().invoke(
        app, ["profile", "network", "-o", str(out), "--gpu-type", GPU, *_FAST, *_SIZES, *args]
    )


def test_cuda_loopback_link_is_the_intra_node_curve(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Two GPUs of one node (NVLink/PCIe) are recorded as the node's intra-node curve: in
    ``links`` the simulator's zone fallback would price node-to-node transfers with it."""
    _FakeRanks(monkeypatch, gpus=2)
    out = tmp_path / "net.json"
    res = _network(out, "--device", "cuda", "--zone", "z-a", "--collectives", "")
    assert res.exit_code == 0, res.output
    net = NetworkProfile.model_validate_json(out.read_text())
    assert net.links == ()
    assert [ln.src for ln in net.intra_node] == [
        Endpoint(zone="z-a", gpu_type=GPU, gpus_per_node=2)
    ]
    assert net.intra(GPU, 2) is not None
    other = Endpoint(zone="z-a", gpu_type=GPU, gpus_per_node=8)
    assert net.inter(other, other) is None  # two nodes are not priced at NVLink speed
    assert "GPUs 0 and 1 of one node" in net.source
    # one endpoint on loopback: a receiving endpoint of another kind is refused, as is --intra
    # between two nodes; neither starts a probe
    bad = _network(out, "--device", "cuda", "--dst-zone", "z-b", "--collectives", "")
    assert bad.exit_code != 0 and "--rank 0|1" in bad.output
    two = _network(out, "--intra", "--rank", "0", "--master", "127.0.0.1:1", "--collectives", "")
    assert two.exit_code != 0 and "--intra with --rank 0" in two.output


def test_cpu_loopback_link_stays_a_link(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """On the CPU two gloo processes stand for two nodes (the CPU closed loop): unchanged, and
    the default rank counts are not clamped by GPUs."""
    fake = _FakeRanks(monkeypatch, gpus=0)
    out = tmp_path / "net.json"
    res = CliRunner().invoke(app, ["profile", "network", "-o", str(out), *_FAST, *_SIZES])
    assert res.exit_code == 0, res.output
    net = NetworkProfile.model_validate_json(out.read_text())
    assert len(net.links) == 1 and net.intra_node == ()
    assert net.links[0].src == Endpoint(zone="local", gpu_type="cpu", gpus_per_node=1)
    assert fake.collective_worlds == [2, 3, 4]
    assert "warning" not in res.stderr


def test_default_collectives_are_clamped_to_the_gpus_here(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """On a 3-GPU node the default 2,3,4 runs 2 and 3 (saying so on stderr) instead of failing
    at 4 after the link and the other sweeps ran, with nothing written."""
    fake = _FakeRanks(monkeypatch, gpus=3)
    out = tmp_path / "net.json"
    res = _network(out, "--device", "cuda", "--zone", "z-a")
    assert res.exit_code == 0, res.output
    assert "sees 3 GPU(s)" in res.stderr and "among 2, 3 ranks only (not 4)" in res.stderr
    assert fake.collective_worlds == [2, 3]
    net = NetworkProfile.model_validate_json(out.read_text())
    assert [c.ranks for c in net.collectives] == [2, 3]
    assert {c.scope for c in net.collectives} == {"intra_node"}
    # counts given explicitly that the node cannot run are refused before any probe
    fake.link_launches = 0
    bad = _network(tmp_path / "other.json", "--device", "cuda", "--collectives", "2,4")
    assert bad.exit_code != 0 and "--collectives='2,4'" in bad.output
    assert fake.link_launches == 0 and not (tmp_path / "other.json").exists()


def test_a_failed_all_reduce_keeps_what_finished(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The link is written before the all-reduces and each all-reduce as it finishes: a
    failure at 3 ranks keeps the link and the 2-rank record, and says so."""
    _FakeRanks(monkeypatch, gpus=4, fail_at=3)
    out = tmp_path / "net.json"
    res = _network(out, "--device", "cuda", "--zone", "z-a")
    assert res.exit_code != 0
    assert "all-reduce among 3 ranks" in res.output and "NCCL error" in res.output
    assert "the link, the all-reduce among 2 ranks written to" in res.output
    net = NetworkProfile.model_validate_json(out.read_text())
    assert len(net.intra_node) == 1
    assert [c.ranks for c in net.collectives] == [2]


def test_intra_node_all_reduces_are_found_for_this_node(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """GPUs per node defaults to the GPUs here, so the records match the endpoint the
    simulator builds for a ring inside one of this pool's nodes; endpoints unlikely to match
    are warned about."""
    from sailor.schemas.calibration import LinkEta
    from sailor.simulator.network_model import ring_allreduce

    _FakeRanks(monkeypatch, gpus=4)
    out = tmp_path / "net.json"
    res = _network(out, "--device", "cuda", "--zone", "us-central1-a", "--collectives", "2,4")
    assert res.exit_code == 0, res.output
    assert "warning" not in res.stderr
    net = NetworkProfile.model_validate_json(out.read_text())
    ring = [
        ReplicaGroup(gpu_type=GPU, zone="us-central1-a", gpus_per_node=4, node_id="n1")
        for _ in range(2)
    ]
    ep = Endpoint(zone="us-central1-a", gpu_type=GPU, gpus_per_node=4)
    assert net.collective_latency(ep, 2) == pytest.approx(20e-6 + 8 / 100e9)
    assert net.collective_bus_gbps(ep, 4) is not None
    bare = net.model_copy(update={"collectives": ()})
    # the measured latency and bus bandwidth price the ring, not the p2p curve's steps
    assert ring_allreduce(net, ring, 64e6, 16e6, LinkEta.as_read(1.0)).time_s != pytest.approx(
        ring_allreduce(bare, ring, 64e6, 16e6, LinkEta.as_read(1.0)).time_s
    )
    # the default zone, or a node shape other than this one's: warned on stderr
    local = _network(tmp_path / "l.json", "--device", "cuda", "--gpus-per-node", "8")
    assert local.exit_code == 0, local.output
    assert "--zone local (the default)" in local.stderr
    assert "--gpus-per-node 8, but this process sees 4 GPU(s)" in local.stderr


def test_all_reduce_fails_are_reported_on_rank_1(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Rank 1 of a two-node probe reports a failed all-reduce as an error, not a traceback."""
    _FakeRanks(monkeypatch, gpus=1, fail_at=2)
    args = ["--device", "cuda", "--rank", "1", "--master", "10.0.0.1:29500", "--zone", "z-a"]
    res = _network(tmp_path / "net.json", *args)
    assert res.exit_code == 2 and "all-reduce among 2 ranks" in res.output


def test_pairs_between_two_nodes_run_one_rank_per_gpu_and_keep_the_slowest(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``--pairs 4`` on side 0 of two 8-GPU nodes: ranks 0-3 here (GPUs 2-5 from --gpu 2),
    a world of 8, and each size's time the slowest pair's."""
    fake = _FakeRanks(monkeypatch, gpus=8)
    out = tmp_path / "net.json"
    args = ["--device", "cuda", "--zone", "z-a", "--dst-zone", "z-b", "--collectives", ""]
    # a master that resolves (a host that does not is refused before any rank starts)
    side0 = ["--rank", "0", "--master", "127.0.0.1:1"]
    res = _network(out, *args, *side0, "--pairs", "4", "--gpu", "2")
    assert res.exit_code == 0, res.output
    assert fake.link_world == 8 and fake.link_ranks == [0, 1, 2, 3]
    net = NetworkProfile.model_validate_json(out.read_text())
    assert len(net.links) == 1 and "4 pairs of processes at once" in net.source
    # more GPUs than the node has, or pairs on one node's loopback, are refused before a probe
    fake.link_launches = 0
    many = _network(out, *args, *side0, "--pairs", "4", "--gpu", "6")
    assert many.exit_code != 0 and fake.link_launches == 0
    loop = _network(tmp_path / "x.json", "--device", "cuda", "--pairs", "2", "--collectives", "")
    assert loop.exit_code != 0 and "--pairs=2 on cuda on loopback" in loop.output
    intra = _network(tmp_path / "y.json", "--intra", "--pairs", "2", "--collectives", "")
    assert intra.exit_code != 0 and "--pairs=2 with --intra" in intra.output


def test_the_slowest_pair_sets_each_repetition(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = _FakeRanks(monkeypatch, gpus=0)
    del fake
    pts = network_probe.run_probe(
        network_probe.ProbeSettings(min_bytes=1 << 16, max_bytes=1 << 17, pairs=3)
    )
    # pair 2 is 2 us slower than pairs 0 and 1 at every size (the fake's ranks): its times
    assert [p.nbytes for p in pts] == [(1 << 16) - (1 << 16) % 12, (1 << 17) - (1 << 17) % 12]
    for p in pts:
        assert p.time.median_s == pytest.approx(20e-6 + 2e-6 + p.nbytes / 150e9)


def test_the_gpu_types_are_checked_against_the_catalog(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``--gpu-type`` and ``--dst-gpu-type`` follow ``profile layers --kind``'s rule: on cuda
    a catalog GPU type, or a name it lacks with --new-gpu-type; before, any name was
    recorded, and the simulator never found the link under it. Refused before a probe."""
    fake = _FakeRanks(monkeypatch, gpus=2)
    args = ["--device", "cuda", "--zone", "z-a", "--collectives", ""]
    out = tmp_path / "net.json"
    res = CliRunner().invoke(
        app, ["profile", "network", "-o", str(out), *_FAST, *args, "--gpu-type", "Z100"]
    )
    assert res.exit_code == 2 and "--gpu-type='Z100': not a GPU type of the catalog" in res.stderr
    bad = _network(out, *args, "--dst-gpu-type", "Z100")
    assert bad.exit_code == 2 and "--dst-gpu-type='Z100': not a GPU type" in bad.stderr
    assert fake.link_launches == 0 and not out.exists()
    res = CliRunner().invoke(
        app,
        [
            "profile",
            "network",
            "-o",
            str(out),
            *_FAST,
            *args,
            "--gpu-type",
            "Z100",
            "--new-gpu-type",
        ],
    )
    assert res.exit_code == 0, res.output
    net = NetworkProfile.model_validate_json(out.read_text())
    assert [ln.src.gpu_type for ln in net.intra_node] == ["Z100"]


def test_a_cpu_kind_is_an_endpoint_of_a_cpu_probe(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A CPU kind (the CPU closed loop's ``cpu-full``) is recorded on --device cpu."""
    _FakeRanks(monkeypatch, gpus=0)
    out = tmp_path / "net.json"
    argv = ["profile", "network", "-o", str(out), *_FAST, "--collectives", ""]
    res = CliRunner().invoke(app, [*argv, "--gpu-type", "cpu-full", "--dst-gpu-type", "cpu-slow"])
    assert res.exit_code == 0, res.output
    (link,) = NetworkProfile.model_validate_json(out.read_text()).links
    assert (link.src.gpu_type, link.dst.gpu_type) == ("cpu-full", "cpu-slow")


def test_only_rank0_limits_the_wait_for_its_peer_in_both_probes(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Rank 0 gives each probe's ranks --connect-timeout for rank 1's to join
    (``run_ranks``' ``PeerNotJoinedError``): an all-reduce whose peer never joins fails
    naming the option and the address, the link kept. Rank 1 and loopback pass no limit
    (rank 1's ranks start only once rank 0 listens, and fail as soon as rank 0's go)."""
    import socket

    from sailor.profiler.procs import PeerNotJoinedError

    fake = _FakeRanks(monkeypatch, gpus=0)
    given: list[tuple[str, float | None]] = []
    link = fake._link

    def link_seen(module: str, world: int, cfg: dict[str, Any], **kw: Any) -> list[Any]:
        given.append(("link", kw.get("join_timeout_s")))
        return link(module, world, cfg, **kw)

    def never_joined(module: str, world: int, cfg: dict[str, Any], **kw: Any) -> list[Any]:
        given.append(("all-reduce", kw.get("join_timeout_s")))
        raise PeerNotJoinedError(module, kw["master"], kw["join_timeout_s"])

    monkeypatch.setattr(network_probe, "run_ranks", link_seen)
    monkeypatch.setattr(collective_probe, "run_ranks", never_joined)
    out = tmp_path / "net.json"
    argv = ["profile", "network", "-o", str(out), *_FAST, *_SIZES]
    side0 = ["--rank", "0", "--master", "127.0.0.1:29500", "--connect-timeout", "3"]
    res = CliRunner().invoke(app, [*argv, *side0, "--collectives", "2"])
    assert res.exit_code == 2, res.output
    assert given == [("link", 3.0), ("all-reduce", 3.0)]
    want = "all-reduce among 2 ranks: --connect-timeout=3: rank 1 did not join rank 0 at "
    assert f"{want}127.0.0.1:29501 within 3 s" in res.stderr, res.stderr
    assert len(NetworkProfile.model_validate_json(out.read_text()).links) == 1
    given.clear()
    assert CliRunner().invoke(app, [*argv, "--collectives", ""]).exit_code == 0
    with socket.create_server(("127.0.0.1", 0)) as listening:
        side1 = ["--rank", "1", "--master", f"127.0.0.1:{listening.getsockname()[1]}"]
        res = CliRunner().invoke(app, [*argv, *side1, "--collectives", ""])
    assert res.exit_code == 0, res.output
    assert given == [("link", None), ("link", None)]
