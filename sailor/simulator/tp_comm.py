"""Tensor-parallel collectives of a layer whose time is estimated, not measured.

A profile measured at a TP degree times each layer with its TP all-reduces inside (the
profiler runs the layer on a real TP group). An estimate does not: the roofline
(:mod:`estimate_profile`) is compute and memory traffic only. A layer priced at a TP degree
nobody profiled (lookup rules 3 and 5) gets the all-reduces the engine runs in it added here,
over the GPU type's intra-node link, so that an unprofiled TP 4 of a narrow model is not taken
for four times faster than TP 1 when its all-reduces cost as much as its matmuls.

What a TP group all-reduces, per microbatch of ``b`` samples of ``s`` tokens, hidden ``h``
(Sailor's engine, ``megatron_patch.tp_layers`` and ``vocab_parallel``; Megatron-LM without
sequence parallelism runs the same; with it, a reduce-scatter and an all-gather move the
same bytes):

* a block: forward, the attention's and the MLP's row-parallel outputs (2 × ``b·s·h``);
  backward, the gradients of their column-parallel inputs (2 × ``b·s·h``), in the compute
  dtype;
* the embedding, split by vocabulary: forward, the rows each rank looked up (``b·s·h``; in
  fp32 as Sailor's engine sums them under autocast, in the compute dtype under
  ``fp16_optimizer``, as Megatron-LM's);
* the head, split by vocabulary: forward, the cross entropy's three reductions of one fp32
  value per token (max, sum of exponentials, target logit); backward, the gradient of its
  input (``b·s·h``).

An embedding and a head held whole on every rank (no ``vocab_parallel``) run no collective.

A collective is a ring over the TP group's ``t`` GPUs of one node, at least
:data:`MIN_COLLECTIVE_S`. With an all-reduce measured among GPUs of one node of the type
(``NetworkProfile.collectives``, scope ``intra_node``, with its bus bandwidth: what
``sailor profile network`` records on a GPU node), it takes that measurement's latency (scaled
to ``t`` ranks by the ring's steps) plus ``2(t-1)/t`` of the bytes at its bus bandwidth.
Otherwise ``2(t-1)`` steps of ``1/t`` of the bytes over a link: the network profile's
intra-node curve of the GPU type and group size (measured: taken as it is), else the spec
sheet's per-GPU link bandwidth derated by the GPU type's ``tp_link_efficiency`` over NVLink
(or any link but PCIe), ``tp_link_efficiency_pcie`` over PCIe (medians
:data:`~sailor.schemas.calibration.SPEC_LINK_EFFICIENCY` and ``PCIE_LINK_EFFICIENCY`` by
default, ranges in the uncertainty corners).
Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from sailor.schemas import BandwidthCurve, GPUSpec, ModelSpec, NetworkProfile
from sailor.schemas.calibration import (
    PCIE_LINK_EFFICIENCY,
    SPEC_LINK_EFFICIENCY,
    GPUCalibration,
    pcie_link,
)
from sailor.schemas.device_kind import spec_of
from sailor.schemas.network import CollectiveLatency
from sailor.simulator.network_model import guessed_link, intra_curve

__all__ = [
    "MIN_COLLECTIVE_S",
    "TPLink",
    "all_gather_s",
    "compute_part",
    "layer_comm_s",
    "model_comm_s",
    "ring_allreduce_s",
    "spec_link_efficiency",
    "tp_link",
]

MIN_COLLECTIVE_S = 10e-6
"""Least time of one collective: a kernel launch and NCCL's handshake among the GPUs of a
node, about 10 µs for the small messages of nccl-tests' all-reduce on NVLink and PCIe. The
cross entropy's reductions (4 bytes per token) cost this."""


_NO_CURVE = BandwidthCurve(coeffs=(0.0, 0.0, 1.0), max_gbps=1.0)
"""The curve of a link priced from a measured all-reduce (not read)."""


@dataclass(frozen=True)
class TPLink:
    """The link a TP group's collectives run over, and the fraction of it they reach; or
    (``bus_gbps``) a measured all-reduce among ``tp`` GPUs of one node: its bus bandwidth
    and latency."""

    curve: BandwidthCurve
    efficiency: float
    note: str
    bus_gbps: float | None = None
    latency_s: float = 0.0
    guessed: bool = False
    """A spec sheet's or a fallback's link, not a measurement (``note`` says which)."""


def _measured(network: NetworkProfile, gpu_type: str, tp: int) -> CollectiveLatency | None:
    """The intra-node all-reduce measured with a bus bandwidth on ``gpu_type`` whose rank
    count is nearest ``tp`` (the larger on a tie), any zone: a TP group stays in its node."""
    mine = [
        c
        for c in network.collectives
        if c.scope == "intra_node" and c.bus_gbps and c.endpoint.gpu_type == gpu_type
    ]
    if not mine:
        return None
    return min(mine, key=lambda c: (abs(c.ranks - tp), -c.ranks, c.bus_gbps or 0.0))


def spec_link_efficiency(
    specs: Mapping[str, GPUSpec], gpu_type: str, cal: GPUCalibration | None = None
) -> float:
    """The fraction of ``gpu_type``'s spec-sheet intra-node link its estimated TP all-reduces
    reach: ``cal``'s efficiency for the link's kind (PCIe or not), else the prior's median
    for it. A type without a spec sheet takes the non-PCIe one."""
    spec = spec_of(specs, gpu_type)
    link = spec.intra_node_link if spec is not None else ""
    if cal is None:
        return PCIE_LINK_EFFICIENCY if pcie_link(link) else SPEC_LINK_EFFICIENCY
    return cal.tp_link_efficiency_of(link)


def tp_link(
    network: NetworkProfile | None,
    specs: Mapping[str, GPUSpec],
    gpu_type: str,
    tp: int,
    spec_efficiency: float | None = None,
) -> TPLink:
    """What prices the all-reduces of a TP group of ``tp`` GPUs of ``gpu_type``: a measured
    intra-node all-reduce of the type, else its intra-node link
    (:func:`~sailor.simulator.network_model.intra_curve`; an empty profile without
    ``network``): a measured curve at efficiency 1, a spec sheet or guess derated by
    ``spec_efficiency`` (None: the prior's median for the link's kind,
    :func:`spec_link_efficiency`)."""
    if spec_efficiency is None:
        spec_efficiency = spec_link_efficiency(specs, gpu_type)
    net = network or NetworkProfile()
    c = _measured(net, gpu_type, tp)
    if c is not None and c.bus_gbps is not None:
        latency = c.latency_s * (tp - 1) / (c.ranks - 1)
        return TPLink(
            _NO_CURVE,
            1.0,
            f"all-reduce measured among {c.ranks} {gpu_type} of one node "
            f"({c.bus_gbps:.3g} GB/s bus, {c.latency_s * 1e6:.0f} us)",
            bus_gbps=c.bus_gbps,
            latency_s=latency,
        )
    curve, note = intra_curve(net, gpu_type, tp, specs)
    if guessed_link(note):
        return TPLink(curve, spec_efficiency, f"{note} x{spec_efficiency:.3g}", guessed=True)
    return TPLink(curve, 1.0, f"intra-node curve of {gpu_type} x{tp}")


def compute_part(measured: float, comm: float, roof: float) -> float:
    """The compute in a time ``measured`` at a TP degree: less its estimated all-reduces
    ``comm``, but at least the share ``roof/(roof + comm)`` the roofline estimate ``roof``
    gives compute (a link estimate above the measurement never leaves nothing)."""
    if comm <= 0 or roof <= 0:
        return measured
    return max(measured - comm, measured * roof / (roof + comm))


def ring_allreduce_s(link: TPLink, nbytes: float, ranks: int) -> float:
    """Seconds of a ring all-reduce of ``nbytes`` among ``ranks`` GPUs of one node."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    if link.bus_gbps is not None:
        moved = 2 * (ranks - 1) / ranks * nbytes
        return max(MIN_COLLECTIVE_S, link.latency_s + moved / (link.bus_gbps * 1e9))
    chunk = nbytes / ranks
    steps = 2 * (ranks - 1)
    step = link.curve.transfer_time(chunk) / link.efficiency
    return max(MIN_COLLECTIVE_S, steps * step)


def all_gather_s(link: TPLink, nbytes: float, ranks: int) -> float:
    """Seconds for a TP group of ``ranks`` GPUs of one node to all-gather a tensor of
    ``nbytes`` from its slices (a stage boundary's received activation, or gradient). A ring
    all-gather: each GPU receives the ``t-1`` slices it lacks, one per step. With a measured
    all-reduce, its latency plus those ``(t-1)/t`` of the bytes at its bus bandwidth; else
    ``t-1`` steps of one slice over the link, derated as the link is (the steps of
    :func:`ring_allreduce_s`'s curve path)."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    if link.bus_gbps is not None:
        return link.latency_s + (ranks - 1) / ranks * nbytes / (link.bus_gbps * 1e9)
    return (ranks - 1) * link.curve.transfer_time(nbytes / ranks) / link.efficiency


def model_comm_s(
    model: ModelSpec,
    tp: int,
    mbs: int,
    link: TPLink,
    vocab_parallel: bool,
    embed_bytes: float = 4.0,
) -> list[tuple[float, float]]:
    """:func:`layer_comm_s` of every layer of ``model``, in order."""
    return [
        layer_comm_s(model, tp, mbs, layer, link, vocab_parallel, embed_bytes)
        for layer in range(model.num_all_layers)
    ]


def layer_comm_s(
    model: ModelSpec,
    tp: int,
    mbs: int,
    layer: int,
    link: TPLink,
    vocab_parallel: bool,
    embed_bytes: float = 4.0,
) -> tuple[float, float]:
    """Forward and backward seconds of the TP all-reduces of ``layer`` for one microbatch
    (``embed_bytes``: per element of the embedding's all-reduce)."""
    if tp <= 1:
        return 0.0, 0.0
    tokens = mbs * model.seq_length
    act = float(tokens * model.hidden_size * model.param_bytes())
    kind = model.layer_kind(layer)
    if kind == "block":
        one = ring_allreduce_s(link, act, tp)
        return 2 * one, 2 * one
    if not vocab_parallel:
        return 0.0, 0.0
    if kind == "embedding":
        return ring_allreduce_s(link, embed_bytes * tokens * model.hidden_size, tp), 0.0
    return 3 * ring_allreduce_s(link, 4.0 * tokens, tp), ring_allreduce_s(link, act, tp)
