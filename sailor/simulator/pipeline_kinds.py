"""The per-microbatch figures of a plan's pipelines: compute and transfers per stage.

Steps 1 and 2 of the model (docs/simulator-model.md): each stage's forward, backward and
optimizer time from the per-layer profiles plus the framework's time outside the layers, and
the pipeline transfers between consecutive stages (blocking at both ends, or a delay on the
link). They are worked out once per distinct pipeline (:class:`PipelineKind`: pipelines alike
in everything the model reads share their figures), independent of the microbatch count.

Pure: reads the simulation's :class:`~sailor.simulator.sim_inputs.SimInputs`, fills its lookup
caches and notes, returns values; no I/O, no clock, no globals.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from sailor.schemas import LayerSize, Pipeline
from sailor.simulator.lookup import layer_table
from sailor.simulator.network_model import guessed_link
from sailor.simulator.sim_inputs import SimInputs
from sailor.simulator.tp_comm import all_gather_s, spec_link_efficiency, tp_link

__all__ = [
    "PipelineKind",
    "build_pipeline_kinds",
]

_MASK_BYTES_PER_ELEMENT = 2


@dataclass(frozen=True)
class _Stage:
    f: float
    b: float
    u: float
    send_f: float
    send_b: float
    sizes: tuple[LayerSize, ...]
    fw: float = 0.0
    """Framework time per microbatch outside the layers (schedule step, data)."""


_StageKey = tuple[int, int, str, int, int, str, bool]
"""(first layer, last layer, GPU type, TP, GPUs per node, zone, recompute) of a stage."""


_PipeKey = tuple[int, tuple[_StageKey, ...], tuple[bool, ...]]
"""A pipeline's microbatch size, stages, and which consecutive stages share a node."""


@dataclass(frozen=True)
class PipelineKind:
    """The per-microbatch figures of every pipeline with one :data:`_PipeKey`."""

    row: tuple[_Stage, ...]
    fs: tuple[float, ...]
    bs: tuple[float, ...]
    delay: tuple[float, ...]
    crossings: tuple[tuple[str, str, float, float], ...]
    """(sender zone, receiver zone, forward bytes, backward bytes) of each cross-zone link,
    per microbatch."""
    stage_of_layer: tuple[int, ...]
    stages: tuple[_StageKey, ...]


def _pipe_key(p: Pipeline) -> _PipeKey:
    stages = p.stages
    reps = [s.replica for s in stages]
    return (
        p.microbatch_size,
        tuple(
            (s.first_layer, s.last_layer, r.gpu_type, r.tp, r.gpus_per_node, r.zone, s.recompute)
            for s, r in zip(stages, reps, strict=True)
        ),
        tuple(bool(a.node_id) and a.node_id == b.node_id for a, b in itertools.pairwise(reps)),
    )


def _kind(inp: SimInputs, p: Pipeline, pkey: _PipeKey, mask: float) -> PipelineKind:
    """Compute and transfers per stage of ``p``, per microbatch (independent of its count)."""
    model, cal = inp.model, inp.cal
    row: list[_Stage] = []
    for s in p.stages:
        r = s.replica
        key = (r.gpu_type, r.tp, p.microbatch_size)
        table = inp.tables.get(key)
        if table is None:
            table = layer_table(
                inp.profiles,
                model,
                inp.gcal(r.gpu_type),
                inp.specs,
                *key,
                cal.vocab_parallel,
                cal.activations,
                inp.links.network,
                cal.mixed_precision,
            )
            inp.tables[key] = table
            inp.notes.add(*table.notes)
        sizes = inp.sizes(r.tp)
        costs = table.layers[s.first_layer : s.last_layer + 1]
        inp.uses_estimates |= any(c.estimated for c in costs)
        ft = inp.framework(r.gpu_type)
        # stages that read the data: the first (inputs) and the last (labels)
        reads = s.first_layer == 0 or s.last_layer == model.num_all_layers - 1
        # with recompute, the engine runs each block's forward again in its backward
        again = (
            sum(
                c.fwd_s
                for layer, c in enumerate(costs, s.first_layer)
                if model.layer_kind(layer) == "block"
            )
            if s.recompute
            else 0.0
        )
        row.append(
            _Stage(
                f=sum(c.fwd_s for c in costs),
                b=sum(c.bwd_s for c in costs) + again,
                u=sum(c.update_s for c in costs),
                send_f=0.0,
                send_b=0.0,
                sizes=sizes[s.first_layer : s.last_layer + 1],
                fw=ft.microbatch_s + (p.microbatch_size * ft.sample_s if reads else 0.0),
            )
        )
    crossings: list[tuple[str, str, float, float]] = []
    for i in range(len(row) - 1):
        a, b = p.stages[i].replica, p.stages[i + 1].replica
        out = p.microbatch_size * inp.wire(row[i].sizes[-1])
        etas, fixed = cal.p2p_link(a.gpu_type, b.gpu_type)
        same_node = bool(a.node_id) and a.node_id == b.node_id
        if same_node:
            # the boundary's bytes over one GPU pair's link (a mesh node's pair link, not
            # the GPU's whole link to all its peers)
            curve, note = inp.links.intra(a.gpu_type, a.gpus_per_node, spec_group=2)
        else:
            curve, note = inp.links.inter(a, b)
        inp.notes.add(note)
        inp.uses_estimates |= guessed_link(note)
        gather_f = gather_b = 0.0
        if cal.p2p_across_tp == "full_copies" and (a.tp > 1 or b.tp > 1):
            # each receiver rank takes the whole activation from one sender (b.tp copies
            # forward), each sender rank the whole gradient back (a.tp copies); no gather
            node_f = b.tp * out + a.tp * mask
            node_b = float(a.tp * out)
        else:
            # one copy crosses in each direction, in 1/t slices sent at once over the node's
            # NICs (node-level bytes on the node curve; + the unsplit mask where sent); the
            # receiving TP group all-gathers it inside its node: stage s+1 (b.tp ranks)
            # forward, stage s (a.tp ranks) backward, as the engine's roles.boundary_pieces
            # (over what the TP all-reduces of an estimated layer use: tp_comm.tp_link)
            if b.tp > 1:
                gather_f = _gather(inp, b.gpu_type, b.tp, out)
            if a.tp > 1:
                gather_b = _gather(inp, a.gpu_type, a.tp, out)
            node_f = a.tp * (out / a.tp + mask)
            node_b = float(out)
        eff = etas.on(curve.max_gbps)
        t_f = fixed + curve.transfer_time(node_f) / eff + gather_f
        t_b = fixed + curve.transfer_time(node_b) / eff + gather_b
        row[i] = _replace(row[i], send_f=t_f, send_b=t_b)
        if a.zone != b.zone:
            crossings.append((a.zone, b.zone, node_f, node_b))
    fs, bs, delay = _per_microbatch(row, cal.blocking_p2p)
    return PipelineKind(
        row=tuple(row),
        fs=tuple(fs),
        bs=tuple(bs),
        delay=tuple(delay),
        crossings=tuple(crossings),
        stage_of_layer=tuple(si for si, s in enumerate(p.stages) for _ in s.layers),
        stages=pkey[1],
    )


def _gather(inp: SimInputs, gpu_type: str, tp: int, nbytes: float) -> float:
    """A stage boundary's all-gather of ``nbytes`` by ``tp`` GPUs of ``gpu_type``
    (:func:`~sailor.simulator.tp_comm.all_gather_s`), its link noted."""
    eff = spec_link_efficiency(inp.specs, gpu_type, inp.gcal(gpu_type))
    link = tp_link(inp.links.network, inp.specs, gpu_type, tp, eff)
    if link.guessed:
        inp.notes.add(f"all-gather at a stage boundary over the {link.note}")
        inp.uses_estimates = True
    return all_gather_s(link, nbytes, tp)


def build_pipeline_kinds(
    inp: SimInputs, pipelines: Sequence[Pipeline], egress_bytes: dict[tuple[str, str], float]
) -> list[PipelineKind]:
    """Per-stage compute and transfers of each pipeline, worked out once per distinct
    pipeline; adds the pipeline transfers' cross-zone bytes to ``egress_bytes``."""
    mask = _MASK_BYTES_PER_ELEMENT * inp.model.seq_length**2 if inp.cal.sends_attention_mask else 0
    by_key: dict[_PipeKey, PipelineKind] = {}
    by_object: dict[int, PipelineKind] = {}  # the planner's plans repeat one Pipeline object
    kinds: list[PipelineKind] = []
    for p in pipelines:
        kind = by_object.get(id(p))
        if kind is None:
            key = _pipe_key(p)
            kind = by_key.get(key)
            if kind is None:
                kind = by_key[key] = _kind(inp, p, key, mask)
            by_object[id(p)] = kind
        kinds.append(kind)
        m = p.num_microbatches
        for za, zb, node_f, node_b in kind.crossings:
            egress_bytes[(za, zb)] = egress_bytes.get((za, zb), 0.0) + m * node_f
            egress_bytes[(zb, za)] = egress_bytes.get((zb, za), 0.0) + m * node_b
    return kinds


def _replace(st: _Stage, *, send_f: float, send_b: float) -> _Stage:
    return _Stage(f=st.f, b=st.b, u=st.u, send_f=send_f, send_b=send_b, sizes=st.sizes, fw=st.fw)


def _per_microbatch(
    row: list[_Stage], blocking: bool
) -> tuple[list[float], list[float], list[float]]:
    """Per-microbatch F and B of each stage, and the delay of each link.

    Blocking transfers are charged to both ends (no link delay); asynchronous ones are a
    delay on the link (the larger of the two directions; the replay has one per link).
    """
    fs: list[float] = []
    bs: list[float] = []
    for i, st in enumerate(row):
        prev_f = row[i - 1].send_f if i and blocking else 0.0
        prev_b = row[i - 1].send_b if i and blocking else 0.0
        own_f = st.send_f if blocking else 0.0
        own_b = st.send_b if blocking else 0.0
        fs.append(st.f + st.fw + own_f + prev_f)
        bs.append(st.b + own_b + prev_b)
    delay = [] if blocking else [max(st.send_f, st.send_b) for st in row[:-1]]
    return fs, bs, delay
