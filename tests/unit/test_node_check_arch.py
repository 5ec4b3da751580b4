"""``sailor check``'s ``arch`` line: a GPU the installed torch build has no kernels for fails,
naming the device, its capability, the build's arch list and the build that has it. The
arch lists are recorded inputs (the support matrix of torch 2.13's builds), so all of this
runs on a CPU host; ``tests/gpu/test_arch_gpu.py`` checks the running device on a GPU."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from sailor import catalog
from sailor.agent.check_gather import gather_gpu
from sailor.agent.check_verdicts import judge
from sailor.catalog.torch_builds import (
    BUILDS,
    CATALOG_CAPABILITY,
    CU126,
    CU130,
    DEFAULT_BUILD,
    TORCH_VERSION,
    build_for,
    serving_arch,
)
from sailor.schemas.node_check import CheckLine, DeviceFacts, NodeFacts

ROOT = Path(__file__).resolve().parents[2]

V100 = DeviceFacts(
    index=0,
    cuda_name="Tesla V100-SXM2-16GB",
    catalog_name="V100-16",
    memory_bytes=16_945_512_448,
    capability=(7, 0),
    bf16=False,
    fp16=True,
)
L4 = DeviceFacts(
    index=0,
    cuda_name="NVIDIA L4",
    catalog_name="L4",
    memory_bytes=23_034_331_136,
    capability=(8, 9),
    bf16=True,
    fp16=True,
)


def _facts(device: DeviceFacts, arch_list: tuple[str, ...], cuda: str = "13.0") -> NodeFacts:
    return NodeFacts(
        node_kind="gpu",
        gpu_type=device.catalog_name,
        gpus=1,
        gathered=True,
        cuda_available=True,
        torch_version=TORCH_VERSION,
        torch_cuda=cuda,
        nccl_version="2.29.7",
        driver_version="580.95.05",
        arch_list=arch_list,
        devices=(device,),
    )


def _arch(facts: NodeFacts) -> CheckLine:
    (line,) = [x for x in judge(facts).lines if x.check == "arch"]
    return line


def test_a_v100_under_the_pypi_build_fails_and_is_pointed_at_the_cu126_index() -> None:
    """The PyPI wheel of torch 2.13.0 is the CUDA 13.0 build, without sm_70: before, the
    check said nothing and every V100 rank died at its first kernel."""
    report = judge(_facts(V100, CU130.arch_list))
    line = _arch(_facts(V100, CU130.arch_list))
    assert line.verdict == "fail" and not report.serves
    assert "gpu0 'Tesla V100-SXM2-16GB'" in line.detail
    assert "compute capability 7.0 (sm_70)" in line.detail
    assert "sm_75, sm_80, sm_86, sm_90, sm_100, sm_120, compute_120" in line.detail
    assert "no kernel image is available" in line.detail
    assert "--index-url https://download.pytorch.org/whl/cu126" in line.action
    assert f"torch=={TORCH_VERSION}" in line.action and "SAILOR_TORCH_INDEX" in line.action


def test_the_cu126_build_runs_a_v100_and_an_l4_by_binary_compatibility() -> None:
    assert _arch(_facts(V100, CU126.arch_list, "12.6")).verdict == "ok"
    line = _arch(_facts(L4, CU126.arch_list, "12.6"))  # 8.9 runs sm_86 cubins
    assert line.verdict == "ok" and "sm_89 by sm_86" in line.detail


def test_an_empty_arch_list_warns_and_a_device_no_build_has_says_so() -> None:
    assert _arch(_facts(V100, ())).verdict == "warn"
    kepler = V100.model_copy(update={"capability": (3, 7), "catalog_name": "V100-16"})
    line = _arch(_facts(kepler, CU126.arch_list))
    assert line.verdict == "fail" and "no CUDA build of torch" in line.action


@pytest.mark.parametrize(
    ("arch_list", "capability", "served_by"),
    [
        (("sm_70", "sm_80"), (7, 0), "sm_70"),
        (("sm_75", "sm_80"), (7, 0), None),  # no Volta cubin, no PTX at or below 7.0
        (("sm_80", "sm_86"), (8, 9), "sm_86"),  # same major, lower minor: binary compatible
        (("sm_86",), (8, 0), None),  # a higher minor never runs on a lower one
        (("sm_90",), (10, 0), None),  # nor across a major revision
        (("sm_90", "compute_90"), (10, 0), "compute_90"),  # PTX: JIT for any later device
        (("sm_120", "compute_120"), (12, 1), "sm_120"),  # a cubin before PTX
        (("compute_120",), (10, 0), None),  # PTX never runs on an earlier device
        (("sm_90a",), (9, 0), "sm_90a"),
        (("sm_100a",), (10, 3), None),  # architecture-specific: that capability only
        (("sm_100f",), (10, 3), "sm_100f"),  # family-specific: the family's later minors
        (("garbage", "sm_x0"), (8, 0), None),
    ],
)
def test_which_arch_entry_serves_a_capability(
    arch_list: tuple[str, ...], capability: tuple[int, int], served_by: str | None
) -> None:
    assert serving_arch(arch_list, capability) == served_by


def test_the_default_build_runs_every_gpu_type_of_the_catalog() -> None:
    """The deployment installs one build for every node, so that a pool mixing GPU types
    runs one NCCL: it must have kernels for the oldest catalog GPU (V100, 7.0)."""
    assert set(CATALOG_CAPABILITY) == set(catalog.gpus()) - {"cpu"}
    caps = list(CATALOG_CAPABILITY.values())
    assert min(caps) == (7, 0)
    assert build_for(caps) is DEFAULT_BUILD
    assert all(serving_arch(DEFAULT_BUILD.arch_list, c) for c in caps)
    # the PyPI build does not: the reason for the default
    (pypi,) = [b for b in BUILDS if b.on_pypi]
    assert serving_arch(pypi.arch_list, CATALOG_CAPABILITY["V100-16"]) is None


def test_the_builds_table_is_for_the_pinned_torch() -> None:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (torch_pin,) = [d for d in deps if re.match(r"torch\b", d)]
    assert torch_pin == f"torch=={TORCH_VERSION}"


def test_the_gather_on_a_host_without_cuda_reports_no_arch_list() -> None:
    gpu = gather_gpu(probe=False)
    if gpu.get("cuda_available"):
        pytest.skip("this host has CUDA: tests/gpu/test_arch_gpu.py checks it")
    assert "arch_list" not in gpu
    facts = NodeFacts.model_validate({"node_kind": "gpu", **gpu})
    assert facts.arch_list == () and facts.runtime() is not None  # torch is known
