"""``sailor simulate PLAN``: iteration time, memory and cost of one plan, with breakdowns."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from sailor import catalog
from sailor.cli._io import (
    DEPLOYMENT_HELP,
    check_png_out,
    fail,
    load_deployment,
    load_model,
    priced_for,
    warn_unpriced,
    write_json,
)
from sailor.cli.tables import print_table
from sailor.schemas import (
    Estimate,
    EstimateInterval,
    ModelSpec,
    NetworkProfile,
    Plan,
    PriceTable,
    ProfileDB,
)
from sailor.schemas.calibration import Calibration
from sailor.simulator import ProfileLookupError, simulate, simulate_with_timeline
from sailor.simulator.uncertainty import simulate_interval

__all__ = ["load_inputs", "simulate_cmd"]


def load_inputs(
    model_name: str,
    model_file: Path | None,
    profiles: list[Path] | None,
    network: Path | None,
    prices: Path | None,
) -> tuple[ModelSpec, ProfileDB, NetworkProfile, PriceTable]:
    """Model, merged profiles, network and prices from files or the built-in catalog."""
    if model_file is not None:
        model = load_model(model_file, ModelSpec)
    else:
        try:
            model = catalog.model(model_name)
        except KeyError as exc:
            raise fail(str(exc.args[0]) + "; or pass --model-file") from exc
    db = ProfileDB(model=model.name, meta={"tool": "empty: analytic estimates only"})
    for p in profiles or []:
        part = load_model(p, ProfileDB)
        if part.model != model.name:
            raise fail(f"{p}: profiles of model={part.model!r}, the plan trains {model.name!r}")
        db = db.merged(part)
    net = load_model(network, NetworkProfile) if network else NetworkProfile()
    price = load_model(prices, PriceTable) if prices else catalog.prices()
    if prices is not None and not price.gpus:
        # An egress-only table (e.g. imported): keep the catalog's GPU prices beside it.
        price = PriceTable(
            gpus=catalog.prices().gpus,
            egress=price.egress,
            same_region_usd_per_gb=price.same_region_usd_per_gb,
            cross_region_usd_per_gb=price.cross_region_usd_per_gb,
            read_on=catalog.prices().read_on,
            source=f"{catalog.prices().source}; egress: {price.source}",
        )
    return model, db, net, price


def _print_interval(iv: EstimateInterval) -> None:
    con = Console()
    t = Table(
        "figure",
        "low",
        "median",
        "high",
        *(c.corner for c in iv.corners),
        title="over the uncertainty set (corners: docs/simulator-model.md, section 7c)",
    )
    g = 2**30
    for name, span, attr, scale in (
        ("iteration time (s)", iv.iteration_time_s, "iteration_time_s", 1.0),
        ("throughput (it/s)", iv.throughput_iter_s, "throughput_iter_s", 1.0),
        ("$ per iteration", iv.cost_per_iter_usd, "cost_per_iter_usd", 1.0),
        ("peak memory (GiB)", iv.peak_memory_bytes, "peak_memory_bytes", 1.0 / g),
    ):
        t.add_row(
            name,
            *(f"{v * scale:.4f}" for v in (span.low, span.median, span.high)),
            *(f"{getattr(c, attr) * scale:.4f}" for c in iv.corners),
        )
    t.add_row(
        "fits in memory",
        "",
        "",
        "yes" if iv.fits_in_memory else "NO",
        *("yes" if c.fits_in_memory else "NO" for c in iv.corners),
    )
    print_table(con, t)


def _print(est: Estimate, plan: Plan) -> None:
    con = Console()
    t = Table(
        title=f"plan {plan.plan_id or '-'}: {len(plan.pipelines)} pipelines, "
        f"{plan.num_gpus} GPUs ({est.model}, {plan.precision or 'precision derived'})"
    )
    t.add_column("figure")
    t.add_column("value", justify="right")
    b = est.time
    for name, v in (
        ("iteration time (s)", est.iteration_time_s),
        ("  compute on critical path", b.compute_s),
        ("  pipeline p2p", b.p2p_s),
        ("  bubble", b.bubble_s),
        ("  gradient sync", b.grad_sync_s),
        ("  optimizer update", b.update_s),
        ("throughput (it/s)", est.throughput_iter_s),
        ("throughput (samples/s)", est.throughput_samples_s),
        ("peak memory (GiB)", est.peak_memory_bytes / 2**30),
        ("$ per iteration", est.cost_per_iter_usd),
        ("  GPU time $", est.compute_cost_usd),
        ("  egress $", est.egress_cost_usd),
    ):
        t.add_row(name, f"{v:.4f}")
    t.add_row("fits in memory", "yes" if est.fits_in_memory else "NO")
    t.add_row("rests on estimated profiles or guessed links", "yes" if est.uses_estimates else "no")
    print_table(con, t)
    m = Table(
        "pipeline",
        "stage",
        "gpu",
        "weights",
        "grads",
        "optim",
        "activ.",
        "w. copies",
        "NCCL comms",
        "overhead",
        "total GiB",
        "capacity GiB",
        title="peak memory per GPU",
    )
    g = 2**30
    for r in est.memory:
        m.add_row(
            str(r.pipeline),
            str(r.stage),
            r.gpu_type,
            f"{r.weights / g:.2f}",
            f"{r.gradients / g:.2f}",
            f"{r.optimizer / g:.2f}",
            f"{r.activations / g:.2f}",
            f"{r.weight_copies / g:.2f}",
            f"{r.communicators / g:.2f} ({r.num_communicators})",
            f"{r.overhead / g:.2f}",
            f"{r.total / g:.2f}",
            f"{r.capacity / g:.1f}",
        )
    print_table(con, m)
    for n in est.notes:
        con.print(f"[dim]note: {n}[/dim]")


def _priced_as(plan: Plan, spot: bool) -> Plan:
    """``plan`` with every replica group's ``spot`` flag set to ``spot``."""
    return plan.model_copy(
        update={
            "pipelines": tuple(
                p.model_copy(
                    update={
                        "stages": tuple(
                            st.model_copy(
                                update={"replica": st.replica.model_copy(update={"spot": spot})}
                            )
                            for st in p.stages
                        )
                    }
                )
                for p in plan.pipelines
            )
        }
    )


def simulate_cmd(
    plan_file: Path = typer.Argument(..., help="Plan JSON/YAML (see `sailor schema plan`)."),
    profiles: list[Path] = typer.Option(None, "--profiles", help="ProfileDB file(s) to merge."),
    network: Path | None = typer.Option(None, help="NetworkProfile file."),
    prices: Path | None = typer.Option(None, help="PriceTable file (default: catalog)."),
    calibration: Path | None = typer.Option(
        None, help="Calibration file (default: the built-in one)."
    ),
    deployment: str | None = typer.Option(None, "--deployment", help=DEPLOYMENT_HELP),
    model_file: Path | None = typer.Option(None, help="ModelSpec file (default: catalog)."),
    method: str = typer.Option("closed_form", help="closed_form or replay."),
    spot: bool | None = typer.Option(
        None,
        "--spot/--on-demand",
        help="Price every GPU at spot (or on-demand) rates, whatever the plan's replica "
        "groups say; default: each group's own spot flag (the planner writes one), else "
        "on-demand.",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the Estimate as JSON."),
    timeline: Path | None = typer.Option(None, help="Write a Gantt chart of the schedule (PNG)."),
) -> None:
    """Simulate one plan: time and its breakdown, memory per GPU, $ per iteration."""
    if method not in ("closed_form", "replay"):
        raise fail(f"method={method!r}: use closed_form or replay")
    check_png_out(timeline, "--timeline")
    dep = load_deployment(deployment) if deployment is not None else None
    plan = load_model(plan_file, Plan)
    # an explicit flag overrides every group's own; without it each group's flag prices it
    # (on-demand where it has none: simulate's default)
    if spot is not None:
        plan = _priced_as(plan, spot)
    model, db, net, price = load_inputs(plan.model, model_file, profiles, network, prices)
    cal = load_model(calibration, Calibration) if calibration else catalog.calibration()
    cal, priced = priced_for(cal, dep)
    groups = [s.replica for pl in plan.pipelines for s in pl.stages]
    warn_unpriced(price, sorted({(g.gpu_type, g.zone) for g in groups}), "plan stage")
    try:
        if timeline is not None:
            from sailor.simulator.timeline_plot import plot_timeline

            est, tl = simulate_with_timeline(
                plan,
                model,
                db,
                net,
                price,
                calibration=cal,
                gpu_specs=catalog.gpus(),
            )
            plot_timeline(tl, timeline, title=f"{plan.plan_id or plan_file.name}")
        else:
            est = simulate(
                plan,
                model,
                db,
                net,
                price,
                calibration=cal,
                gpu_specs=catalog.gpus(),
                method="replay" if method == "replay" else "closed_form",
            )
        # "fits in memory" is judged at the high end of the uncertainty set
        _, iv = simulate_interval(
            plan,
            model,
            db,
            net,
            price,
            calibration=cal,
            gpu_specs=catalog.gpus(),
            method="replay" if method == "replay" else "closed_form",
        )
    except (ProfileLookupError, KeyError, ValueError) as exc:
        raise fail(f"{plan_file}: {exc}") from exc
    if as_json:
        out = est.model_dump(mode="json")
        out["peak_memory_bytes"] = est.peak_memory_bytes
        out["interval"] = iv.model_dump(mode="json")
        out["fits_in_memory_all_corners"] = iv.fits_in_memory
        out["deployment"] = priced
        write_json(out, None)
    else:
        _print(est, plan)
        _print_interval(iv)
        if timeline is not None:
            Console().print(f"timeline written to {timeline}")
