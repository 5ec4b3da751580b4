"""``sailor profile``: measure layers and links on this machine; estimate GPUs not at hand.

* ``sailor profile layers --model M --device cpu|cuda --tp 1,2,4 --mbs 1,2,4,8 -o DB.json``
  (``--kind cpu-slow --cpu-quota 0.4``: a CPU kind, measured under its nodes' quota)
* ``sailor profile network -o NET.json [--zone Z --gpu-type G --gpus-per-node K ...]``
* ``sailor profile estimate --gpu H100-80 --from DB.json [-o OUT.json]``

Each command merges into its output file (measured beats imported beats estimated; a re-run
replaces its own earlier figures) and prints a summary table.

The commands live in ``profile_layers_cmd`` and ``profile_network_cmd`` (``estimate`` here),
on the app of ``profile_group``, re-exported here as ``profile_app`` (what ``sailor.cli.main``
adds); importing them registers them in this order (layers, network, estimate), the order
``sailor profile --help`` lists them in.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.table import Table

from sailor import catalog

# imported for their commands: layers, then network, register before estimate below
from sailor.cli import profile_layers_cmd, profile_network_cmd  # noqa: F401
from sailor.cli._io import fail, load_model
from sailor.cli.profile_group import (
    check_grid,
    existing_db,
    model_spec,
    parse_ints,
    profile_app,
)
from sailor.cli.tables import print_table
from sailor.profiler.merge import merge_db, save_db
from sailor.schemas import NetworkProfile, ProfileDB

if TYPE_CHECKING:
    from sailor.profiler.calibrated_estimate import LooRow

__all__ = ["profile_app"]


@profile_app.command("estimate")
def estimate_cmd(
    gpu: str = typer.Option(..., help="GPU type to estimate (catalog name, e.g. H100-80)."),
    from_db: Path = typer.Option(..., "--from", help="ProfileDB with measured/imported GPUs."),
    out: Path | None = typer.Option(None, "-o", "--out", help="Output (default: --from)."),
    model_file: Path | None = typer.Option(None, help="ModelSpec file (default: catalog)."),
    tp: str | None = typer.Option(None, help="TP degrees (default: those measured)."),
    mbs: str | None = typer.Option(None, help="Microbatch sizes (default: those measured)."),
    affine: bool = typer.Option(False, help="Fit latency + scale instead of a pure scale."),
    network: Path | None = typer.Option(
        None,
        help="NetworkProfile whose intra-node curves price the TP all-reduces taken out of "
        "the measured GPUs' times, and those of the leave-one-GPU-out check (default: "
        "spec-sheet links). The estimated entries hold compute only: the simulator adds "
        "the estimated GPU's own all-reduces over the plan's network profile.",
    ),
) -> None:
    """Roofline scaled by measured compute efficiency (the simulator adds the GPU's own TP
    all-reduces); leave-one-GPU-out error on the database."""
    from sailor.profiler.calibrated_estimate import (
        calibrated_efficiencies,
        estimate_gpu,
        leave_one_gpu_out,
        measured_grid,
    )

    db = load_model(from_db, ProfileDB)
    spec = model_spec(db.model, model_file)
    specs = catalog.gpus()
    if gpu not in specs:
        raise fail(f"--gpu={gpu!r}: not in the catalog (known: {', '.join(specs)})")
    net = load_model(network, NetworkProfile) if network is not None else None
    table = calibrated_efficiencies(db, spec, specs, affine=affine, network=net)
    measured = sorted({k for g in db.gpu_types() for k in measured_grid(db, g)})
    tps = parse_ints(tp, "tp") if tp else tuple(sorted({t for t, _ in measured})) or (1,)
    bs = parse_ints(mbs, "mbs") if mbs else tuple(sorted({b for _, b in measured})) or (1,)
    check_grid(spec, tps, bs, tp or "", mbs or "")
    est = estimate_gpu(spec, specs[gpu], table, [(t, b) for t in tps for b in bs])
    est = est.model_copy(
        update={
            "meta": {
                **est.meta,
                f"{gpu}.estimated_from": ",".join(
                    g for g in db.gpu_types() if g in specs and g != gpu
                ),
            }
        }
    )
    target = out or from_db
    old = existing_db(target)
    replaced = 0
    if old is not None:
        # a new estimate replaces every older one of the GPU type, not only its (TP, mbs):
        # the compute-only stamp is per type, and an older entry kept beside it (written
        # with its all-reduces inside) would pay them twice
        keep = tuple(t for t in old.timings if not (t.gpu_type == gpu and t.source == "estimated"))
        replaced = len(old.timings) - len(keep)
        old = old.model_copy(update={"timings": keep})
    merged, dropped = merge_db(old, est)
    save_db(merged, target)
    con = Console()
    con.print(
        f"{gpu}: {len(est.timings)} estimated entries for {spec.name} (tp {tps}, mbs {bs}) "
        f"written to {target} ({replaced} older estimated entries of {gpu} replaced); "
        f"{dropped} kept from a measured/imported source"
    )
    rows = leave_one_gpu_out(db, spec, specs, affine=affine, network=net)
    if not rows:
        con.print("leave-one-GPU-out: needs at least two measured GPU types with spec sheets")
        return
    t = Table(
        title=f"leave-one-GPU-out on {from_db.name} ({spec.name}): |error| of fwd+bwd "
        "(all layers) and of the update, calibrated vs plain roofline"
    )
    for col in ("gpu", "points", "fwd+bwd cal.", "roofline", "update cal.", "roofline"):
        t.add_column(col, justify="right")
    by: dict[str, list[LooRow]] = {}
    for r in rows:
        by.setdefault(r.gpu_type, []).append(r)
    for g, rs in sorted(by.items()):
        t.add_row(g, str(len(rs)), *_errs(rs))
    t.add_row("all", str(len(rows)), *_errs(rows), style="bold")
    print_table(con, t)


def _errs(rs: list[LooRow]) -> list[str]:
    def m(f: str) -> str:
        return f"{100 * statistics.fmean(abs(getattr(r, f)) for r in rs):.1f}%"

    return [m("err"), m("roofline_err"), m("update_err"), m("roofline_update_err")]
