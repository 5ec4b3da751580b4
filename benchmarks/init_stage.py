"""Initialising one pipeline stage on the host: each TP rank drawing only its shard, a chunk at
a time (``init_rng``), against the previous release's draw of every whole parameter from a
seeded ``torch.Generator`` sliced to the shard, measured in the same run.

The stage: the embedding, ``blocks`` GPT blocks and the head of a model of ``hidden`` width and
``vocab`` tokens (untied), as TP rank 0 of ``t`` builds it, for each ``t`` of ``--tp``. Each
(variant, t) runs in a fresh process (peak memory is per process): the seconds of
``init_stage`` and the growth of the process's peak resident memory during it, over the
shard (made resident before): the draw's transient memory. One rank per process, so the
old per-node figure is ``t`` times the old per-rank one (every rank of a node drew every
whole matrix). Wall and CPU seconds (the process's own: steadier than wall time when
other jobs share the cores). On a GPU the new draw runs on the device and holds no host
memory; not measured here (no GPU). Never asserts a timing. To compare two versions of
``init_rng``, run this script with ``PYTHONPATH`` set to each checkout: the generator's
figures are the common baseline.
Run: ``.venv/bin/python benchmarks/init_stage.py`` (a few minutes on two cores).
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time
import zlib
from pathlib import Path

import torch

from sailor.comm.strict import DryGroup
from sailor.megatron_patch import model as model_mod
from sailor.megatron_patch.model import GPTStage, full_shape, shard
from sailor.megatron_patch.tp_layers import TPContext, tp_dim_of
from sailor.schemas.model import ModelSpec


def _spec(hidden: int, vocab: int, blocks: int) -> ModelSpec:
    return ModelSpec(
        name="bench",
        num_layers=blocks,
        hidden_size=hidden,
        num_heads=16,
        ffn_hidden_size=4 * hidden,
        vocab_size=vocab,
        seq_length=128,
        global_batch_size=8,
        tie_embeddings=False,
    )


@torch.no_grad()
def _old_init(stage: GPTStage, seed: int) -> None:
    """The previous release: the whole parameter from a generator, then this rank's slice."""
    spec, tp = stage.spec, stage.tp
    for name, p in stage.keyed_parameters():
        shape = full_shape(p, tp.size)
        _, pname = name.split(".", 1)
        leaf = pname.rsplit(".", 1)[-1]
        if leaf == "bias":
            full = torch.zeros(shape)
        elif pname.startswith(("ln", "norm")):
            full = torch.ones(shape)
        else:
            crc = zlib.crc32(name.encode())
            g = torch.Generator().manual_seed((seed * 1_000_003 + crc) % 2**63)
            std = 0.02
            if pname.startswith(("attn_out", "mlp_out")):
                std = 0.02 / (2 * spec.num_layers) ** 0.5
            full = torch.randn(shape, generator=g) * std
            if pname in ("wte.weight", "lm_head.weight"):
                full[spec.vocab_size :] = 0.0
        p.copy_(shard(full, tp_dim_of(p), tp.size, tp.rank))


def _rss_kb() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4


def _child(variant: str, tp: int, a: argparse.Namespace) -> None:
    torch.set_num_threads(a.threads)
    spec = _spec(a.hidden, a.vocab, a.blocks)
    ctx = TPContext(tp, 0, DryGroup(tuple(range(tp))) if tp > 1 else None)
    stage = GPTStage(spec, 0, spec.num_all_layers - 1, tp=ctx, init=False)
    with torch.no_grad():  # the shard resident first: what grows is the draw's own memory
        for p in stage.parameters():
            p.fill_(0.0)
    before = _rss_kb()
    t0, c0 = time.perf_counter(), time.process_time()
    if variant == "old":
        _old_init(stage, 0)
    else:
        model_mod.init_stage(stage, 0)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KB on Linux
    shard_mb = sum(p.numel() * 4 for p in stage.parameters()) / 2**20
    out = {"s": seconds, "cpu_s": cpu, "peak_mb": (peak - before) / 1024, "shard_mb": shard_mb}
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2, 8])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--child", nargs=2, metavar=("VARIANT", "TP"))
    a = ap.parse_args()
    if a.child:
        _child(a.child[0], int(a.child[1]), a)
        return
    spec = _spec(a.hidden, a.vocab, a.blocks)
    print(
        f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
        f"{a.threads} thread(s); stage of embedding + {a.blocks} blocks + head, hidden "
        f"{a.hidden}, vocab {a.vocab} (untied), "
        f"{sum(spec.layer_params(i) for i in range(spec.num_all_layers)) / 1e6:.0f}M params; "
        "TP rank 0, one fresh process per figure"
    )
    base = [sys.executable, __file__, "--hidden", str(a.hidden), "--vocab", str(a.vocab)]
    base += ["--blocks", str(a.blocks), "--threads", str(a.threads)]
    for tp in a.tp:
        got = {}
        for variant in ("old", "new"):
            out = subprocess.run(
                [*base, "--child", variant, str(tp)], capture_output=True, text=True, check=True
            )
            got[variant] = json.loads(out.stdout.strip().splitlines()[-1])
        o, n = got["old"], got["new"]
        print(
            f"TP {tp}: shard {n['shard_mb']:.0f} MB; whole-then-slice {o['s']:.2f} s "
            f"({o['cpu_s']:.2f} s CPU), peak +{o['peak_mb']:.0f} MB (x{tp} ranks per node: "
            f"{o['peak_mb'] * tp:.0f} MB); shard-only {n['s']:.2f} s ({n['cpu_s']:.2f} s CPU), "
            f"peak +{n['peak_mb']:.0f} MB; time old/new {o['s'] / n['s']:.2f}x (CPU "
            f"{o['cpu_s'] / n['cpu_s']:.2f}x), peak old/new {o['peak_mb'] / n['peak_mb']:.2f}x"
        )


if __name__ == "__main__":
    main()
