"""What the profiler does differently on a GPU, checked on the CPU: the precision it computes
in, the memory bound it measures within, and the all-reduce fit of the collective probe."""

from __future__ import annotations

import pytest
import torch

from sailor import catalog
from sailor.profiler import precision as prec
from sailor.schemas import LayerProfile

TINY = catalog.model("tiny-gpt")


# --- precision (issue 24, item 6) -------------------------------------------------------------


@pytest.mark.parametrize(
    ("device", "model_precision", "bf16", "want"),
    [
        ("cuda", "fp16", True, "bf16"),
        ("cuda", "bf16", True, "bf16"),
        ("cuda", "fp16", False, "fp16"),  # V100, T4, Titan RTX, RTX 2080: no bf16 units
        ("cuda", "bf16", False, "fp16"),
        ("cuda", "fp32", True, "fp32"),
        ("cpu", "fp16", True, "fp32"),
        ("cpu", "bf16", False, "fp32"),
    ],
)
def test_precision_follows_the_device(
    device: str, model_precision: str, bf16: bool, want: str
) -> None:
    spec = TINY.model_copy(update={"precision": model_precision})
    assert prec.compute_precision(spec, torch.device(device), lambda: bf16) == want


def test_precision_asks_the_gpu_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without an explicit query, the CUDA capability decides (bf16 emulation does not count)."""
    seen: list[bool] = []

    def query(including_emulation: bool = True) -> bool:
        seen.append(including_emulation)
        return False

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", query)
    fp16_model = TINY.model_copy(update={"precision": "fp16"})
    assert prec.compute_precision(fp16_model, torch.device("cuda", 0)) == "fp16"
    assert seen == [False]
    with prec.autocast(torch.device("cpu"), "fp32"):
        assert not torch.is_autocast_enabled("cpu")
    with prec.autocast(torch.device("cpu"), "bf16"):
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16


def test_profile_records_its_precision() -> None:
    """The database says what the layers computed in (fp32 on the CPU)."""
    from sailor.profiler.layer_bench import LayerMeasurement
    from sailor.profiler.layers import to_profile_db
    from sailor.profiler.timing import Stats

    st = Stats.of([1e-3])
    ms = [
        LayerMeasurement(
            kind=TINY.layer_kind(i),
            tp=1,
            mbs=1,
            fwd=st,
            bwd=st,
            update=st,
            params=1,
            saved_bytes=0,
            output_bytes=0,
            input_bytes=0,
            peak_growth_bytes=0,
            layer=i,
        )
        for i in range(TINY.num_all_layers)
    ]
    db = to_profile_db(TINY, "T4", ms, {}, precision="fp16")
    assert {t.precision for t in db.timings} == {"fp16"}
    assert LayerProfile.model_fields["precision"].default is None  # older files still load
