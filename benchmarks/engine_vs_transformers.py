"""Training samples/s of Sailor's engine against plain ``transformers`` training, same run.

One small GPT-2 (``transformers.GPT2Config`` built here, nothing downloaded), fp32 on CPU,
gloo, one torch thread per rank, so "2 ranks" means 2 cores in every variant:

- ``engine 1 rank``: the engine (``sailor.megatron_patch``, real worker processes through
  ``launch_local``) on a one-stage plan, the whole global batch as one microbatch;
- ``engine 2 ranks DP``: two one-stage pipelines, half the batch each (one microbatch);
- ``engine 2 ranks PP``: one pipeline of 2 stages (embedding + 2 blocks | 2 blocks + head),
  4 microbatches of 2 under the engine's 1F1B;
- ``transformers 1 rank``: ``GPT2LMHeadModel`` + ``torch.optim.AdamW``, a plain loop;
- ``transformers 2 ranks DDP``: the same loop under ``DistributedDataParallel`` (gloo, 2
  processes), half the batch each.

All start from the same weights (the engine loads the ``save_pretrained`` directory through
its training config's ``kind: huggingface, load_weights: true``), read the same samples of
``SyntheticTokens(vocab, seq, seed=0)`` and use AdamW with the same settings, so they train
the same model: the first-step losses must agree to ~1e-5 (printed, with the largest
difference over all steps).

Timing: a step is zero-grad, data, forwards, backwards, gradient sync, AdamW and reading the
loss (the engine's ``step_s``, which also holds its loss all-reduce; the transformers loop
timed around the same work with ``perf_counter``). The first ``--warmup`` steps are dropped;
per step the slowest rank counts; a variant's samples/s in a run is ``global batch / median
step``. Variants are interleaved over ``--rounds`` rounds, each engine variant next to the
transformers run it is compared with and the order reversed every other round; the table
gives the median over rounds and the median of the per-round ratios engine/transformers
(each from two neighbouring runs, which cancels slow drift of the machine's load), beside
two estimators less disturbed by other jobs: samples/s of the fastest step, and CPU ms per
sample (the CPU time of every rank's process in the step: engine ranks run through
``cpu_timed_rank``, which wraps ``Trainer.train_step``). Last, an in-process probe times
forward + backward of the two model implementations alone, alternating. Never asserts a
timing.

Run: ``PYTHONPATH=. .venv/bin/python benchmarks/engine_vs_transformers.py [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

from sailor.localnet import free_port
from sailor.megatron_patch.data import SyntheticTokens
from sailor.megatron_patch.launch import launch_local
from sailor.schemas.plan import Pipeline, Plan, ReplicaGroup, Stage

# Model and batch. 4 blocks of hidden 128 (ffn 512, 4 heads), vocab 512, seq 128: 0.88 M
# parameters. Global batch 8 x 128 tokens: a 1-rank step of either implementation took
# ~150 ms on one core of this 2-core machine when it was quiet and 200-450 ms while other
# jobs ran (2 ranks: ~half the work each). Long enough that per-step Python and collective
# overheads (~1-10 ms) show against real compute rather than timer noise, short enough that
# 12 steps x 5 variants x 3 rounds, with ~5-8 s of process start per run, stay under ~4 min.
LAYERS, HIDDEN, HEADS, VOCAB, SEQ = 4, 128, 4, 512, 128
GBS = 8
LR, BETAS, EPS, WD = 1e-3, (0.9, 0.95), 1e-8, 0.01  # the engine's defaults
SEED = 0

ENGINE_1, ENGINE_DP, ENGINE_PP = "engine 1 rank", "engine 2 ranks DP", "engine 2 ranks PP"
HF_1, HF_DDP = "transformers 1 rank", "transformers 2 ranks DDP"
VARIANTS = (ENGINE_1, HF_1, ENGINE_DP, HF_DDP, ENGINE_PP)
"""Run order of even rounds (odd rounds: reversed): each engine variant next to the
transformers run it is compared with, which goes first alternating between rounds."""


@dataclass
class Measured:
    """One variant in one round."""

    step_s: list[float]
    """Per measured step, the slowest rank's step time."""
    losses: list[float]
    """Global-batch loss per step (warm-up included)."""
    parts: dict[str, float]
    """Median share of the step per phase (engine: compute/sync/optim/rest)."""
    outside: float
    """Median share of the wall time between two step ends spent outside the timed step."""
    cpu_s: list[float]
    """Per measured step, the CPU seconds of all ranks together (every thread)."""

    @property
    def samples_per_s(self) -> float:
        return GBS / statistics.median(self.step_s)

    @property
    def best_samples_per_s(self) -> float:
        """From the fastest measured step: on a shared machine, the least disturbed one."""
        return GBS / min(self.step_s)

    @property
    def cpu_ms_per_sample(self) -> float:
        return 1000 * statistics.median(self.cpu_s) / GBS


# ---------------------------------------------------------------------------- model, plans


def _gpt2_config(activation: str) -> Any:
    import transformers

    return transformers.GPT2Config(
        activation_function=activation,
        vocab_size=VOCAB,
        n_positions=SEQ,
        n_embd=HIDDEN,
        n_layer=LAYERS,
        n_head=HEADS,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=1,
    )


def _save_model(hf_dir: Path, activation: str = "gelu_new") -> int:
    """Save a randomly initialised GPT-2 (seed 0); returns its parameter count."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(SEED)
    model = transformers.GPT2LMHeadModel(_gpt2_config(activation)).float()
    model.save_pretrained(str(hf_dir))
    return sum(p.numel() for p in model.parameters())


def _stage(a: int, b: int) -> Stage:
    rg = ReplicaGroup(gpu_type="cpu", zone="local", tp=1, gpus_per_node=1)
    return Stage(first_layer=a, last_layer=b, replica=rg)


def _plans() -> dict[str, Plan]:
    last = LAYERS + 1  # embedding = layer 0, blocks 1..LAYERS, head = LAYERS + 1

    def plan(*pipes: Pipeline) -> Plan:
        return Plan(model="bench-gpt2", global_batch_size=GBS, pipelines=pipes)

    whole = (_stage(0, last),)
    half = GBS // 2
    return {
        ENGINE_1: plan(Pipeline(stages=whole, microbatch_size=GBS, num_microbatches=1)),
        ENGINE_DP: plan(
            Pipeline(stages=whole, microbatch_size=half, num_microbatches=1),
            Pipeline(stages=whole, microbatch_size=half, num_microbatches=1),
        ),
        # Layers 0-2 | 3-5: the head (a 128x512 matmul + cross entropy) outweighs the
        # embedding lookup, so stage 1 does a little more work than stage 0.
        ENGINE_PP: plan(
            Pipeline(
                stages=(_stage(0, LAYERS // 2), _stage(LAYERS // 2 + 1, last)),
                microbatch_size=2,
                num_microbatches=GBS // 2,
            )
        ),
    }


def _training_config(hf_dir: Path) -> dict[str, Any]:
    return {
        "model": {
            "kind": "huggingface",
            "path": str(hf_dir),
            "load_weights": True,
            "seq_length": SEQ,
        },
        "seed": SEED,
        # no_decay empty: decay every parameter, as AdamW(model.parameters()) does (the
        # config's default exempts biases and norms, which the loss check catches from step 3).
        "optimizer": {
            "lr": LR,
            "betas": list(BETAS),
            "eps": EPS,
            "weight_decay": WD,
            "no_decay": [],
        },
    }


# ------------------------------------------------------------------------------ the engine


def _run_engine(
    plan: Plan, work: Path, files: dict[str, Path], args: argparse.Namespace
) -> Measured:
    extra = ["--train-config", str(files["train"]), "--model", str(files["model"])]
    run = launch_local(
        plan,
        args.steps,
        work,
        extra_args=extra,
        pin_cores=args.pin,
        deadline_s=240,
        module="cpu_timed_rank",  # rank_main + each step's CPU time (benchmarks/)
    )
    if not run.ok:
        raise RuntimeError(f"engine ranks failed: {run.returncodes} {[e for e in run.errors if e]}")
    per_rank = [run.steps(r) for r in range(len(plan.ranks()))]
    for r, recs in enumerate(per_rank):
        cpu = (work / f"cpu-{r}.jsonl").read_text().splitlines()
        for rec, line in zip(recs, cpu, strict=True):
            rec["cpu_s"] = json.loads(line)["cpu_s"]
    losses = [s["loss"] for s in per_rank[0]]  # all-reduced: the same on every rank
    return _measured(per_rank, losses, args.warmup, ("compute", "sync", "optim"))


def _measured(
    per_rank: list[list[dict[str, Any]]], losses: list[float], warmup: int, phases: tuple[str, ...]
) -> Measured:
    """A variant's figures from its ranks' step records (``step_s``, ``time``, ``<phase>_s``)."""
    steps = len(per_rank[0])
    step_s = [max(r[i]["step_s"] for r in per_rank) for i in range(warmup, steps)]
    cpu_s = [sum(r[i]["cpu_s"] for r in per_rank) for i in range(warmup, steps)]
    shares: dict[str, list[float]] = {k: [] for k in (*phases, "rest")}
    outside: list[float] = []
    first = max(warmup, 1)
    for recs in per_rank:
        for prev, s in zip(recs[first - 1 : -1], recs[first:], strict=True):
            gap = s["time"] - prev["time"]
            outside.append(max(0.0, gap - s["step_s"]) / gap)
        for s in recs[warmup:]:
            t = s["step_s"]
            for k in phases:
                shares[k].append(s[f"{k}_s"] / t)
            shares["rest"].append(1.0 - sum(s[f"{k}_s"] for k in phases) / t)
    return Measured(
        step_s=step_s,
        losses=losses,
        parts={k: statistics.median(v) for k, v in shares.items()},
        outside=statistics.median(outside) if outside else float("nan"),
        cpu_s=cpu_s,
    )


# ------------------------------------------------------------------------ plain transformers


def _hf_rank(cfg: dict[str, Any]) -> None:
    """One rank of the plain transformers loop (run in its own process; writes JSON lines)."""
    import transformers

    torch.set_num_threads(1)
    rank, world = cfg["rank"], cfg["world"]
    if cfg["pin"]:
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[rank % len(cores)]})
    model = transformers.GPT2LMHeadModel.from_pretrained(cfg["hf_dir"]).float().train()
    if world > 1:
        torch.distributed.init_process_group(
            "gloo", init_method=f"tcp://{cfg['master']}", rank=rank, world_size=world
        )
        net: torch.nn.Module = torch.nn.parallel.DistributedDataParallel(model)
    else:
        net = model
    # foreach=False: the engine's AdamW on CPU (make_optimizer), also torch's CPU default.
    opt = torch.optim.AdamW(
        model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=False
    )
    data = SyntheticTokens(VOCAB, SEQ, SEED)
    share = GBS // world
    with Path(cfg["out"]).open("w") as out:
        for step in range(cfg["steps"]):
            t0, c0 = time.perf_counter(), time.process_time()
            opt.zero_grad(set_to_none=False)
            first = step * GBS + rank * share  # the engine's pipelines take consecutive ranges
            x, y = data.batch(range(first, first + share))
            logits = net(input_ids=x).logits.float()
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
            loss.backward()  # DDP: gradient all-reduce in buckets, overlapped with backward
            t1 = time.perf_counter()
            opt.step()
            t2 = time.perf_counter()
            value = float(loss.detach())
            t3, c3 = time.perf_counter(), time.process_time()
            rec = {
                "step": step + 1,
                "loss": value,
                "step_s": t3 - t0,
                "cpu_s": c3 - c0,
                "compute_s": t1 - t0,
                "optim_s": t2 - t1,
                "time": time.time(),
            }
            out.write(json.dumps(rec) + "\n")
            out.flush()
    if world > 1:
        torch.distributed.destroy_process_group()


def _run_hf(world: int, work: Path, hf_dir: Path, args: argparse.Namespace) -> Measured:
    work.mkdir(parents=True, exist_ok=True)
    master = f"127.0.0.1:{free_port()}"
    procs = []
    for r in range(world):
        out = str(work / f"steps-{r}.jsonl")
        cfg = {"rank": r, "world": world, "master": master, "hf_dir": str(hf_dir), "out": out}
        cfg |= {"steps": args.steps, "pin": args.pin}
        cmd = [sys.executable, __file__, "--hf-rank", json.dumps(cfg)]
        err = (work / f"stderr-{r}.txt").open("wb")
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err))
        err.close()
    try:
        codes = [p.wait(timeout=240) for p in procs]
    finally:
        for p in procs:  # only on a timeout is one still running
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(codes):
        tail = (work / "stderr-0.txt").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"transformers ranks failed: {codes}\n{tail}")
    per_rank = [
        [json.loads(line) for line in (work / f"steps-{r}.jsonl").read_text().splitlines()]
        for r in range(world)
    ]
    # Each rank's loss is the mean over its equal share: the global loss is their mean.
    losses = [statistics.fmean(r[i]["loss"] for r in per_rank) for i in range(args.steps)]
    return _measured(per_rank, losses, args.warmup, ("compute", "optim"))


# ------------------------------------------------------------------------- model kernels only


def _model_probe(hf_dir: Path, reps: int) -> tuple[float, float, float]:
    """Forward + backward of the whole model, no optimizer, no process: the engine's
    ``GPTStage`` (loaded from ``hf_dir``) against ``GPT2LMHeadModel``, alternating, in this
    process (1 thread). Returns the median ms of each and the loss difference (relative).
    Separates what the model's kernels cost from what the engine's loop adds."""
    import transformers

    from sailor.megatron_patch.hf.checkpoint import load_model, load_stage
    from sailor.megatron_patch.model import GPTStage

    spec, arch = load_model(hf_dir, SEQ, GBS)
    engine = GPTStage(spec, 0, spec.num_all_layers - 1, arch=arch)
    load_stage(engine, hf_dir)
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(hf_dir)).float().train()
    x, y = SyntheticTokens(VOCAB, SEQ, SEED).batch(range(GBS))

    def engine_loss() -> torch.Tensor:
        return engine(x, y)  # type: ignore[no-any-return]

    def hf_loss() -> torch.Tensor:
        logits = hf(input_ids=x).logits.float()
        return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))

    times: dict[str, list[float]] = {"engine": [], "hf": []}
    losses: dict[str, float] = {}
    for i in range(reps + 1):  # the first of each is warm-up
        for name, fn in (("engine", engine_loss), ("hf", hf_loss))[:: 1 if i % 2 else -1]:
            t0 = time.perf_counter()
            loss = fn()
            loss.backward()
            dt = time.perf_counter() - t0
            losses[name] = float(loss.detach())
            if i:
                times[name].append(dt)
    rel = _rel(losses["engine"], losses["hf"])
    return 1000 * statistics.median(times["engine"]), 1000 * statistics.median(times["hf"]), rel


# ---------------------------------------------------------------------------------- report


def _machine() -> str:
    import transformers

    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    nproc = subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip()
    return (
        f"machine: {cpu}, nproc {nproc}, load average {_load()}; python "
        f"{platform.python_version()}, torch {torch.__version__}, transformers "
        f"{transformers.__version__}"
    )


def _load() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


_BASE = {ENGINE_1: HF_1, HF_1: HF_1, ENGINE_DP: HF_DDP, ENGINE_PP: HF_DDP, HF_DDP: HF_DDP}
"""The transformers variant each variant is compared with: the one with as many ranks."""


def _report(results: dict[str, list[Measured]], rounds: int) -> None:
    sps = {v: [m.samples_per_s for m in results[v]] for v in VARIANTS}
    best = {v: [m.best_samples_per_s for m in results[v]] for v in VARIANTS}
    cpu = {v: [m.cpu_ms_per_sample for m in results[v]] for v in VARIANTS}
    med = {v: statistics.median(x) for v, x in sps.items()}
    print(
        f"\n{'variant':26s} {'samples/s':>9s} {'rounds min-max':>15s} {'ratio':>6s} "
        f"{'ratio min-max':>13s} {'ms/step':>7s} | {'best-step samples/s':>19s} {'ratio':>6s} "
        f"| {'CPU ms/sample':>13s} {'ratio':>6s}"
    )
    for v in VARIANTS:
        b = _BASE[v]
        ratios = [x / y for x, y in zip(sps[v], sps[b], strict=True)]
        best_ratios = [x / y for x, y in zip(best[v], best[b], strict=True)]
        cpu_ratios = [y / x for x, y in zip(cpu[v], cpu[b], strict=True)]
        print(
            f"{v:26s} {med[v]:9.1f} {min(sps[v]):7.1f}-{max(sps[v]):<7.1f} "
            f"{statistics.median(ratios):5.2f}x {min(ratios):6.2f}-{max(ratios):<6.2f} "
            f"{1000 * GBS / med[v]:7.0f} | {statistics.median(best[v]):19.1f} "
            f"{statistics.median(best_ratios):5.2f}x | {statistics.median(cpu[v]):13.1f} "
            f"{statistics.median(cpu_ratios):5.2f}x"
        )
    print(
        f"\nratio: samples/s over those of transformers with as many ranks ({HF_1}, {HF_DDP}) "
        f"in the same round, median over {rounds} round(s); samples/s: global batch / median "
        "step, median over rounds; best-step: global batch / fastest measured step (the "
        "least disturbed by other jobs), median over rounds; CPU ms/sample: CPU time of all "
        "ranks' processes (every thread) per measured step / global batch, median over steps "
        "and rounds, its ratio transformers' / the variant's (> 1: less CPU per sample), "
        "less sensitive than wall time to other jobs taking the cores (not insensitive: "
        "shared caches, memory bandwidth) and blind to time spent waiting (pipeline bubble, a "
        "slower peer)."
    )
    print(
        f"scaling 1 -> 2 ranks (median samples/s): transformers DDP "
        f"{med[HF_DDP] / med[HF_1]:.2f}x, engine DP {med[ENGINE_DP] / med[ENGINE_1]:.2f}x, "
        f"engine PP {med[ENGINE_PP] / med[ENGINE_1]:.2f}x (ideal 2.00x with 2 idle cores)"
    )
    print(f"\n{'where the step goes (median share)':36s} phases; outside the step")
    for v in VARIANTS:
        m = results[v]
        phases = ", ".join(
            f"{k} {100 * statistics.median(x.parts[k] for x in m):.0f}%" for k in m[0].parts
        )
        outside = statistics.median(x.outside for x in m)
        print(f"  {v:34s} {phases}; {100 * outside:.1f}%")
    print(
        "engine: compute = 1F1B forwards and backwards incl. data and p2p (and waiting for "
        "the other stage), sync = gradient all-reduces (and waiting for the other rank), "
        "optim = AdamW, rest = zero-grad + loss all-reduce; transformers: compute = data + "
        "forward + backward (DDP: with its bucketed all-reduce, overlapped), optim = AdamW, "
        "rest = zero-grad + reading the loss. outside the step: share of the time between two "
        "step ends spent outside the timed step (engine: writing the progress line, the "
        "iteration hook)."
    )


def _check_losses(results: dict[str, list[Measured]]) -> None:
    ref = results[HF_1][0].losses
    print(f"\nloss agreement (same weights, data and AdamW; vs {HF_1}, round 1):")
    print(
        f"{'variant':26s} {'first-step loss':>16s} {'rel diff':>9s} "
        f"{'max rel diff, all steps':>24s}"
    )
    ok_first = ok_all = True
    for v in VARIANTS:
        losses = results[v][0].losses
        first = _rel(losses[0], ref[0])
        worst = max(_rel(a, b) for a, b in zip(losses, ref, strict=True))
        ok_first, ok_all = ok_first and first <= 1e-5, ok_all and worst <= 1e-5
        print(f"{v:26s} {losses[0]:16.8f} {first:9.1e} {worst:24.1e}")
    print(
        f"first-step losses agree to 1e-5: {'yes' if ok_first else 'NO'}; "
        f"all {len(ref)} steps: {'yes' if ok_all else 'NO'}"
    )


# ------------------------------------------------------------------------------------ main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=12, help="Steps per run, warm-up included.")
    ap.add_argument("--warmup", type=int, default=2, help="First steps not measured.")
    ap.add_argument("--rounds", type=int, default=3, help="Interleaved rounds of all variants.")
    ap.add_argument("--pin", action="store_true", help="Bind rank r to core r (every variant).")
    ap.add_argument("--quick", action="store_true", help="Smoke run: 1 round of 3 steps.")
    ap.add_argument(
        "--activation",
        choices=["gelu_new", "gelu_pytorch_tanh"],
        default="gelu_new",
        help="GPT-2's activation_function: gelu_new (GPT-2's own; transformers computes its "
        "tanh formula in ~8 elementwise ops) or gelu_pytorch_tanh (the same function as one "
        "fused op, as the engine computes either).",
    )
    ap.add_argument("--hf-rank", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.hf_rank is not None:
        _hf_rank(json.loads(args.hf_rank))
        return
    if args.quick:
        args.steps, args.warmup, args.rounds = 3, 1, 1
    # Engine ranks run benchmarks/cpu_timed_rank.py (python -m, from the run's directory).
    here = str(Path(__file__).resolve().parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
    if not 0 <= args.warmup < args.steps:
        raise SystemExit(f"--warmup={args.warmup} must be in [0, --steps={args.steps})")
    torch.set_num_threads(1)
    t_start = time.monotonic()
    print("== engine vs plain transformers: training samples/s ==")
    print(_machine())
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        n_params = _save_model(root / "hf", args.activation)
        from sailor.megatron_patch.hf.checkpoint import load_model, model_file

        spec, arch = load_model(root / "hf", SEQ, GBS)
        files = {"model": root / "model.json", "train": root / "train.json"}
        files["model"].write_text(model_file(spec, arch))  # ranks need not import transformers
        files["train"].write_text(json.dumps(_training_config(root / "hf")))
        print(
            f"model: GPT-2 ({LAYERS} blocks, hidden {HIDDEN}, {HEADS} heads, ffn {4 * HIDDEN}, "
            f"vocab {VOCAB}, seq {SEQ}, tied, {args.activation}), {n_params / 1e6:.2f} M "
            f"params, fp32; global batch {GBS} x {SEQ} tokens; AdamW lr {LR}, betas {BETAS}, "
            f"wd {WD} on every parameter, no clipping, constant lr"
        )
        print(
            f"how: CPU, gloo, 1 torch thread per rank (2 ranks = 2 cores); {args.steps} steps "
            f"per run, first {args.warmup} dropped; {args.rounds} round(s), order reversed every "
            f"other round; per step the slowest rank; cores {'pinned' if args.pin else 'free'}"
        )
        print(
            "layouts: engine 1 rank = 1 microbatch of 8; DP = 2 pipelines x 1 microbatch of 4; "
            "PP = 2 stages (layers 0-2 | 3-5), 4 microbatches of 2, 1F1B; transformers 1 rank "
            "= one batch of 8; DDP = 2 processes x one batch of 4"
        )
        plans = _plans()
        results: dict[str, list[Measured]] = {v: [] for v in VARIANTS}
        for rnd in range(args.rounds):
            order = VARIANTS if rnd % 2 == 0 else VARIANTS[::-1]
            for v in order:
                work = root / f"r{rnd}-{v.replace(' ', '_')}"
                if v in plans:
                    m = _run_engine(plans[v], work, files, args)
                else:
                    m = _run_hf(1 if v == HF_1 else 2, work, root / "hf", args)
                results[v].append(m)
                print(
                    f"  round {rnd + 1}: {v:26s} {m.samples_per_s:7.1f} samples/s (load {_load()})",
                    flush=True,
                )
        _report(results, args.rounds)
        _check_losses(results)
        reps = 3 if args.quick else 10
        e_ms, h_ms, rel = _model_probe(root / "hf", reps)
        print(
            f"\nmodel only (forward + backward of the whole model, batch {GBS}, in one process, "
            f"1 thread, alternating, median of {reps}): engine GPTStage {e_ms:.0f} ms, "
            f"GPT2LMHeadModel {h_ms:.0f} ms, ratio transformers/engine {h_ms / e_ms:.2f}x "
            f"(loss rel diff {rel:.1e})"
        )
    print(f"\ntotal {time.monotonic() - t_start:.0f} s; load average at the end {_load()}")


if __name__ == "__main__":
    main()
