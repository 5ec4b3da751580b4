"""How long a reconfiguration phase needs, derived from what the plan moves.

A phase's configured deadline (``PhaseDeadlines``) is a floor made for the CPU demo: a 7B-70B
model's checkpoint is tens to hundreds of GB, written and read by each node through its own
storage, and a step takes seconds. :func:`phase_need` says what the plan about to run (or
being saved) needs, per phase:

- CHECKPOINT: the node that writes the most bytes, at ``write_mib_s``. Every global layer is
  written once, whole (TP-gathered), by the rank :func:`writer_assignment` picks, as the
  engine's ``Checkpointer`` does (``training_process/ckpt_glue.py`` passes no layer sizes:
  the assignment balances layer counts, not bytes).
- LOAD: the node that reads the most, at ``read_mib_s``: each rank reads its TP slice of its
  stage's layers (``checkpoint.reader.load``); nothing when the launch loads no checkpoint
  (nor, ``decision_types.phase_deadline`` decides, when it is in place: its live ranks
  hand their state over).
- VERIFY: start-up plus ``verify_steps`` iterations of the plan: the iteration time the
  running cluster measured for this very plan (:class:`MeasuredIteration`, online
  calibration's latest fit) when there is one, else the simulator's prediction it carries
  (``Plan.predicted``; a plan made after a calibration was kept is priced with it).
- QUIESCE: the iterations up to the agreed stop step (``stop_ahead_steps``, and one more: a
  node may be a step behind the highest report), at the same iteration time.
- LOAD in place: the live ranks hand their state over; each rank reads from the checkpoint
  only the layers no complete surviving replica group of the previous plan holds
  (:func:`in_place_read_bytes`, the engine's own schedule ``megatron_patch.relayout``).

Each is ``startup + safety x (bytes / throughput, or steps x iteration time)``, at most
``max_s`` (3 h by default; the throughputs are at least 1 MiB/s). A checkpoint
holds per parameter the fp32 master weight and both AdamW moments, whatever the compute
precision (``sailor/checkpoint/__init__.py``, ``TENSOR_KINDS``, ``MASTER_BYTES``: 12 bytes;
autocast keeps no 16-bit copy to save), with the vocabulary padded as the engine pads it.

Pure: values in, values out; no I/O, no clock. Must never import torch (the controller's
contract): layer sizes come from the model spec and the simulator's per-TP-rank count.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

from pydantic import Field

from sailor.checkpoint.assignment import writer_assignment
from sailor.megatron_patch.held_match import match_held
from sailor.megatron_patch.relayout import kept_layers, schedule
from sailor.schemas._base import Frozen
from sailor.schemas.checkpoint import TENSOR_KINDS
from sailor.schemas.device_kind import is_cpu_type
from sailor.schemas.model import ModelSpec, padded_vocab
from sailor.schemas.plan import Plan, RankPlace
from sailor.schemas.precision import MASTER_BYTES
from sailor.schemas.runtime import Phase
from sailor.simulator.estimate_profile import estimate_layer_size

__all__ = [
    "CHECKPOINT_BYTES_PER_PARAM",
    "DERIVED_PHASES",
    "DeadlineModel",
    "MeasuredIteration",
    "PhaseNeed",
    "checkpoint_layer_bytes",
    "derived_deadlines",
    "in_place_read_bytes",
    "iteration_time",
    "mismatch",
    "phase_need",
    "read_bytes_per_node",
    "write_bytes_per_node",
]

CHECKPOINT_BYTES_PER_PARAM = len(TENSOR_KINDS) * MASTER_BYTES
"""12: the fp32 master weight and the two fp32 AdamW moments of every parameter, as the
engine saves them (``checkpoint/state.py``: ``ParamState``; an optimizer without moments
saves zeros in their place, ``training_process/ckpt_glue.trainer_params``)."""

DERIVED_PHASES = (Phase.QUIESCE, Phase.CHECKPOINT, Phase.LOAD, Phase.VERIFY)
"""The phases whose deadline a plan's size or speed can lengthen."""

_MIB = 1 << 20

_LEAST_MIB_S = 1.0
"""The least storage throughput a setting may give, MiB/s: a 1980s disk's; anything below is
a typo (0.01 for 10) that sized deadlines in days."""

_MAX_S = 3 * 3600.0
"""The default cap on a derived deadline (``DeadlineModel.max_s``), s."""


class DeadlineModel(Frozen):
    """What a reconfiguration phase needs, from the plan's bytes and iteration time
    (``deadlines.derive``). The effective deadline is the larger of the configured one and
    this; the stretch of LOAD and VERIFY multiplies that.

    Throughputs default to a default AWS gp3 volume (125 MiB/s, the least gp3 provisions;
    a GCP pd-balanced disk gives 0.28 MiB/s per GiB: 140 MiB/s at 500 GiB): the slowest
    block storage a GPU node commonly has. A local NVMe (2-7 GB/s) is 15-50x faster, a
    larger persistent disk (up to 1,200 MiB/s per VM) up to ~10x: set yours, from ``fio``
    or a measured save (the audit's ``checkpoint`` phase lengths). Too low costs only a
    longer wait on a real hang; too high aborts every reconfiguration of a large job
    (CHECKPOINT does not stretch). The start-up terms are guesses, not measurements: the
    CPU demo's launch takes about 5 s with torch's import; on GPUs CUDA context creation and
    NCCL's communicator init add seconds to a minute, more at hundreds of nodes. They stay
    below the demo's and the integration tests' deadlines (15-30 s), whose configured floor
    covers the rest.
    """

    enabled: bool = Field(
        default=True,
        description="Derive QUIESCE, CHECKPOINT, LOAD and VERIFY deadlines from the plan "
        "(with the controller's model spec); False: the configured deadlines alone.",
    )
    write_mib_s: float = Field(
        default=125.0,
        ge=_LEAST_MIB_S,
        description="Checkpoint write throughput of one node to the checkpoint storage, "
        "MiB/s (all its ranks together); at least 1 (a typo such as 0.01 gave deadlines of "
        "days).",
    )
    read_mib_s: float = Field(
        default=125.0,
        ge=_LEAST_MIB_S,
        description="Checkpoint read throughput of one node from the checkpoint storage, "
        "MiB/s (all its ranks together); at least 1.",
    )
    max_s: float = Field(
        default=_MAX_S,
        gt=0,
        description="Most a derived deadline may be, s (before the LOAD and VERIFY stretch, "
        "which deadlines.stretch_max_s bounds): "
        "a wild predicted iteration time or throughput stops here, and the phase record's "
        "why says it did. Default 3 h: above what a 405B model's busiest node writes at the "
        "default throughput (~300 GB on 16 nodes: ~80 min with the safety factor).",
    )
    safety: float = Field(
        default=2.0,
        ge=1,
        description="Factor on the size- and speed-driven part (bytes over throughput, "
        "iterations): a shared disk, a cold cache, a slower corner of the cost model.",
    )
    checkpoint_startup_s: float = Field(
        default=10.0,
        ge=0,
        description="CHECKPOINT besides writing: the snapshot, the TP gather, the parts, "
        "manifest and marker round trips, the status that reports it.",
    )
    load_startup_s: float = Field(
        default=20.0,
        ge=0,
        description="LOAD besides reading: worker start, torch and CUDA import, the "
        "rendezvous and the world's first collective.",
    )
    verify_startup_s: float = Field(
        default=20.0,
        ge=0,
        description="VERIFY besides its iterations: the groups' communicator init at their "
        "first collective, allocator warm-up, kernel autotuning of the first step.",
    )
    verify_steps: float = Field(
        default=2.0,
        gt=0,
        description="Iterations VERIFY allows for the first step after the load (the "
        "first one runs slower).",
    )


class MeasuredIteration(Frozen):
    """The iteration time the running cluster measured for one plan: online calibration's
    latest fit (``OnlineFit.measured_step_s``, the median over ranks of each rank's median
    step; ``controller/online_calibration.py``), kept in etcd with the calibration version
    (``CalibrationRecord``) so a new leader has it too."""

    plan_id: str = Field(min_length=1, description="The plan the steps were measured on.")
    iteration_s: float = Field(gt=0, description="Measured seconds per iteration.")
    source: str = Field(default="", max_length=200, description="Where it comes from, for the why.")


def iteration_time(plan: Plan, measured: MeasuredIteration | None) -> tuple[float | None, str]:
    """The iteration time QUIESCE and VERIFY are sized by, and its basis: the measured one
    when it is of this very plan (same ``plan_id``), else the plan's prediction (the
    planner's, under the kept calibration when one was kept before the plan was made);
    (None, '') when neither."""
    if measured is not None and plan.plan_id and measured.plan_id == plan.plan_id:
        where = f", {measured.source}" if measured.source else ""
        return measured.iteration_s, f"measured{where}"
    if plan.predicted is not None:
        return plan.predicted.iteration_time_s, "predicted"
    return None, ""


@dataclass(frozen=True)
class PhaseNeed:
    """What one phase needs by the plan: ``seconds``, and what that is made of."""

    phase: Phase
    seconds: float
    startup_s: float
    safety: float
    node: str = ""
    """The node that moves the most bytes ('' for QUIESCE and VERIFY)."""
    bytes: int = 0
    mib_s: float = 0.0
    iteration_s: float | None = None
    """The iteration time (measured or predicted: ``basis``); None when there is none."""
    basis: str = ""
    """QUIESCE and VERIFY: ``measured, ...`` or ``predicted``; LOAD: ``in place`` when it
    reads only what no surviving replica holds."""
    steps: float = 0.0
    uncapped_s: float = 0.0
    """What the formula gave, when above ``DeadlineModel.max_s`` (``seconds`` is the cap
    then); 0 when within it."""

    def why(self) -> str:
        """E.g. ``node n1 writes 42.1 GB at 125 MiB/s x2 + 10 s start-up``, ``2 iterations
        of 8 s x2 + 20 s start-up``; when capped, what it gave and the cap's setting."""
        start = f"{self.startup_s:g} s start-up"
        if self.phase is Phase.LOAD and not self.bytes:
            held = "in place: " if self.basis else ""
            text = f"{start} ({held}reads no checkpoint)"
        elif self.phase in (Phase.CHECKPOINT, Phase.LOAD):
            verb = "writes" if self.phase is Phase.CHECKPOINT else "reads"
            what = " (in place: the layers no surviving replica holds)" if self.basis else ""
            text = (
                f"node {self.node} {verb} {self.bytes / 1e9:.3g} GB{what} at "
                f"{self.mib_s:g} MiB/s x{self.safety:g} + {start}"
            )
        elif self.iteration_s is None:
            text = f"{start} (no measured or predicted iteration time)"
        else:
            what = (
                f"{self.steps:g} iterations of {self.iteration_s:.3g} s ({self.basis}) "
                f"x{self.safety:g}"
            )
            text = f"{what} + {start}" if self.startup_s else what
        if self.uncapped_s:
            text += f" = {self.uncapped_s:.0f} s, capped by deadlines.derive.max_s"
        return text


def checkpoint_layer_bytes(model: ModelSpec, layer: int) -> int:
    """Bytes one global layer takes in a checkpoint: its parameters (the embedding's and the
    head's vocabulary padded as the engine pads it, ``megatron_patch.vocab_parallel``) at
    :data:`CHECKPOINT_BYTES_PER_PARAM`."""
    params = model.layer_params(layer)
    if model.layer_kind(layer) != "block":
        params += (padded_vocab(model.vocab_size) - model.vocab_size) * model.hidden_size
    return params * CHECKPOINT_BYTES_PER_PARAM


def mismatch(plan: Plan, model: ModelSpec) -> str | None:
    """Why ``model`` cannot size ``plan``'s layers (None when it can): another model's plan,
    or one over another layer count (the stand-in planner's ``num_layers``)."""
    if plan.num_layers != model.num_all_layers:
        return (
            f"plan {plan.plan_id or plan.model!r} has {plan.num_layers} layers, model "
            f"{model.name!r} {model.num_all_layers} (embedding, blocks, head)"
        )
    return None


def _nodes_of(plan: Plan, placement: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """node -> its global ranks: the placement, or (a plan not placed) the replica groups'
    ``node_id``, each unnamed group a node of its own."""
    if placement:
        return dict(placement)
    out: dict[str, list[int]] = {}
    for rank, (pi, si, _t) in enumerate(plan.ranks()):
        group = plan.pipelines[pi].stages[si].replica
        out.setdefault(group.node_id or f"p{pi}.s{si}", []).append(rank)
    return {n: tuple(r) for n, r in out.items()}


def _check(plan: Plan, model: ModelSpec) -> None:
    why = mismatch(plan, model)
    if why is not None:
        raise ValueError(why)


def write_bytes_per_node(
    plan: Plan, placement: Mapping[str, tuple[int, ...]], model: ModelSpec
) -> dict[str, int]:
    """node -> checkpoint bytes its ranks write in a save of ``plan`` (every layer once,
    whole, by the rank :func:`writer_assignment` gives it)."""
    _check(plan, model)
    writer = writer_assignment(plan)
    by_rank: dict[int, int] = {}
    for layer, rank in writer.items():
        by_rank[rank] = by_rank.get(rank, 0) + checkpoint_layer_bytes(model, layer)
    return {
        n: sum(by_rank.get(r, 0) for r in ranks) for n, ranks in _nodes_of(plan, placement).items()
    }


def read_bytes_per_node(
    plan: Plan, placement: Mapping[str, tuple[int, ...]], model: ModelSpec
) -> dict[str, int]:
    """node -> checkpoint bytes its ranks read when ``plan`` loads a checkpoint: each rank
    its TP slice of its stage's layers (the simulator's parameters per TP rank,
    ``estimate_layer_size``, at :data:`CHECKPOINT_BYTES_PER_PARAM`), plus its slice of the
    padded vocabulary rows of the embedding and the head, which the simulator leaves out
    and the checkpoint holds (:func:`checkpoint_layer_bytes`)."""
    _check(plan, model)
    # once per layer range and TP degree: a 512-node plan repeats a few stage shapes
    # over thousands of ranks (per rank, a pass took 250 ms at 4,096 ranks)
    by_shape: dict[tuple[int, int, int], int] = {}
    per_rank: list[int] = []
    for p in plan.pipelines:
        for stage in p.stages:
            tp = stage.replica.tp
            key = (stage.first_layer, stage.last_layer, tp)
            if key not in by_shape:
                by_shape[key] = sum(_rank_layer_bytes(model, tp, x) for x in stage.layers)
            per_rank.extend([by_shape[key]] * tp)
    return _per_node(plan, placement, per_rank)


def _rank_layer_bytes(model: ModelSpec, tp: int, layer: int) -> int:
    """Checkpoint bytes one TP rank of degree ``tp`` reads of ``layer``: its slice (the
    simulator's parameters per TP rank) plus its share of the padded vocabulary rows."""
    params = estimate_layer_size(model, tp, layer).params
    if model.layer_kind(layer) != "block":
        pad = (padded_vocab(model.vocab_size) - model.vocab_size) * model.hidden_size
        params += pad // tp
    return params * CHECKPOINT_BYTES_PER_PARAM


def _per_node(
    plan: Plan, placement: Mapping[str, tuple[int, ...]], per_rank: list[int]
) -> dict[str, int]:
    return {
        n: sum(per_rank[r] for r in rs if 0 <= r < len(per_rank))
        for n, rs in _nodes_of(plan, placement).items()
    }


def _held_ranks(
    old: Plan,
    old_placement: Mapping[str, tuple[int, ...]],
    new: Plan,
    new_placement: Mapping[str, tuple[int, ...]],
) -> dict[int, int]:
    """new rank -> the old rank whose held worker takes it, on every node of both layouts:
    the agent's match (:func:`~sailor.megatron_patch.held_match.match_held`, by the layers
    each keeps: ``relayout.kept_layers``) over the node's held workers in the agent's
    preference order (rank not kept, rank). A CPU kind has no GPU to keep (-1)."""
    old_table, new_table = old.rank_table(), new.rank_table()

    def gpu(p: RankPlace) -> int:
        return -1 if is_cpu_type(p.gpu_type) else p.local_gpu

    out: dict[int, int] = {}
    n_old = len(old_table)
    for node, new_ranks in new_placement.items():
        ranks = sorted(new_ranks)
        free = sorted(
            (r for r in old_placement.get(node, ()) if 0 <= r < n_old),
            key=lambda r: (r not in ranks, r),
        )
        picked = match_held(
            [(gpu(old_table[w]), w) for w in free],
            ranks,
            {r: gpu(new_table[r]) for r in ranks},
            _kept_by(old_table, new_table, free),
        )
        out.update((r, free[i]) for r, i in picked.items())
    return out


def _kept_by(
    old_table: tuple[RankPlace, ...], new_table: tuple[RankPlace, ...], held: list[int]
) -> Callable[[int, int], int]:
    """``match_held``'s ``kept``: the layers the worker of old rank ``held[i]`` keeps at
    new rank ``r``."""
    return lambda i, r: kept_layers(old_table[held[i]], new_table[r])


def in_place_read_bytes(
    old: Plan,
    old_placement: Mapping[str, tuple[int, ...]],
    new: Plan,
    new_placement: Mapping[str, tuple[int, ...]],
    model: ModelSpec,
    valid: Collection[str] | None = None,
) -> dict[str, int]:
    """node -> checkpoint bytes its ranks read at an in-place launch from ``old`` to ``new``:
    each new rank its TP slice of the layers no complete surviving replica group of ``old``
    holds (``relayout.schedule``'s ``checkpoint`` layers, the engine's own plan diff).
    Survivors: the held workers of the nodes of both layouts in ``valid`` (None: every
    one), matched to new ranks as the agent matches them; each taken as unbroken at the
    load step, as the engine requires of a holder (``in_place.handshake``). The caller
    leaves out the nodes that are not (``decision_types._in_place_reads``: after an abort,
    none is); () sizes the full read of every rank's stage. A worker that fails while held
    after the launch makes its layers read too: such a LOAD can outlast this deadline,
    and falls back to the restart path, whose LOAD is sized in full."""
    _check(old, model)
    _check(new, model)
    if valid is not None:
        kept = set(valid)
        old_placement = {n: rs for n, rs in old_placement.items() if n in kept}
    holders = _held_ranks(old, old_placement, new, new_placement)
    sched = schedule(old, holders, new)
    tps = [p.tp for p in new.rank_table()]
    per_rank = [
        sum(_rank_layer_bytes(model, tps[rs.rank], x) for x in rs.checkpoint) for rs in sched.ranks
    ]
    return _per_node(new, new_placement, per_rank)


def _most(per_node: Mapping[str, int]) -> tuple[str, int]:
    """The node with the most bytes (the first by id on a tie); ('', 0) for none."""
    if not per_node:
        return "", 0
    node = min(per_node, key=lambda n: (-per_node[n], n))
    return node, per_node[node]


def phase_need(
    phase: Phase,
    plan: Plan,
    placement: Mapping[str, tuple[int, ...]],
    model: ModelSpec,
    settings: DeadlineModel,
    *,
    loads_checkpoint: bool = True,
    stop_ahead_steps: int = 1,
    measured: MeasuredIteration | None = None,
    in_place_reads: Mapping[str, int] | None = None,
) -> PhaseNeed | None:
    """What ``phase`` needs for ``plan`` on ``placement`` (node -> global ranks; empty: the
    replica groups' nodes); None for a phase a plan does not size (LAUNCH, COMMIT, TEARDOWN,
    IDLE, RUNNING). ``loads_checkpoint``: the launch loads one (LOAD reads nothing else).
    ``measured``: the running cluster's iteration time of a plan (:func:`iteration_time`).
    ``in_place_reads``: an in-place launch's reads per node (:func:`in_place_read_bytes`),
    which LOAD is sized by instead of a full read.
    Raises ValueError when ``model`` is not the plan's (:func:`mismatch`)."""
    _check(plan, model)
    k = settings.safety
    basis = ""
    if phase is Phase.CHECKPOINT:
        node, nbytes = _most(write_bytes_per_node(plan, placement, model))
        rate, start = settings.write_mib_s, settings.checkpoint_startup_s
    elif phase is Phase.LOAD:
        if in_place_reads is not None:
            node, nbytes = _most(in_place_reads)
            basis = "in place"
        elif loads_checkpoint:
            node, nbytes = _most(read_bytes_per_node(plan, placement, model))
        else:
            node, nbytes = "", 0
        rate, start = settings.read_mib_s, settings.load_startup_s
    elif phase in (Phase.VERIFY, Phase.QUIESCE):
        it, basis = iteration_time(plan, measured)
        steps = settings.verify_steps if phase is Phase.VERIFY else float(stop_ahead_steps + 1)
        start = settings.verify_startup_s if phase is Phase.VERIFY else 0.0
        seconds = start + (k * steps * it if it is not None else 0.0)
        over = seconds if seconds > settings.max_s else 0.0
        seconds = min(seconds, settings.max_s)
        return PhaseNeed(
            phase, seconds, start, k, iteration_s=it, basis=basis, steps=steps, uncapped_s=over
        )
    else:
        return None
    seconds = start + k * nbytes / (rate * _MIB)
    over = seconds if seconds > settings.max_s else 0.0
    return PhaseNeed(
        phase,
        min(seconds, settings.max_s),
        start,
        k,
        node=node if nbytes else "",
        bytes=nbytes,
        mib_s=rate,
        basis=basis,
        uncapped_s=over,
    )


def derived_deadlines(
    plan: Plan,
    placement: Mapping[str, tuple[int, ...]],
    model: ModelSpec,
    settings: DeadlineModel | None = None,
    *,
    loads_checkpoint: bool = True,
    stop_ahead_steps: int = 1,
    measured: MeasuredIteration | None = None,
) -> dict[Phase, PhaseNeed]:
    """:func:`phase_need` of every phase in :data:`DERIVED_PHASES`."""
    s = settings or DeadlineModel()
    out: dict[Phase, PhaseNeed] = {}
    for phase in DERIVED_PHASES:
        need = phase_need(
            phase,
            plan,
            placement,
            model,
            s,
            loads_checkpoint=loads_checkpoint,
            stop_ahead_steps=stop_ahead_steps,
            measured=measured,
        )
        if need is not None:
            out[phase] = need
    return out
