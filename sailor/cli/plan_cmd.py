"""``sailor plan``: ranked plans for a pool, a model and an objective, under constraints."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from sailor import catalog
from sailor.cli._io import (
    DEPLOYMENT_HELP,
    check_out,
    check_png_out,
    fail,
    load_deployment,
    load_model,
    load_raw,
    priced_for,
    warn_unpriced,
    write_json,
)
from sailor.cli.tables import print_table
from sailor.importers.sailor_format import export_plan
from sailor.planner import (
    Constraints,
    PlannerInputError,
    RankedPlan,
    SearchResult,
)
from sailor.planner.robust import RISKS, RobustPlan, RobustResult, as_ranked, robust_search
from sailor.schemas import (
    Calibration,
    ModelSpec,
    NetworkProfile,
    Pool,
    PriceTable,
    ProfileDB,
)
from sailor.schemas.model import MAX_GLOBAL_BATCH
from sailor.simulator.network_model import guessed_link

__all__ = ["plan_cmd"]

_OBJECTIVES = {"throughput", "cost", "throughput_per_cost"}


def _model(name: str, gbs: int | None) -> ModelSpec:
    path = Path(name)
    if path.suffix in (".json", ".yaml", ".yml") and name not in catalog.models():
        model = load_model(path, ModelSpec)  # a missing or unreadable file is named
    else:
        try:
            model = catalog.model(name)
        except KeyError as exc:
            raise fail(str(exc.args[0]) + "; or pass a ModelSpec file") from exc
    if gbs is not None:
        model = model.model_copy(update={"global_batch_size": gbs})
    return model


def _profiles(model: ModelSpec, files: list[Path] | None) -> ProfileDB:
    db = ProfileDB(model=model.name, meta={"tool": "empty: analytic estimates only"})
    for p in files or []:
        part = load_model(p, ProfileDB)
        if part.model != model.name:
            raise fail(f"{p}: profiles of model={part.model!r}, planning {model.name!r}")
        db = db.merged(part)
    return db


def _prices(path: Path | None) -> PriceTable:
    if path is None:
        return catalog.prices()
    price = load_model(path, PriceTable)
    if not price.gpus:  # an egress-only table: keep the catalog's GPU prices beside it
        base = catalog.prices()
        price = price.model_copy(update={"gpus": base.gpus})
    return price


def _calibration(path: Path | None) -> Calibration:
    if path is not None:
        return load_model(path, Calibration)
    builtin = getattr(catalog, "calibration", None)
    return builtin() if callable(builtin) else Calibration()


def _max_gpus(items: list[str] | None) -> tuple[tuple[str, int], ...]:
    out: list[tuple[str, int]] = []
    for it in items or []:
        g, sep, n = it.partition("=")
        if not sep or not n.strip().isdigit():
            raise fail(f"--max-gpus {it!r}: expected TYPE=N, e.g. A100-40=64")
        if any(g.strip() == seen for seen, _ in out):
            raise fail(f"--max-gpus {it!r}: {g.strip()} is capped twice: give one cap per type")
        out.append((g.strip(), int(n)))
    return tuple(out)


def _csv(v: str | None) -> tuple[str, ...] | None:
    return tuple(x.strip() for x in v.split(",") if x.strip()) if v else None


def _stage_summary(r: RankedPlan) -> list[tuple[str, str, str, str, str, str]]:
    """Pipelines grouped by shape: (count, stages/layers, types/TP, zones, mbs x m)."""
    groups: dict[tuple[Any, ...], list[int]] = {}
    for p in r.plan.pipelines:
        key = (
            p.microbatch_size,
            tuple(
                (s.first_layer, s.last_layer, s.replica.gpu_type, s.replica.tp, s.replica.zone)
                for s in p.stages
            ),
        )
        groups.setdefault(key, []).append(p.num_microbatches)
    rows = []
    for (mbs, stages), ms in groups.items():
        layers = " | ".join(f"{a}-{b}" for a, b, *_ in stages)
        kinds = " | ".join(f"{g}x{tp}" for _, _, g, tp, _ in stages)
        zones = ",".join(sorted({z for *_, z in stages}))
        m = f"{min(ms)}" if min(ms) == max(ms) else f"{min(ms)}-{max(ms)}"
        rows.append((f"{len(ms)}", f"{len(stages)}: {layers}", kinds, zones, f"{mbs} x {m}", ""))
    return rows


def _interval_lines(rp: RobustPlan) -> list[str]:
    """A plan's figures in every corner and its regret against each corner's best."""
    iv = rp.interval
    t = iv.throughput_iter_s
    c = iv.cost_per_iter_usd
    m = iv.peak_memory_bytes
    return [
        f"  interval over the uncertainty set: {t.low:.4f} / {t.median:.4f} / {t.high:.4f} it/s "
        f"(low / median / high), ${c.low:.4f} / {c.median:.4f} / {c.high:.4f} per iteration, "
        f"peak {m.low / 2**30:.1f} / {m.median / 2**30:.1f} / {m.high / 2**30:.1f} GiB",
        "  per corner: "
        + "; ".join(
            f"{f.corner} {f.throughput_iter_s:.4f} it/s ${f.cost_per_iter_usd:.4f} "
            f"regret {rp.regret[f.corner]:.0%}{'' if f.fits_in_memory else ' OOM'}"
            for f in iv.corners
        ),
        f"  worst ratio to each corner's best plan: {rp.worst_ratio:.2f}",
    ]


def _print(
    res: SearchResult,
    elapsed: float,
    explain: bool,
    robust: dict[int, RobustPlan] | None = None,
) -> None:
    con = Console()
    for r in res.plans:
        e = r.estimate
        t = Table(
            title=(
                f"#{r.rank}: {e.throughput_iter_s:.4f} it/s, ${e.cost_per_iter_usd:.4f}/iter, "
                f"${r.cost_per_hour_usd:.2f}/h, {sum(e.gpus_by_type_zone.values())} GPUs, "
                f"peak {e.peak_memory_bytes / 2**30:.1f} GiB, "
                f"{r.upper_bound_fraction:.0%} of bound"
            )
        )
        for col in (
            "pipelines",
            "stages: layers",
            "GPU x TP per stage",
            "zones",
            "mbs x microbatches",
        ):
            t.add_column(col)
        for row in _stage_summary(r):
            t.add_row(*row[:5])
        print_table(con, t)
        if robust and r.rank in robust:
            for line in _interval_lines(robust[r.rank]):
                con.print(line)
        guessed = [n for n in e.notes if guessed_link(n)]
        for n in guessed:
            con.print(
                f"  [yellow]rests on a guessed link[/yellow]: {n}; measure it with "
                "`sailor profile network`"
            )
        profiled = not guessed or any("estimate" in n for n in e.notes)
        if e.uses_estimates and profiled:
            con.print(
                "  [yellow]rests on estimated profiles[/yellow] for "
                + ", ".join(sorted({k.split("@")[0] for k in e.gpus_by_type_zone}))
                + ": measure them with `sailor profile layers` or import measurements"
            )
        if r.moved_layer_replicas:
            con.print(
                f"  moves {r.moved_layer_replicas} layer replicas (layers {list(r.moved_layers)})"
            )
        if explain:
            for line in r.explain:
                con.print(f"  [dim]{line}[/dim]")
    s = res.stats
    con.print(
        f"search: {elapsed:.3f} s wall (all precomputation included); {s.templates} templates, "
        f"{s.allocations} allocations, {s.simulated} simulated; pruned {s.pruned_memory} stage "
        f"cells by memory, {s.pruned_bound} scenarios by bound; upper bound "
        f"{res.upper_bound_iter_s:.4f} it/s"
    )


def _pareto(res: SearchResult, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    sim = [
        (c.estimate.cost_per_iter_usd, c.estimate.throughput_iter_s)
        for c in res.candidates
        if c.estimate is not None and not c.violations
    ]
    fast = [
        (c.fast.cost_per_iter, 1.0 / c.fast.iteration_s)
        for c in res.candidates
        if c.estimate is None
    ]
    best = [(r.cost_per_iter_usd, r.throughput_iter_s) for r in res.plans]
    for pts, size, color, label in (
        (fast, 10, "0.7", "kept (search estimate)"),
        (sim, 18, "C0", "simulated, feasible"),
        (best, 40, "C3", "returned"),
    ):
        if pts:
            ax.scatter([x for x, _ in pts], [y for _, y in pts], s=size, c=color, label=label)
    ax.set_xlabel("$ per iteration")
    ax.set_ylabel("iterations / s")
    ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def plan_cmd(
    model: str = typer.Option(..., "--model", help="Catalog model name or a ModelSpec file."),
    pool: Path = typer.Option(..., "--pool", help="Pool file (YAML/JSON, `sailor schema pool`)."),
    profiles: list[Path] = typer.Option(None, "--profiles", help="ProfileDB file(s) to merge."),
    network: Path | None = typer.Option(None, help="NetworkProfile file."),
    prices: Path | None = typer.Option(None, help="PriceTable file (default: catalog)."),
    calibration: Path | None = typer.Option(None, help="Calibration file (default: catalog)."),
    deployment: str | None = typer.Option(None, "--deployment", help=DEPLOYMENT_HELP),
    objective: str = typer.Option("throughput", help="throughput | cost | throughput_per_cost"),
    max_cost_per_iter: float | None = typer.Option(None, help="Max $ per iteration."),
    max_cost_per_hour: float | None = typer.Option(None, help="Max $ per hour."),
    min_throughput: float | None = typer.Option(None, help="Min iterations per second."),
    max_gpus: list[str] = typer.Option(None, "--max-gpus", help="TYPE=N, repeatable."),
    zones: str | None = typer.Option(None, help="Allowed zones, comma-separated."),
    regions: str | None = typer.Option(None, help="Allowed regions, comma-separated."),
    gbs: int | None = typer.Option(
        None, min=1, max=MAX_GLOBAL_BATCH, help="Global batch size (default: the model's)."
    ),
    spot: bool | None = typer.Option(
        None,
        "--spot/--on-demand",
        help="Price every GPU at spot (or on-demand) rates; default: each pool entry's flag.",
    ),
    one_mbs: bool = typer.Option(
        False, "--one-mbs", help="One microbatch size for every pipeline (exportable)."
    ),
    top: int = typer.Option(3, "--top", min=1, help="Plans to show."),
    risk: str = typer.Option(
        "robust",
        "--risk",
        help=(
            "What the plan bets on: optimistic | median (rank in that corner of the "
            "uncertainty set) | robust (fits and meets every limit in every corner; ranked "
            "by the worst ratio to each corner's best plan)."
        ),
    ),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
    explain: bool = typer.Option(False, "--explain", help="Why each plan: shapes and breakdown."),
    pareto: Path | None = typer.Option(None, help="Plot throughput vs $/iteration to this PNG."),
    export_sailor: Path | None = typer.Option(
        None, help="Write the best plan in the original artifact's plan-config format."
    ),
    output: Path | None = typer.Option(
        None,
        "-o",
        "--output",
        help="Write the best plan as a Plan file (`sailor schema plan`) for `sailor simulate`.",
    ),
) -> None:
    """Search plans: which GPUs to use and how to parallelize the model on them."""
    t0 = time.perf_counter()
    if objective not in _OBJECTIVES:
        raise fail(f"--objective {objective!r}: use one of {', '.join(sorted(_OBJECTIVES))}")
    if risk not in RISKS:
        raise fail(f"--risk {risk!r}: use one of {', '.join(RISKS)}")
    dep = load_deployment(deployment) if deployment is not None else None
    m, pool_v, db, net, price, cal = _inputs(
        model, gbs, pool, profiles, network, prices, calibration
    )
    cal, priced = priced_for(cal, dep)
    warn_unpriced(price, [(e.gpu_type, e.zone) for e in pool_v.entries], "pool entry")
    caps = _max_gpus(max_gpus)
    check_png_out(pareto, "--pareto")
    check_out(output, "-o")
    check_out(export_sailor, "--export-sailor")
    in_pool = sorted({e.gpu_type for e in pool_v.entries})
    for g, _ in caps:
        if g not in in_pool:
            raise fail(
                f"--max-gpus {g}: no GPU type {g!r} in the pool ({', '.join(in_pool)}): "
                "a cap on it would cap nothing"
            )
    try:
        cons = Constraints(
            max_cost_per_iter_usd=max_cost_per_iter,
            max_cost_per_hour_usd=max_cost_per_hour,
            min_throughput_iter_s=min_throughput,
            max_gpus_per_type=caps,
            allowed_zones=_csv(zones),
            allowed_regions=_csv(regions),
            one_microbatch_size=one_mbs,
        )
    except PlannerInputError as exc:
        raise fail(str(exc)) from exc
    show = not as_json

    def search(progress: Callable[[int, int], None]) -> RobustResult:
        return robust_search(
            m,
            db,
            pool_v,
            net,
            price,
            objective,  # type: ignore[arg-type]
            cons,
            gpu_specs=catalog.gpus(),
            calibration=cal,
            spot=spot,
            top_k=top,
            risk=risk,
            progress=progress,
        )

    rres = _search_with_bar(search, show)
    res = _as_search_result(rres)
    elapsed = time.perf_counter() - t0
    if pareto is not None:
        _pareto(res, pareto)
    if as_json:
        typer.echo(_json_answer(m.name, objective, risk, elapsed, res, rres, priced))
    else:
        _print(res, elapsed, explain, {p.rank: p for p in rres.plans})
        Console().print(
            f"risk {risk}: searched the {', '.join(rres.searched)} corner(s); "
            f"{rres.candidates} distinct plans judged in every corner; priced for deployment "
            f"{dep.name if dep else 'of the calibration'} (p2p across TP {cal.p2p_across_tp}, "
            f"{cal.mixed_precision})"
        )
    if output is not None and res.plans:
        write_json(res.plans[0].plan, output)
        if show:
            Console(stderr=True).print(f"plan #1 written to {output}")
    if export_sailor is not None and res.plans:
        _export(res, export_sailor)
    if not res.plans:
        raise fail(f"no feasible plan: {res.reason}", code=1)


def _inputs(
    model: str,
    gbs: int | None,
    pool: Path,
    profiles: list[Path] | None,
    network: Path | None,
    prices: Path | None,
    calibration: Path | None,
) -> tuple[ModelSpec, Pool, ProfileDB, NetworkProfile, PriceTable, Calibration]:
    """The search's inputs from the command's files (catalog defaults where none is given)."""
    m = _model(model, gbs)
    pool_v = load_model(pool, Pool) if pool.exists() else None
    if pool_v is None:
        load_raw(pool)  # names the unreadable file
        raise fail(f"{pool}: cannot read")
    db = _profiles(m, profiles)
    net = load_model(network, NetworkProfile) if network else NetworkProfile()
    return m, pool_v, db, net, _prices(prices), _calibration(calibration)


def _search_with_bar(
    search: Callable[[Callable[[int, int], None]], RobustResult], show: bool
) -> RobustResult:
    """``search(progress)`` under a transient progress bar on stderr (none if not
    ``show``); the planner's input errors as one-line CLI errors."""
    err = Console(stderr=True)
    try:
        with Progress(
            TextColumn("searching"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TimeElapsedColumn(),
            transient=True,
            # off the terminal (a log, a pipe) the transient bar left an empty line there
            disable=not show or not err.is_terminal,
            console=err,
        ) as bar:
            task = bar.add_task("search", total=1)

            def tick(done: int, total: int) -> None:
                bar.update(task, completed=done, total=total)

            return search(tick)
    except PlannerInputError as exc:
        raise fail(str(exc)) from exc


def _json_answer(
    model: str,
    objective: str,
    risk: str,
    elapsed: float,
    res: SearchResult,
    rres: RobustResult,
    deployment: dict[str, Any],
) -> str:
    """``sailor plan --json``: the search's figures and every returned plan with its
    figures in every corner."""
    return json.dumps(
        {
            "model": model,
            "objective": objective,
            "search_time_s": elapsed,
            "upper_bound_iter_s": res.upper_bound_iter_s,
            "reason": res.reason,
            "risk": risk,
            "deployment": deployment,
            "plans": [
                {**r.to_json(), **rp.to_json()} for r, rp in zip(res.plans, rres.plans, strict=True)
            ],
        },
        indent=2,
    )


def _as_search_result(rres: RobustResult) -> SearchResult:
    """The median (else the first) corner's search result, carrying the ranked robust
    plans with their median-corner figures (what the printing and export read)."""
    base = rres.results.get("median") or next(iter(rres.results.values()))
    ub = base.upper_bound_iter_s
    return dataclasses.replace(
        base,
        plans=tuple(as_ranked(p, ub) for p in rres.plans),
        reason=rres.reason,
        allocations=(),
    )


def _export(res: SearchResult, out: Path) -> None:
    """The best plan the original's format can express (it has one microbatch size)."""
    for r in res.plans:
        try:
            data = export_plan(r.plan)
        except ValueError:
            continue
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(data, indent=2) + "\n")
        if r.rank != 1:
            typer.echo(
                f"note: plan #1 mixes microbatch sizes, which the original's format cannot "
                f"express; wrote plan #{r.rank} to {out}",
                err=True,
            )
        return
    raise fail(
        "--export-sailor: every returned plan mixes microbatch sizes per pipeline, which the "
        "original's plan-config format cannot express; rerun with --one-mbs"
    )
