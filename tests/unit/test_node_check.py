"""``sailor check`` without servers: CUDA names -> catalog types, the verdict table, the
report schema, the join event's facts, and the command on this (GPU-less) machine."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from sailor import catalog
from sailor.agent.check_verdicts import judge
from sailor.catalog.cuda_names import (
    CUDA_NAMES,
    CudaName,
    UnknownGPUError,
    catalog_gpu_name,
)
from sailor.cli.main import app
from sailor.schemas.events import EventAdapter, NodeJoined
from sailor.schemas.hardware import NodeSpec
from sailor.schemas.node_check import (
    CheckLine,
    CheckReport,
    DeviceFacts,
    EndpointFacts,
    NodeFacts,
    ProbeFacts,
)

GIB = 1 << 30

# Memory as CUDA reports it (torch.cuda.get_device_properties(i).total_memory), by device
REPORTED = {
    "NVIDIA A100-SXM4-40GB": (42_298_834_944, "A100-40"),
    "NVIDIA A100-PCIE-40GB": (42_298_834_944, "A100-40"),
    "NVIDIA A100-SXM4-80GB": (85_174_583_296, "A100-80"),
    "NVIDIA A100 80GB PCIe": (85_097_971_712, "A100-80"),
    "NVIDIA H100 80GB HBM3": (85_028_306_944, "H100-80"),
    "NVIDIA H100 PCIe": (85_029_158_912, "H100-80"),
    "NVIDIA H200": (150_754_820_096, "H200"),
    "NVIDIA GH200 480GB": (102_005_473_280, "GH-96"),
    "Tesla V100-SXM2-16GB": (16_945_512_448, "V100-16"),
    "Tesla V100-PCIE-16GB": (16_945_512_448, "V100-16"),
    "Tesla T4": (15_843_721_216, "T4"),
    "NVIDIA L4": (23_034_331_136, "L4"),
    "NVIDIA GeForce RTX 3090": (25_438_126_080, "RTX-3090"),
    "NVIDIA TITAN RTX": (25_396_969_472, "Titan-RTX"),
    "NVIDIA GeForce RTX 2080 Ti": (11_554_717_696, "RTX-2080"),
}


# ---- CUDA name -> catalog type ---------------------------------------------------------------


def test_every_catalog_gpu_has_a_cuda_name_and_every_mapped_type_is_in_the_catalog() -> None:
    gpus = catalog.gpus()
    mapped = {r.catalog for r in CUDA_NAMES if r.catalog}
    assert mapped == set(gpus) - {"cpu"}
    for name in mapped:  # the nominal memory of the table is the catalog's
        rows = [r for r in CUDA_NAMES if r.catalog == name]
        assert all(r.memory_bytes == gpus[name].memory_bytes for r in rows), rows


@pytest.mark.parametrize(("cuda_name", "expected"), sorted(REPORTED.items()))
def test_real_cuda_names_with_their_reported_memory_map_to_the_catalog(
    cuda_name: str, expected: tuple[int, str]
) -> None:
    memory, gpu_type = expected
    assert catalog_gpu_name(cuda_name, memory, catalog.gpus()) == gpu_type


def test_names_of_older_drivers_and_spacing_are_the_same_device() -> None:
    gpus = catalog.gpus()
    assert catalog_gpu_name("GeForce RTX 2080 Ti", 11_554_717_696, gpus) == "RTX-2080"
    assert catalog_gpu_name("TITAN RTX", 25_396_969_472, gpus) == "Titan-RTX"
    assert catalog_gpu_name("  nvidia  h100 80gb   HBM3 ", 85_028_306_944, gpus) == "H100-80"


def test_memory_tells_apart_variants_that_share_a_name() -> None:
    gpus = catalog.gpus()
    assert catalog_gpu_name("NVIDIA GH200 480GB", 102_005_473_280, gpus) == "GH-96"
    with pytest.raises(UnknownGPUError, match="not in the catalog"):
        catalog_gpu_name("NVIDIA GH200 480GB", 150_000_000_000, gpus)  # the 144 GB HBM3e


@pytest.mark.parametrize(
    ("cuda_name", "memory", "why", "candidates"),
    [
        # a name Sailor does not know: the catalog types of its memory are offered
        ("NVIDIA B200", 191_000_000_000, "not a CUDA device name Sailor knows", ()),
        ("NVIDIA RTX A6000", 25_400_000_000, "not a CUDA device name", ("L4", "RTX-3090")),
        # known GPUs without a spec sheet in the catalog
        ("Tesla V100-SXM2-32GB", 34_089_730_048, "not in the catalog", ()),
        ("NVIDIA A10G", 23_836_033_024, "not in the catalog", ("L4",)),
        ("NVIDIA H100 NVL", 100_500_000_000, "not in the catalog", ("GH-96",)),
        # a known name with the wrong memory: a MIG slice, say
        ("NVIDIA A100-SXM4-40GB", 10_200_000_000, "MIG slice", ("RTX-2080",)),
    ],
)
def test_unknown_names_are_refused_with_name_memory_and_candidates(
    cuda_name: str, memory: int, why: str, candidates: tuple[str, ...]
) -> None:
    with pytest.raises(UnknownGPUError, match=why) as info:
        catalog_gpu_name(cuda_name, memory, catalog.gpus())
    err = info.value
    assert err.cuda_name == cuda_name and err.memory_bytes == memory
    assert set(candidates) <= set(err.candidates)
    assert cuda_name in str(err) and f"{memory / GIB:.1f} GiB" in str(err)
    assert "--gpu-type" in str(err)


def test_a_name_whose_memory_fits_two_catalog_types_is_ambiguous() -> None:
    table = (CudaName("NVIDIA X", 40, "A100-40"), CudaName("NVIDIA X", 40.5, "A100-80"))
    with pytest.raises(UnknownGPUError, match="ambiguous") as info:
        catalog_gpu_name("NVIDIA X", 42_298_834_944, catalog.gpus(), table)
    assert info.value.candidates == ("A100-40", "A100-80")


def test_a_mapped_type_missing_from_the_given_catalog_is_refused() -> None:
    gpus = {k: v for k, v in catalog.gpus().items() if k != "T4"}
    with pytest.raises(UnknownGPUError, match="T4 is not in this catalog"):
        catalog_gpu_name("Tesla T4", 15_843_721_216, gpus)


# ---- verdicts ------------------------------------------------------------------------------

A100 = catalog.gpus()["A100-40"].memory_bytes


def _dev(i: int, name: str = "A100-40", bf16: bool = True, **kw: object) -> DeviceFacts:
    base: dict[str, object] = {
        "index": i,
        "cuda_name": "NVIDIA A100-SXM4-40GB",
        "catalog_name": name,
        "memory_bytes": 42_298_834_944,
        "free_bytes": 41_000_000_000,
        "capability": (8, 0) if bf16 else (7, 5),
        "bf16": bf16,
        "fp16": True,
    }
    return DeviceFacts.model_validate({**base, **kw})


def _up(url: str) -> EndpointFacts:
    return EndpointFacts(url=url, reachable=True, tls=True, seconds=0.01)


GOOD = NodeFacts(
    node_kind="gpu",
    gpu_type="A100-40",
    gpus=2,
    torch_version="2.13.0+cu128",
    torch_cuda="12.8",
    gathered=True,
    cuda_available=True,
    driver_version="570.86.15",
    nccl_version="2.27.3",
    devices=(_dev(0), _dev(1)),
    probe=ProbeFacts(ranks=2, all_reduce_ok=True, p2p_ok=True, bus_gbps=180.0, seconds=3.0),
    nats=_up("nats://head:4222"),
    etcd=_up("head:2379"),
)
CPU_HOST = NodeFacts(
    node_kind="gpu",
    gpu_type="A100-40",
    gpus=2,
    torch_version="2.13.0+cpu",
    gathered=True,
    cuda_error="torch was built without CUDA",
    nats=_up("nats://head:4222"),
    etcd=_up("head:2379"),
)
DOWN = EndpointFacts(url="head:2379", reachable=False, error="UnavailableError: timed out")


def _v(report: CheckReport) -> dict[str, str]:
    return {line.check: line.verdict for line in report.lines}


# (name, facts, allow_cpu, serves, {check: verdict} that must appear)
CASES: list[tuple[str, NodeFacts, bool, bool, dict[str, str]]] = [
    ("ready", GOOD, False, True, {"cuda": "ok", "nccl": "ok", "gpu1": "ok", "p2p": "ok"}),
    ("no GPU on a GPU node", CPU_HOST, False, False, {"cuda": "fail"}),
    ("no GPU, --allow-cpu", CPU_HOST, True, True, {"cuda": "warn", "etcd": "ok"}),
    (
        "cpu node",
        NodeFacts(node_kind="cpu", gpu_type="cpu", gpus=1, nats=_up("n"), etcd=_up("e")),
        False,
        True,
        {"node": "ok", "nats": "ok"},
    ),
    (
        "cpu node, etcd down",
        NodeFacts(node_kind="cpu", gpu_type="cpu", gpus=1, nats=_up("n"), etcd=DOWN),
        False,
        False,
        {"etcd": "fail"},
    ),
    ("no config", GOOD.model_copy(update={"gpu_type": "", "gpus": 0, "nats": None, "etcd": None}),
     False, True, {"node": "warn", "nats": "warn", "etcd": "warn"}),
    ("no NCCL", GOOD.model_copy(update={"nccl_version": ""}), False, False, {"nccl": "fail"}),
    ("driver unknown", GOOD.model_copy(update={"driver_version": ""}), False, True,
     {"driver": "warn"}),
    ("fewer GPUs than configured", GOOD.model_copy(update={"gpus": 4}), False, False,
     {"devices": "fail"}),
    ("more GPUs than configured", GOOD.model_copy(update={"gpus": 1}), False, True,
     {"devices": "warn"}),
    ("a GPU of another type", GOOD.model_copy(update={"gpu_type": "H100-80"}), False, False,
     {"gpu0": "fail", "gpu1": "fail"}),
    ("a GPU not in the catalog",
     GOOD.model_copy(update={"devices": (_dev(0), _dev(1, name="", name_error="unknown"))}),
     False, False, {"gpu0": "ok", "gpu1": "fail"}),
    ("mixed types without a config",
     GOOD.model_copy(update={"gpu_type": "", "gpus": 0, "devices": (_dev(0), _dev(1, "A100-80"))}),
     False, False, {"devices": "fail"}),
    ("memory held by another process",
     GOOD.model_copy(update={"devices": (_dev(0), _dev(1, free_bytes=10 * GIB))}),
     False, True, {"gpu1": "warn"}),
    ("fp16 only (T4)",
     GOOD.model_copy(update={"devices": (_dev(0, bf16=False), _dev(1, bf16=False))}),
     False, True, {"precision": "ok"}),
    ("no tensor math",
     GOOD.model_copy(update={"devices": (_dev(0, fp16=False, bf16=False), _dev(1))}),
     False, False, {"precision": "fail"}),
    ("probe not run", GOOD.model_copy(update={"probe": None}), False, True,
     {"collective": "warn"}),
    ("probe failed", GOOD.model_copy(update={"probe": ProbeFacts(ranks=2, error="NCCL error")}),
     False, False, {"collective": "fail"}),
    ("wrong sum", GOOD.model_copy(update={"probe": ProbeFacts(ranks=2, p2p_ok=True)}), False,
     False, {"collective": "fail"}),
    ("p2p broken",
     GOOD.model_copy(update={"probe": ProbeFacts(ranks=2, all_reduce_ok=True, p2p_ok=False)}),
     False, False, {"collective": "ok", "p2p": "fail"}),
    ("one GPU",
     GOOD.model_copy(update={"gpus": 1, "devices": (_dev(0),),
                             "probe": ProbeFacts(ranks=1, all_reduce_ok=True)}),
     False, True, {"p2p": "ok"}),
    ("nats down", GOOD.model_copy(update={"nats": DOWN}), False, False, {"nats": "fail"}),
    ("facts not gathered (agent check off)", GOOD.model_copy(update={"gathered": False}), False,
     True, {"cuda": "warn"}),
]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "facts", "allow_cpu", "serves", "expect"), CASES, ids=[c[0] for c in CASES]
)
def test_verdict_table(
    name: str, facts: NodeFacts, allow_cpu: bool, serves: bool, expect: dict[str, str]
) -> None:
    report = judge(facts, node_id="n1", allow_cpu=allow_cpu)
    got = _v(report)
    assert {k: got.get(k) for k in expect} == expect, report.lines
    assert report.serves is serves
    assert (report.verdict == "fail") is (not serves)
    for line in report.lines:  # every line that is not ok says what to do
        assert line.verdict == "ok" or line.action, line
    assert CheckReport.model_validate_json(report.model_dump_json()) == report


def test_a_cpu_node_has_no_gpu_lines() -> None:
    facts = NodeFacts(node_kind="cpu", gpu_type="cpu", gpus=1)
    assert [line.check for line in judge(facts).lines] == ["node", "nats", "etcd"]


def test_a_report_whose_serves_contradicts_its_lines_is_refused() -> None:
    fail = CheckLine(check="cuda", verdict="fail", detail="no GPU", action="get one")
    facts = NodeFacts(node_kind="gpu")
    with pytest.raises(ValueError, match="serves=True: must be False"):
        CheckReport(lines=(fail,), facts=facts, serves=True)
    with pytest.raises(ValueError, match="device indices"):
        NodeFacts(node_kind="gpu", devices=(_dev(1),))


# ---- the join event ------------------------------------------------------------------------


def test_node_joined_carries_the_facts_and_reads_events_without_them() -> None:
    node = NodeSpec(node_id="n1", gpu_type="A100-40", gpus=2, zone="z")
    ev = NodeJoined(event_id="e1", node_id="n1", time=1.0, node=node, facts=GOOD)
    back = EventAdapter.validate_json(ev.model_dump_json())
    assert isinstance(back, NodeJoined) and back.facts == GOOD
    old = {"kind": "node_joined", "event_id": "e0", "node_id": "n1", "time": 1.0,
           "node": node.model_dump(), "schema_version": 1}  # fmt: skip
    joined = EventAdapter.validate_json(json.dumps(old))
    assert isinstance(joined, NodeJoined) and joined.facts is None


# ---- the command on this machine -----------------------------------------------------------


def test_sailor_check_on_this_machine_says_there_is_no_gpu() -> None:
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this host has a GPU: tests/gpu covers sailor check there")
    runner = CliRunner()
    res = runner.invoke(app, ["check", "--json"])
    assert res.exit_code == 1, res.output
    report = CheckReport.model_validate_json(res.stdout)
    assert not report.serves
    cuda = next(line for line in report.lines if line.check == "cuda")
    assert cuda.verdict == "fail" and "no GPU" in cuda.detail and "CUDA build" in cuda.action
    assert report.facts.devices == () and report.facts.probe is None

    res = runner.invoke(app, ["check", "--json", "--allow-cpu"])
    assert res.exit_code == 0, res.output
    report = CheckReport.model_validate_json(res.stdout)
    assert report.serves and _v(report)["cuda"] == "warn"

    res = runner.invoke(app, ["check"])
    assert res.exit_code == 1 and "not ready" in res.stdout


def test_profile_names_the_cuda_device_by_its_catalog_type(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``sailor profile layers|network --device cuda`` without --gpu-type: the catalog type
    of device 0, not its CUDA name (the planner matches profiles by catalog type). torch's
    device queries are replaced: this host has no GPU."""
    import types

    import torch
    import typer

    from sailor.cli.profile_group import local_gpu_type

    props = types.SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=85_028_306_944)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    assert local_gpu_type("cuda") == "H100-80"
    assert local_gpu_type("cpu") == "cpu"
    props.name, props.total_memory = "NVIDIA A10G", 23_836_033_024
    with pytest.raises(typer.Exit) as raised:  # the CLI entry prints it as one line
        local_gpu_type("cuda")
    err = str(raised.value)
    assert "'NVIDIA A10G' with 22.2 GiB: not in the catalog" in err and "--gpu-type" in err
