"""``sailor demo``: the main job on a bundled example, with nothing but this package.

1. Plan: co-optimize GPUs and parallelization for OPT-350 on a bundled heterogeneous,
   two-region pool of spot VMs (catalog specs, list prices, analytic estimates — marked as
   such), against the practitioner's homogeneous grid search; simulate the best plan with the
   event-driven 1F1B replay and draw its schedule.
2. Train: run a heterogeneous plan for real — two pipelines of different depth, layer split,
   TP degree and microbatch size, as CPU processes over torch.distributed (gloo) — and
   compare every step's loss with single-process training on the same global batches.
"""

from __future__ import annotations

import json
import time
from importlib import resources
from pathlib import Path
from typing import Any

import typer
import yaml
from rich.console import Console
from rich.table import Table

from sailor import catalog
from sailor.schemas import NetworkProfile, Pipeline, Plan, Pool, ProfileDB, ReplicaGroup, Stage

__all__ = ["demo"]


def _pool() -> Pool:
    text = resources.files("sailor.catalog").joinpath("examples/pool-hetero.yaml").read_text()
    return Pool.model_validate(yaml.safe_load(text))


def _plan_part(con: Console, out: Path) -> dict[str, Any]:
    from sailor.planner import Constraints, plan, throughput_upper_bound
    from sailor.planner.baselines import megatron_grid
    from sailor.simulator import simulate_with_timeline
    from sailor.simulator.timeline_plot import plot_timeline

    model = catalog.model("OPT-350")
    pool = _pool()
    db = ProfileDB(model=model.name)
    net = NetworkProfile()
    prices = catalog.prices()
    cal = catalog.calibration()
    specs = catalog.gpus()
    con.rule("[bold]1. Plan OPT-350 on a heterogeneous two-region spot pool")
    for e in pool.entries:
        con.print(f"  {e.nodes} x {e.gpus_per_node} {e.gpu_type} in {e.zone}")
    t0 = time.perf_counter()
    ranked = plan(
        model,
        db,
        pool,
        net,
        prices,
        "throughput",
        Constraints(),
        calibration=cal,
        gpu_specs=specs,
        spot=True,
        top_k=3,
    )
    search_s = time.perf_counter() - t0
    bound = throughput_upper_bound(model, db, pool, calibration=cal, gpu_specs=specs)
    base = megatron_grid(
        model,
        db,
        pool,
        net,
        prices,
        "throughput",
        Constraints(),
        calibration=cal,
        gpu_specs=specs,
        spot=True,
        top_k=1,
    )
    t = Table("#", "it/s", "$/iter", "% of bound", "pipelines", "GPUs", "stages x layers (gpu, tp)")
    for i, r in enumerate(ranked):
        p = r.plan
        desc = "; ".join(
            " | ".join(f"{s.num_layers}L {s.replica.gpu_type} tp{s.replica.tp}" for s in q.stages)
            for q in p.pipelines[:2]
        ) + (" ..." if len(p.pipelines) > 2 else "")
        t.add_row(
            str(i + 1),
            f"{r.estimate.throughput_iter_s:.3f}",
            f"{r.estimate.cost_per_iter_usd:.3f}",
            f"{100 * r.estimate.throughput_iter_s / bound:.0f}",
            str(len(p.pipelines)),
            str(p.num_gpus),
            desc,
        )
    con.print(t)
    best = ranked[0]
    ratio = best.estimate.throughput_iter_s / base[0].estimate.throughput_iter_s if base else 0.0
    con.print(
        f"  search: {search_s:.2f} s wall; upper bound {bound:.3f} it/s; "
        f"homogeneous grid search best: "
        f"{base[0].estimate.throughput_iter_s:.3f} it/s -> Sailor x{ratio:.2f}"
        if base
        else f"  search: {search_s:.2f} s"
    )
    con.print(
        "  [dim]profiles: analytic roofline estimates (no measured profile shipped); "
        "measure with `sailor profile layers`[/dim]"
    )
    est, tl = simulate_with_timeline(
        best.plan, model, db, net, prices, calibration=cal, gpu_specs=specs, spot=True
    )
    png = plot_timeline(tl, out / "demo-timeline.png", title="best plan, first pipelines")
    con.print(
        f"  replay of the best plan: {est.iteration_time_s:.3f} s/iteration, peak "
        f"{est.peak_memory_bytes / 2**30:.1f} GiB; schedule drawn to {png}"
    )
    (out / "demo-plan.json").write_text(best.plan.model_dump_json(indent=2))
    return {
        "search_time_s": search_s,
        "best_throughput_iter_s": best.estimate.throughput_iter_s,
        "best_cost_per_iter_usd": best.estimate.cost_per_iter_usd,
        "upper_bound_iter_s": bound,
        "homogeneous_grid_iter_s": base[0].estimate.throughput_iter_s if base else None,
        "plan_file": str(out / "demo-plan.json"),
    }


def _cpu(tp: int = 1) -> ReplicaGroup:
    return ReplicaGroup(gpu_type="cpu", zone="local-a", tp=tp, gpus_per_node=max(tp, 1))


def _train_part(con: Console, out: Path, steps: int) -> dict[str, Any]:
    from sailor.megatron_patch.engine import TrainConfig
    from sailor.megatron_patch.launch import launch_local
    from sailor.megatron_patch.model import tiny_model
    from sailor.megatron_patch.reference import train_reference

    con.rule("[bold]2. Train a heterogeneous plan for real (tiny GPT, CPU, gloo)")
    plan = Plan(
        plan_id="demo-hetero",
        model="tiny-gpt",
        global_batch_size=8,
        pipelines=(
            Pipeline(
                stages=(
                    Stage(first_layer=0, last_layer=1, replica=_cpu()),
                    Stage(first_layer=2, last_layer=5, replica=_cpu(2)),
                ),
                microbatch_size=1,
                num_microbatches=4,
            ),
            Pipeline(
                stages=(Stage(first_layer=0, last_layer=5, replica=_cpu()),),
                microbatch_size=2,
                num_microbatches=2,
            ),
        ),
    )
    con.print("  pipeline 0: layers 0-1 | layers 2-5 at TP=2, 4 microbatches of 1")
    con.print("  pipeline 1: layers 0-5 on one rank, 2 microbatches of 2  (4 ranks in all)")
    t0 = time.perf_counter()
    run = launch_local(plan, steps, out / "train", deadline_s=300)
    wall = time.perf_counter() - t0
    if not run.ok:
        causes = [e for e in run.errors if e]
        raise RuntimeError(f"training failed: {causes[:1] or run.stderr[:1]}")
    spec = tiny_model(plan.model, plan.global_batch_size)
    ref = train_reference(spec, plan.global_batch_size, steps, TrainConfig())
    t = Table("step", "loss (4 ranks, heterogeneous)", "loss (1 process)", "|diff|")
    worst = 0.0
    losses = [float(s["loss"]) for s in run.steps(rank=0) if s.get("loss") is not None]
    if not losses:
        last = len(plan.ranks()) - 1
        losses = [float(s["loss"]) for s in run.steps(rank=last) if s.get("loss") is not None]
    for i, (a, b) in enumerate(zip(losses, ref.losses, strict=False)):
        worst = max(worst, abs(a - b))
        t.add_row(str(i + 1), f"{a:.6f}", f"{b:.6f}", f"{abs(a - b):.1e}")
    con.print(t)
    con.print(
        f"  {steps} steps in {wall:.1f} s wall (process start included); largest loss "
        f"difference {worst:.1e}"
    )
    return {
        "steps": steps,
        "losses": losses,
        "reference_losses": ref.losses,
        "max_abs_loss_diff": worst,
        "wall_s": wall,
    }


def demo(
    out: Path = typer.Option(Path("out"), help="Where plots and plans go."),
    steps: int = typer.Option(5, help="Training steps of part 2."),
    train: bool = typer.Option(True, help="Run part 2 (real training)."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON summary only."),
) -> None:
    """Plan and simulate a heterogeneous cluster, then train a heterogeneous plan for real."""
    con = Console(quiet=as_json)
    out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"plan": _plan_part(con, out)}
    if train:
        summary["train"] = _train_part(con, out, steps)
    if as_json:
        typer.echo(json.dumps(summary, indent=2))
