"""``sailor catalog``: the built-in GPU types, models and prices."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.table import Table

from sailor import catalog
from sailor.cli.tables import print_table

__all__ = ["catalog_app"]

catalog_app = typer.Typer(help="Show the built-in catalog.", no_args_is_help=True)


@catalog_app.command("gpus")
def gpus() -> None:
    """GPU types with their spec-sheet figures."""
    t = Table("name", "memory GiB", "fp16 TF", "bf16 TF", "HBM GB/s", "link", "GPUs/node")
    for g in catalog.gpus().values():
        t.add_row(
            g.name,
            f"{g.memory_bytes / 2**30:.0f}",
            f"{g.peak_tflops_fp16:g}",
            f"{g.peak_tflops_bf16:g}",
            f"{g.memory_bandwidth_gbps:g}",
            g.intra_node_link,
            str(g.default_gpus_per_node),
        )
    print_table(Console(), t)


@catalog_app.command("models")
def models() -> None:
    """Model architectures."""
    t = Table("name", "layers", "hidden", "heads", "ffn", "seq", "vocab", "params (B)", "GBS")
    for m in catalog.models().values():
        t.add_row(
            m.name,
            str(m.num_layers),
            str(m.hidden_size),
            str(m.num_heads),
            str(m.ffn_hidden_size),
            str(m.seq_length),
            str(m.vocab_size),
            f"{m.total_params / 1e9:.2f}",
            str(m.global_batch_size),
        )
    print_table(Console(), t)


@catalog_app.command("prices")
def prices() -> None:
    """GPU-hour list prices."""
    p = catalog.prices()
    t = Table("gpu", "region", "on-demand $/h", "spot $/h", title=f"read on {p.read_on}")
    for g in p.gpus:
        t.add_row(
            g.gpu_type, g.region, f"{g.on_demand_usd_per_hour:.2f}", f"{g.spot_usd_per_hour:.2f}"
        )
    print_table(Console(), t)
