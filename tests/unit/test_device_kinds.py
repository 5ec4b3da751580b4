"""CPU kinds as device types: the predicate, and what a kind takes from the ``cpu`` entry.

Every ``cpu-<kind>`` is a CPU wherever the device matters (backend, precision, MFU, node
check) and falls back to the ``cpu`` entry of a spec, price or calibration table that has no
entry of its own; a table's own entry for a kind wins, and GPU types never fall back.
"""

from __future__ import annotations

import pytest

from sailor import catalog
from sailor.agent.check_gather import node_facts
from sailor.megatron_patch.devices import DeviceMappingError, backend_for
from sailor.metrics.throughput import mfu_by_gpu_type
from sailor.schemas import GPUPrice, NodeSpec, PriceTable
from sailor.schemas.calibration import Calibration, GPUCalibration
from sailor.schemas.device_kind import any_cpu_type, catalog_type, is_cpu_type, spec_of
from sailor.schemas.plan import Pipeline, Plan, ReplicaGroup, Stage
from sailor.schemas.precision import choose_precision


@pytest.mark.parametrize(
    ("name", "cpu"),
    [
        ("cpu", True),
        ("cpu-slow", True),
        ("cpu-full", True),
        ("cpu-0.4", True),
        ("cpu-a_b.c-1", True),
        ("cpu-", False),
        ("cpu--slow", False),
        ("cpux", False),
        ("CPU", False),
        ("cpu-slow/x", False),
        ("cpu slow", False),
        ("A100-40", False),
        ("", False),
    ],
)
def test_which_device_types_are_cpus(name: str, cpu: bool) -> None:
    assert is_cpu_type(name) is cpu
    assert catalog_type(name) == ("cpu" if cpu else name)


def test_any_cpu_type() -> None:
    assert any_cpu_type(["A100-40", "cpu-slow"])
    assert not any_cpu_type(["A100-40", "H100-80"])
    assert not any_cpu_type([])


def test_a_kind_takes_the_cpu_spec_under_its_own_name() -> None:
    specs = catalog.gpus()
    cpu = specs["cpu"]
    slow = spec_of(specs, "cpu-slow")
    assert slow is not None and slow.name == "cpu-slow"
    assert slow.memory_bytes == cpu.memory_bytes
    assert slow.peak_tflops_fp32 == cpu.peak_tflops_fp32
    assert "'cpu' entry" in slow.source
    assert spec_of(specs, "cpu") is cpu
    assert spec_of(specs, "A100-40") is specs["A100-40"]
    assert spec_of(specs, "B200") is None  # GPU types never fall back
    assert spec_of({}, "cpu-slow") is None  # nothing to fall back to
    assert catalog.gpu("cpu-slow") == slow
    with pytest.raises(KeyError, match="CPU kinds"):
        catalog.gpu("B200")


def test_a_user_catalog_entry_for_a_kind_wins() -> None:
    own = catalog.gpus()["cpu"].model_copy(
        update={"name": "cpu-big", "memory_bytes": 64 << 30, "source": "user catalog"}
    )
    specs = {**catalog.gpus(), "cpu-big": own}
    assert spec_of(specs, "cpu-big") is own


def test_a_kind_takes_the_cpu_calibration_unless_it_has_its_own() -> None:
    cal = catalog.calibration()
    assert cal.for_gpu("cpu-slow") == cal.for_gpu("cpu") != cal.default
    assert cal.is_calibrated("cpu-slow")
    assert cal.for_gpu("B200") == cal.default and not cal.is_calibrated("B200")
    own = GPUCalibration(gpu_type="cpu-slow", network_efficiency=0.5, source="fit")
    mine = cal.with_gpu(own)
    assert mine.for_gpu("cpu-slow") == own
    assert mine.for_gpu("cpu-full") == cal.for_gpu("cpu")
    assert Calibration().for_gpu("cpu-slow") == Calibration().default  # no cpu entry


def test_a_kind_is_priced_as_cpu_unless_it_has_its_own_price() -> None:
    prices = catalog.prices()
    for spot in (True, False):
        assert prices.gpu_hour("cpu-slow", "local-a", spot) == prices.gpu_hour("cpu", "x-y-z", spot)
    own = PriceTable(
        gpus=(
            *prices.gpus,
            GPUPrice(
                gpu_type="cpu-slow",
                region="*",
                on_demand_usd_per_hour=0.01,
                spot_usd_per_hour=0.005,
            ),
        )
    )
    assert own.gpu_hour("cpu-slow", "local-a", True) == 0.005
    assert own.gpu_hour("cpu-full", "local-a", True) == prices.gpu_hour("cpu", "local-a", True)
    with pytest.raises(KeyError, match="B200"):
        prices.gpu_hour("B200", "us-central1-a")


def _plan(*types: str) -> Plan:
    n = len(types)
    stages = tuple(
        Stage(
            first_layer=i,
            last_layer=i if i < n - 1 else 5,
            replica=ReplicaGroup(gpu_type=g, zone="z", gpus_per_node=1),
        )
        for i, g in enumerate(types)
    )
    return Plan(
        model="tiny-gpt",
        global_batch_size=2,
        pipelines=(Pipeline(stages=stages, microbatch_size=1, num_microbatches=2),),
    )


def test_kinds_run_on_gloo_and_in_fp32_and_have_no_mfu() -> None:
    mixed = _plan("cpu-full", "cpu-slow", "cpu")
    assert backend_for(mixed) == "gloo"
    with pytest.raises(DeviceMappingError, match="mixes cpu and GPU"):
        backend_for(_plan("cpu-slow", "A100-40"))
    assert choose_precision(["cpu-slow"], catalog.gpus()) == "fp32"
    assert choose_precision(["A100-40"], catalog.gpus()) == "bf16"
    mfu = mfu_by_gpu_type(mixed, catalog.model("tiny-gpt"), 0.1, "fp32", catalog.gpus())
    assert mfu == {"cpu-full": None, "cpu-slow": None, "cpu": None}


def test_a_node_of_a_kind_is_a_cpu_node() -> None:
    node = NodeSpec(node_id="n1", gpu_type="cpu-slow", gpus=1, zone="z")
    facts = node_facts(node)
    assert facts.node_kind == "cpu" and facts.gpu_type == "cpu-slow"
    gpu = node_facts(node.model_copy(update={"gpu_type": "A100-40"}))
    assert gpu.node_kind == "gpu"
