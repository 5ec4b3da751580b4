"""Importers of the original formats: every reference file imports; bad ones fail clearly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sailor.importers.sailor_format import (
    ImportFormatError,
    export_plan,
    import_egress,
    import_network,
    import_plan,
    import_pool,
    import_profiles,
    import_trace,
    import_training_config,
    plan_from_dict,
    profile_models,
)


def test_every_profile_model_imports(reference: Path) -> None:
    prof = reference / "profiles" / "profiles_tmp.json"
    info = reference / "profiles" / "llm_info.json"
    models = profile_models(prof)
    assert {"OPT-350", "GPT-Neo-2.7", "OPT-30", "LLAMA-3-8"} <= set(models)
    for m in models:
        db = import_profiles(prof, info, m)
        assert db.timings and db.sizes
        assert all(t.source == "imported" for t in db.timings)
    db = import_profiles(prof, info, "OPT-350")
    t = db.timing("GH-96", 4, 8, 5)
    assert t is not None and t.kind == "block" and t.fwd_s > 0
    s = db.size(1, 1)
    assert s is not None and s.params == 12596224  # one OPT-350 block, unsharded


def test_every_network_file_imports(reference: Path) -> None:
    prov = reference / "providers"
    for f in ("multizone_bandwidths.json", "multizone_bandwidths_het.json"):
        net = import_network(prov / f, prov / "intra_node_bandwidths.json")
        assert net.links and net.intra_node
        for ln in net.links[:50]:
            assert 0 < ln.curve.gbps(1e8) <= ln.curve.max_gbps


def test_egress_prices(reference: Path) -> None:
    p = import_egress(reference / "providers" / "communication_cost.json")
    assert p.egress_per_gb("us-central1-a", "us-central1-a") == 0
    assert p.egress_per_gb("us-central1-a", "us-central1-b") == pytest.approx(0.01)
    assert p.egress_per_gb("us-central1-a", "us-west1-b") == pytest.approx(0.02)


def test_every_validation_plan_imports_and_round_trips(reference: Path) -> None:
    files = sorted((reference / "validation").rglob("plan_config_*.json"))
    assert len(files) == 15
    for f in files:
        plan = import_plan(f, "OPT-350")
        raw = json.loads(f.read_text())
        assert plan.global_batch_size == raw["gbs"]
        dp = sum(t["dp"][0] for t in raw["pipeline_list"])
        assert len(plan.pipelines) == dp
        back = plan_from_dict(export_plan(plan), "OPT-350")
        assert back.pipelines == plan.pipelines


def test_every_planner_result_imports(reference: Path) -> None:
    for f in sorted((reference / "planner_results").glob("*.json")):
        data = json.loads(f.read_text())
        results = [r for v in data.values() for r in v] if isinstance(data, dict) else data
        for r in results:
            if not r.get("plan"):
                continue
            degrees = [set(t["dp_degrees"]) for t in r["plan"]["pipelines"]]
            if any(len(d) > 1 for d in degrees):
                # Stage-wise data parallelism cannot be expressed; it must fail clearly.
                with pytest.raises(ImportFormatError, match="per-stage data parallelism"):
                    plan_from_dict(r["plan"], "OPT-350", global_batch_size=1024)
                continue
            plan = plan_from_dict(r["plan"], "OPT-350", global_batch_size=1024)
            assert plan.global_batch_size == 1024


def test_configs_and_traces(reference: Path) -> None:
    cfg = reference / "configs"
    m = import_training_config(cfg / "training_config_opt_350.json")
    assert m.num_all_layers == 26
    pool = import_pool(cfg / "dummy_quotas_dict.json", cfg / "basic_cluster_config.json")
    # Quotas are GPUs; nodes are whole (150 GPUs of 4 per node → 37 nodes).
    assert pool.gpus_by_type()["A100-40"] == sum(n // 4 * 4 for n in (150, 50, 100, 50, 100))
    for csv_file in cfg.glob("gpu_trace_*.csv"):
        states = import_trace(csv_file, cfg / "basic_cluster_config.json")
        assert states and all(p.total_gpus > 0 for _, p in states)


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        ({"mbs": 1}, "gbs"),
        ({"mbs": 1, "gbs": 4}, "pipeline_list"),
        ({"mbs": "x", "gbs": 4, "pipeline_list": []}, "mbs"),
        (
            {
                "mbs": 1,
                "gbs": 4,
                "pipeline_list": [
                    {
                        "layers_per_stage": [[0, 2]],
                        "tmp_per_stage": [[[[["A100-40", 4, "z"]], 1]]],
                        "dp": [1],
                    }
                ],
            },
            "layers_per_stage[0]",
        ),
        (
            {
                "mbs": 1,
                "gbs": 4,
                "pipeline_list": [
                    {
                        "layers_per_stage": [[0, 1]],
                        "tmp_per_stage": [[[[["A100-40", 4, "z"]], 3]]],
                        "dp": [1],
                    }
                ],
            },
            "tmp_per_stage[0][0]",
        ),
        (
            {
                "mbs": 1,
                "gbs": 4,
                "pipeline_list": [
                    {
                        "layers_per_stage": [[0, 1]],
                        "tmp_per_stage": [[[[["A100-40", 4, "z"]], 1]]],
                        "dp": [2],
                    }
                ],
            },
            "dp",
        ),
    ],
)
def test_malformed_plan_names_file_and_field(tmp_path: Path, payload: object, field: str) -> None:
    f = tmp_path / "plan_config_bad.json"
    f.write_text(json.dumps(payload))
    with pytest.raises(ImportFormatError) as exc:
        import_plan(f, "OPT-350")
    assert str(f) in str(exc.value)
    assert field in exc.value.field


def test_malformed_profile_and_network_name_file_and_field(tmp_path: Path) -> None:
    f = tmp_path / "profiles_tmp.json"
    f.write_text(json.dumps({"M": {"A100-40": {"1": {"1": {"0": [0.1, "x", 0.1]}}}}}))
    with pytest.raises(ImportFormatError, match=r"profiles_tmp.json: field 'M.A100-40.1.1.0\[1\]'"):
        import_profiles(f, None, "M")
    with pytest.raises(ImportFormatError, match="field 'Q': missing"):
        import_profiles(f, None, "Q")
    n = tmp_path / "net.json"
    n.write_text(json.dumps({"z": {"A100-40": {"4": {"z": {"A100-40": {"4": [[1, 2], 5]}}}}}}))
    with pytest.raises(ImportFormatError, match=r"net\.json"):
        import_network(n)
    n.write_text("{not json")
    with pytest.raises(ImportFormatError, match="not valid JSON"):
        import_network(n)


def test_a_network_curve_at_or_below_zero_inside_its_range_is_refused(tmp_path: Path) -> None:
    # synthetic: (L - 3)(L - 6) = L^2 - 9L + 18 is < 0 GB/s for L in (3, 6), i.e. 8 MB..64 MB,
    # inside the probed 1 MB..1 GB; it was imported and floored at 1 MB/s there
    n = tmp_path / "multizone_bandwidths.json"
    good = [[0.0, 0.5, 2.0], 10e9]
    bad = [[1.0, -9.0, 18.0], 10e9]
    n.write_text(json.dumps({"z": {"A100-40": {"4": {"z": {"A100-40": {"4": good, "8": bad}}}}}}))
    with pytest.raises(ImportFormatError) as exc:
        import_network(n)
    assert exc.value.field == "z.A100-40.4.z.A100-40.8[0]"
    assert "8,000,000..64,000,000 bytes" in str(exc.value)
    # the same curve lifted above zero imports, and a linear one that reaches 0 at the top
    # end of the range is refused at that one size
    bad[0] = [1.0, -9.0, 20.5]
    n.write_text(json.dumps({"z": {"A100-40": {"4": {"z": {"A100-40": {"8": bad}}}}}}))
    assert import_network(n).links[0].curve.gbps(16e6) > 0.2
    intra = tmp_path / "intra_node_bandwidths.json"
    intra.write_text(json.dumps({"A100-40": {"2": [[0.0, -1.0, 10.0], 10e9]}}))
    with pytest.raises(ImportFormatError, match=r"1,024,000,000\.\.1,024,000,000 bytes"):
        import_network(n, intra)


def test_every_reference_file_imports_through_the_dispatcher(reference: Path) -> None:
    from sailor.importers.sailor_extra import import_any
    from sailor.schemas import Plan

    files = [f for f in sorted(reference.rglob("*")) if f.is_file()]
    data = [f for f in files if f.name not in ("LICENSE", "README.md")]
    assert len(data) >= 40
    for f in data:
        result = import_any(f, reference_dir=reference)
        assert result is not None, f
        if f.name.startswith("plan_config_"):
            assert isinstance(result, Plan)
    with pytest.raises(ImportFormatError, match="not a format"):
        import_any(reference / "LICENSE", reference_dir=reference)


def test_extra_formats_content(reference: Path) -> None:
    from sailor.importers.sailor_extra import (
        import_availability_trace,
        import_ds_config,
        import_network_coeffs,
        import_varuna_memory,
    )
    from sailor.schemas import Endpoint

    mem = import_varuna_memory(reference / "profiles" / "varuna_profile_OPT.json", "OPT-350")
    assert mem.memory and all(m.bytes > 0 for m in mem.memory)
    net = import_network_coeffs(reference / "providers" / "network_coeffs_all_homo.json")
    ep = Endpoint(zone="us-central1-a", gpu_type="A100-40", gpus_per_node=4)
    curve = net.inter(ep, ep)  # zone-agnostic fit applies inside a zone
    assert curve is not None and curve.gbps(1e8) > 0
    states = import_availability_trace(
        reference / "traces" / "a100_trace.json", gpu_type="A100-40", zone="z"
    )
    assert states[0][1].total_gpus >= 1
    ds = import_ds_config(reference / "configs" / "ds_config.json")
    assert ds.optimizer == "AdamW" and ds.micro_batch_size == 1


def test_trace_going_back_in_time_is_rejected(tmp_path: Path) -> None:
    from sailor.importers.sailor_extra import import_availability_trace

    f = tmp_path / "t.json"
    f.write_text(json.dumps([{"Time": 5, "GPUs": 2}, {"Time": 1, "GPUs": 2}]))
    with pytest.raises(ImportFormatError, match=r"\[1\]\.Time"):
        import_availability_trace(f, gpu_type="A100-40", zone="z")


def test_a_key_of_the_wrong_kind_says_what_it_needs() -> None:
    """A string key looked up in a list read "expected an object or a list, got list"."""
    from sailor.importers._read import get

    with pytest.raises(
        ImportFormatError, match=r"field 'a.b': expected an object \(key 'b'\), got list"
    ):
        get([1, 2], "b", "f.json", "a.b")
    with pytest.raises(ImportFormatError, match=r"expected a list \(an index\), got str"):
        get("text", 0, "f.json", "a[0]")
    assert get({"b": 3}, "b", "f.json", "a.b") == 3 and get([1, 2], -1, "f.json", "a[-1]") == 2
