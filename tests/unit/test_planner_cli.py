"""``sailor plan``: table, JSON, export in the original's format, Pareto plot, errors."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from sailor.cli.main import app
from sailor.importers.sailor_format import plan_from_dict

runner = CliRunner()


def _pool(tmp_path: Path, body: str, name: str = "pool") -> Path:
    p = tmp_path / f"{name}.yaml"
    p.write_text(body)
    return p


POOL = """
entries:
  - {gpu_type: A100-40, zone: us-central1-a, nodes: 2, gpus_per_node: 4}
  - {gpu_type: V100-16, zone: us-central1-a, nodes: 2, gpus_per_node: 4}
"""


def _prepare(reference: Path, tmp_path: Path) -> tuple[Path, Path]:
    prof_dir = tmp_path / "prof"
    res = runner.invoke(
        app,
        [
            "import",
            "sailor-profiles",
            str(reference / "profiles"),
            "--model",
            "OPT-350",
            "-o",
            str(prof_dir),
        ],
    )
    assert res.exit_code == 0, res.output
    net = tmp_path / "net.json"
    res = runner.invoke(
        app,
        [
            "import",
            "sailor-network",
            str(reference / "providers" / "multizone_bandwidths_het.json"),
            "--intra",
            str(reference / "providers" / "intra_node_bandwidths.json"),
            "-o",
            str(net),
        ],
    )
    assert res.exit_code == 0, res.output
    return prof_dir / "OPT-350.json", net


def test_plan_json_export_and_pareto(reference: Path, tmp_path: Path) -> None:
    prof, net = _prepare(reference, tmp_path)
    pool = _pool(tmp_path, POOL)
    exported = tmp_path / "best.json"
    png = tmp_path / "pareto.png"
    base = [
        "plan",
        "--model",
        "OPT-350",
        "--pool",
        str(pool),
        "--profiles",
        str(prof),
        "--network",
        str(net),
    ]
    res = runner.invoke(
        app,
        [
            *base,
            "--json",
            "--top",
            "2",
            "--one-mbs",
            "--export-sailor",
            str(exported),
            "--pareto",
            str(png),
        ],
    )
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["search_time_s"] > 0
    assert 1 <= len(out["plans"]) <= 2
    first = out["plans"][0]
    assert first["throughput_iter_s"] > 0 and first["cost_per_iter_usd"] > 0
    assert first["plan"]["pipelines"]
    # robust by default: each plan's interval and its regret against each corner's best
    assert out["risk"] == "robust"
    # priced for Sailor's engine unless told otherwise
    assert out["deployment"]["name"] == "calibration"
    assert out["deployment"]["p2p_across_tp"] == "scatter_gather"
    assert set(first["regret"]) == {"optimistic", "median", "pessimistic", "original"}
    assert first["interval"]["fits_in_memory"]
    assert 0 < first["worst_ratio"] <= 1
    # the exported plan reads back as the same plan
    back = plan_from_dict(json.loads(exported.read_text()), "OPT-350")
    assert back.num_gpus == sum(first["gpus_by_type_zone"].values())
    assert png.stat().st_size > 1000
    table = runner.invoke(app, [*base, "--explain", "--objective", "cost", "--top", "1"])
    assert table.exit_code == 0, table.output
    assert "of bound" in table.stdout and "simulated:" in table.stdout
    assert "interval over the uncertainty set" in table.stdout and "regret" in table.stdout
    bad = runner.invoke(app, [*base, "--risk", "reckless"])
    assert bad.exit_code != 0 and "--risk" in bad.output


def test_plan_errors(reference: Path, tmp_path: Path) -> None:
    prof, _ = _prepare(reference, tmp_path)
    pool = _pool(tmp_path, POOL)
    res = runner.invoke(app, ["plan", "--model", "nope", "--pool", str(pool)])
    assert res.exit_code == 2 and "not in the catalog" in res.output
    res = runner.invoke(
        app, ["plan", "--model", "OPT-350", "--pool", str(pool), "--deployment", "deepspeed"]
    )
    assert res.exit_code == 2 and "'deepspeed'" in res.output and "sailor" in res.output
    bad = _pool(
        tmp_path, "entries:\n  - {gpu_type: A100-40, zone: z, nodes: -1, gpus_per_node: 4}\n", "bad"
    )
    res = runner.invoke(app, ["plan", "--model", "OPT-350", "--pool", str(bad)])
    assert res.exit_code == 2 and "nodes" in res.output
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00entries")
    res = runner.invoke(app, ["plan", "--model", "OPT-350", "--pool", str(binary)])
    assert res.exit_code == 2 and "binary.yaml: not UTF-8 text (byte 0" in res.output, res.output
    empty = _pool(tmp_path, "entries: []\n", "empty")
    res = runner.invoke(
        app, ["plan", "--model", "OPT-350", "--pool", str(empty), "--profiles", str(prof)]
    )
    assert res.exit_code == 2 and "empty" in res.output
    unknown = _pool(
        tmp_path,
        "entries:\n  - {gpu_type: H900, zone: us-central1-a, nodes: 1, gpus_per_node: 4}\n",
        "unknown",
    )
    res = runner.invoke(app, ["plan", "--model", "OPT-350", "--pool", str(unknown)])
    assert res.exit_code == 2 and "H900" in res.output
    res = runner.invoke(
        app,
        [
            "plan",
            "--model",
            "OPT-350",
            "--pool",
            str(pool),
            "--profiles",
            str(prof),
            "--min-throughput",
            "1000",
        ],
    )
    assert res.exit_code == 1 and "upper bound" in res.output
    res = runner.invoke(
        app, ["plan", "--model", "OPT-350", "--pool", str(pool), "--max-gpus", "A100"]
    )
    assert res.exit_code == 2 and "TYPE=N" in res.output


def test_free_or_infinite_prices(reference: Path, tmp_path: Path) -> None:
    """A GPU at $0/h (owned hardware) is refused by a search that ranks or caps by cost,
    naming the pool entry (it divided by zero), and planned for throughput; an infinite
    price is refused when read (JSON has no infinity: it would be written back as null)."""
    prof, _ = _prepare(reference, tmp_path)
    pool = _pool(tmp_path, POOL)

    def prices(a100: str) -> Path:
        p = tmp_path / "prices.json"
        p.write_text(
            '{"gpus": ['
            f'{{"gpu_type": "A100-40", "region": "us-central1", "on_demand_usd_per_hour": {a100}, '
            f'"spot_usd_per_hour": {a100}}},'
            '{"gpu_type": "V100-16", "region": "us-central1", "on_demand_usd_per_hour": 2.0, '
            '"spot_usd_per_hour": 0.7}]}'
        )
        return p

    base = ["plan", "--model", "OPT-350", "--pool", str(pool), "--profiles", str(prof)]
    free = ["--prices", str(prices("0"))]
    for extra in (["--objective", "cost"], ["--max-cost-per-iter", "5"]):
        res = runner.invoke(app, [*base, *free, *extra])
        assert res.exit_code == 2, res.output
        assert "A100-40 in us-central1-a" in res.output and "$0/h" in res.output, res.output
    res = runner.invoke(app, [*base, *free, "--risk", "median"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, [*base, "--prices", str(prices("Infinity"))])
    assert res.exit_code == 2 and "on_demand_usd_per_hour" in res.output, res.output
