"""Profile lookup: per-layer time and size for (GPU type, TP degree, microbatch size).

Rules, in order (docs/simulator-model.md, section 1):

1. A measured or imported entry at exactly (GPU type, TP, mbs) wins.
2. A missing microbatch size at a profiled TP degree is **interpolated linearly in mbs**
   between its profiled neighbours; above the largest profiled size it is **scaled linearly**
   from the largest (``t(b) = t(b_max)·b/b_max``: large microbatches are throughput-bound);
   below the smallest it takes the smallest's time (small microbatches are latency-bound).
3. A missing TP degree of a profiled GPU type is the analytic estimate at that TP, scaled per
   layer by profile/estimate at the nearest profiled TP (needs the GPU's spec), plus the
   layer's TP all-reduces at that TP (:mod:`tp_comm`); the profile's time at the nearest TP
   holds its own all-reduces, which the scaling takes out in the share the estimate gives
   them.
4. A GPU type with estimated entries only (``sailor profile estimate``: the roofline times
   efficiencies measured on other GPUs) is read from them by rules 1-3, marked estimated.
   Estimated entries beside a measured or imported one of the same GPU type are not read.
5. A GPU type without any profile uses the analytic estimate (:mod:`estimate_profile`) plus
   the layer's TP all-reduces (:mod:`tp_comm`). Without a spec for it,
   :class:`ProfileLookupError` is raised.

Without a vocab-parallel head (an engine that replicates the embedding and head, as Sailor's
did before 2026-11-28) they are then timed whole at TP > 1 (:func:`_whole_ends`).

Then two corrections of known profile defects: an imported profiler's per-layer hook cost
is removed while a layer is latency-bound (``Calibration.profiler_overhead_s``; not from
profiles of Sailor's own profiler, which has no such hook), and an embedding
backward recorded below its forward is raised to the forward (a scatter-add moves the same
bytes as the gather). Last, forward and backward are multiplied by the GPU type's measured
``compute_scale`` (online calibration: how much slower or faster than its profile the
running cluster's GPUs of that type compute; 1 by default); the update time is not.
A profile whose ``update_s`` is one value for every layer is read as the
optimizer step of the profiling model (embedding + 2 blocks + head) and spread over layers by
parameter count.

Pure: no I/O; results are plain, immutable values. :func:`layer_sizes` and
:func:`layer_table` are memoized (:class:`~sailor.simulator.memo.IdentityMemo`: the profile
database and the model by identity, the rest by value), so the many ``simulate()`` calls of
a search share their tables.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from sailor.schemas import (
    GPUCalibration,
    GPUSpec,
    LayerProfile,
    LayerSize,
    ModelSpec,
    NetworkProfile,
    ProfileDB,
)
from sailor.schemas.deployment import Activations, MixedPrecision
from sailor.schemas.device_kind import spec_of
from sailor.schemas.profile import COMPUTE_ONLY_META, VOCAB_SPLIT_META
from sailor.simulator.estimate_profile import estimate_layer_size, estimate_layer_timing
from sailor.simulator.memo import IdentityMemo
from sailor.simulator.tp_comm import (
    TPLink,
    compute_part,
    layer_comm_s,
    model_comm_s,
    spec_link_efficiency,
    tp_link,
)

__all__ = [
    "PROFILING_MODEL_BLOCKS",
    "LayerCost",
    "ProfileLookupError",
    "StageCosts",
    "forget_tables",
    "layer_sizes",
    "layer_table",
    "measured_whole_ends",
]

PROFILING_MODEL_BLOCKS = 2
"""The original artifact timed the optimizer step of a model with the embedding, two blocks
and the head, and wrote that one figure on every layer."""


class ProfileLookupError(KeyError):
    """No profile and no spec sheet for a GPU type: nothing to simulate with. Not retryable."""


@dataclass(frozen=True)
class LayerCost:
    """Time of one layer for one microbatch, after lookup and corrections."""

    fwd_s: float
    bwd_s: float
    update_s: float
    estimated: bool


@dataclass(frozen=True)
class StageCosts:
    """Per-layer costs of every layer of the model for one (GPU type, TP, mbs)."""

    layers: tuple[LayerCost, ...]
    notes: tuple[str, ...]

    @property
    def estimated(self) -> bool:
        return any(c.estimated for c in self.layers)


_MEMO = IdentityMemo(1024)
"""Layer sizes and tables by (profiles, model) identity and the other inputs' values: a
search touches a few dozen (GPU type, TP, mbs) per calibration corner."""


def forget_tables() -> None:
    """Empty the memo (a benchmark timing a cold search)."""
    _MEMO.clear()


def layer_sizes(
    profiles: ProfileDB,
    model: ModelSpec,
    tp: int,
    vocab_parallel: bool = True,
    activations: Activations = "megatron",
) -> tuple[tuple[LayerSize, ...], tuple[str, ...]]:
    """Sizes of every layer at ``tp``: profiled where present, estimated otherwise.

    Without ``vocab_parallel`` (an engine that holds the embedding and head whole on every TP
    rank) the embedding's and head's sizes at ``tp`` are their sizes at TP 1, unless
    Sailor's own profiler measured them whole at ``tp`` (``measured``, before the engine
    split them: no split stamp in the profile's meta); imported, estimated and stamped sizes
    split them by vocabulary, as Megatron and Sailor's engine do. ``activations``: what an
    estimated block keeps (``Calibration.activations``)."""
    return _MEMO.get(
        (profiles, model),
        ("sizes", tp, vocab_parallel, activations),
        lambda: _layer_sizes(profiles, model, tp, vocab_parallel, activations),
    )


def _layer_sizes(
    profiles: ProfileDB,
    model: ModelSpec,
    tp: int,
    vocab_parallel: bool,
    activations: Activations,
) -> tuple[tuple[LayerSize, ...], tuple[str, ...]]:
    out: list[LayerSize] = []
    missing = 0
    # a measured size at ``tp`` is whole if measured before the engine split the vocabulary
    stamped = not vocab_parallel and _split_stamp(profiles, tp)
    for layer in range(model.num_all_layers):
        s = profiles.size(tp, layer)
        whole = not vocab_parallel and model.layer_kind(layer) != "block"
        measured_whole = s is not None and s.source == "measured" and not stamped
        if whole and not measured_whole:
            one = profiles.size(1, layer)
            if one is None:
                one = estimate_layer_size(model, 1, layer, vocab_parallel=False)
                missing += 1
            s = one.model_copy(update={"tp": tp})
        elif s is None:
            s = estimate_layer_size(model, tp, layer, activations=activations)
            missing += 1
        out.append(s)
    notes = (
        (f"layer sizes at tp={tp}: {missing} layer(s) estimated analytically",) if missing else ()
    )
    return tuple(out), notes


def _raw(
    profiles: ProfileDB, gpu_type: str, tp: int, mbs: int, n_layers: int, grid: list[int]
) -> tuple[list[tuple[float, float, float]], str]:
    """Profiled (fwd, bwd, update) per layer at a profiled TP, interpolated in mbs."""

    def at(b: int) -> list[tuple[float, float, float]]:
        rows: list[tuple[float, float, float]] = []
        for layer in range(n_layers):
            t = profiles.timing(gpu_type, tp, b, layer)
            if t is None:
                raise ProfileLookupError(
                    f"profile of {gpu_type} tp={tp} mbs={b} has no layer {layer}"
                )
            rows.append((t.fwd_s, t.bwd_s, t.update_s))
        return rows

    if mbs in grid:
        return at(mbs), ""
    lower = [b for b in grid if b < mbs]
    upper = [b for b in grid if b > mbs]
    if lower and upper:
        b0, b1 = lower[-1], upper[0]
        w = (mbs - b0) / (b1 - b0)
        r0, r1 = at(b0), at(b1)
        rows = [
            tuple((1 - w) * x0 + w * x1 for x0, x1 in zip(a, c, strict=True))
            for a, c in zip(r0, r1, strict=True)
        ]
        return [(r[0], r[1], r[2]) for r in rows], f"interpolated between mbs {b0} and {b1}"
    if lower:
        bmax = lower[-1]
        k = mbs / bmax
        return [(f * k, g * k, u) for f, g, u in at(bmax)], f"scaled linearly from mbs {bmax}"
    bmin = upper[0]
    return at(bmin), f"taken from the smallest profiled mbs {bmin}"


def _hook_corrected(
    rows: list[tuple[float, float, float]],
    big: list[tuple[float, float, float]],
    mbs: int,
    bmax: int,
    hook_s: float,
) -> list[tuple[float, float, float]]:
    """Remove the profiler's per-layer hook cost where the layer is latency-bound.

    While a layer is GPU-bound the hook's CPU work overlaps the GPU; while it is CPU-bound
    (launch latency) the hook adds to it. In training the CPU runs ahead, so a layer cannot
    be faster than its GPU-bound time, estimated as mbs x the per-sample time at the
    largest profiled microbatch.
    """
    out: list[tuple[float, float, float]] = []
    for (f, g, u), (fb, gb, _) in zip(rows, big, strict=True):
        tot = f + g
        if tot <= 0:
            out.append((f, g, u))
            continue
        floor = (fb + gb) * mbs / bmax
        new = max(tot - hook_s, min(floor, tot), 0.0)
        out.append((f * new / tot, g * new / tot, u))
    return out


def _spread_update(
    rows: list[tuple[float, float, float]], sizes: tuple[LayerSize, ...]
) -> tuple[list[tuple[float, float, float]], bool]:
    ups = {u for _, _, u in rows}
    params = [s.params for s in sizes]
    if len(rows) < 3 or len(ups) != 1 or len(set(params)) == 1:
        return rows, False
    u = ups.pop()
    p_prof = params[0] + params[-1] + PROFILING_MODEL_BLOCKS * params[1]
    if p_prof <= 0:
        return rows, False
    return [(f, g, u * p / p_prof) for (f, g, _), p in zip(rows, params, strict=True)], True


def _hooked(profiles: ProfileDB, gpu_type: str, tp: int, mbs: int) -> bool:
    """The profile at (``gpu_type``, ``tp``) was imported: made by a tool that synchronises
    the device in a hook around every layer, whose cost ``profiler_overhead_s`` is. Sailor's
    own profiler (``measured``) times layers with CUDA events and no per-layer hook."""
    t = profiles.timing(gpu_type, tp, mbs, 0)
    return t is not None and t.source == "imported"


def _real_grid(profiles: ProfileDB, gpu_type: str) -> dict[int, list[int]]:
    """TP -> microbatch sizes with a measured or imported (not estimated) entry."""
    out: dict[int, list[int]] = {}
    for tp, sizes in profiles.grid(gpu_type).items():
        real = []
        for b in sizes:
            t = profiles.timing(gpu_type, tp, b, 0)
            if t is not None and t.source != "estimated":
                real.append(b)
        if real:
            out[tp] = real
    return out


def layer_table(
    profiles: ProfileDB,
    model: ModelSpec,
    cal: GPUCalibration,
    gpu_specs: Mapping[str, GPUSpec],
    gpu_type: str,
    tp: int,
    mbs: int,
    vocab_parallel: bool = True,
    activations: Activations = "megatron",
    network: NetworkProfile | None = None,
    mixed_precision: MixedPrecision = "autocast",
) -> StageCosts:
    """Costs of every layer of ``model`` on ``gpu_type`` at ``tp`` and ``mbs``.

    Without ``vocab_parallel`` (an engine that computes the whole embedding and head on every
    TP rank, as Sailor's did before 2026-11-28) those two layers cost what they cost at TP 1,
    as their sizes do (:func:`layer_sizes`), unless Sailor's own profiler timed them whole at
    ``tp`` (``measured`` without the split stamp); imported, estimated and stamped timings at
    ``tp`` are a split head.
    ``activations``: what an estimated block keeps, which its estimated memory traffic
    reads (``Calibration.activations``). ``network``: its intra-node curves price the TP
    all-reduces of an estimated layer (rules 3 and 5; without it, or without a curve for the
    GPU type, the spec sheet's link). ``mixed_precision``: the embedding's all-reduce is
    fp32 under ``autocast`` (Sailor's engine), in the compute dtype under ``fp16_optimizer``."""
    spec = spec_of(gpu_specs, gpu_type)
    embed = 4 if mixed_precision == "autocast" else model.param_bytes()
    return _table(
        profiles, model, cal, spec, gpu_type, tp, mbs, vocab_parallel, activations, network, embed
    )


def _table(
    profiles: ProfileDB,
    model: ModelSpec,
    cal: GPUCalibration,
    spec: GPUSpec | None,
    gpu_type: str,
    tp: int,
    mbs: int,
    vocab_parallel: bool,
    activations: Activations,
    network: NetworkProfile | None,
    embed_bytes: int = 4,
) -> StageCosts:
    """:func:`layer_table` with the GPU's spec resolved, memoized (the network profile by
    identity, as the profiles)."""
    return _MEMO.get(
        (profiles, model, network),
        ("table", cal, spec, gpu_type, tp, mbs, vocab_parallel, activations, embed_bytes),
        lambda: _layer_table(
            profiles,
            model,
            cal,
            spec,
            gpu_type,
            tp,
            mbs,
            vocab_parallel,
            activations,
            network,
            embed_bytes,
        ),
    )


def _layer_table(
    profiles: ProfileDB,
    model: ModelSpec,
    cal: GPUCalibration,
    spec: GPUSpec | None,
    gpu_type: str,
    tp: int,
    mbs: int,
    vocab_parallel: bool,
    activations: Activations,
    network: NetworkProfile | None,
    embed_bytes: int,
) -> StageCosts:
    n = model.num_all_layers
    sizes, notes_l = layer_sizes(profiles, model, tp, activations=activations)
    notes = list(notes_l)
    grid = _real_grid(profiles, gpu_type)
    tag = f"{gpu_type} tp={tp} mbs={mbs}"
    # a GPU type with estimated entries only (``sailor profile estimate``: the roofline times
    # the efficiency measured on other GPUs) is read from them, marked estimated; beside a
    # measured or imported entry anywhere for the type, they are not read
    calibrated = False
    if not grid:
        grid = profiles.grid(gpu_type)
        calibrated = bool(grid)
        if calibrated:
            notes.append(f"{gpu_type}: estimated profile entries (sailor profile estimate)")

    # the profile the rows come from, and the precision it was measured in: what a measured
    # time holds (its compute, its all-reduces) is taken out in that precision
    profiled_at = tp if tp in grid else min(grid, key=lambda t: (abs(t - tp), t), default=None)
    measured_in = _profile_precision(profiles, gpu_type, profiled_at, grid)
    rescale = measured_in is not None and _differs(spec, measured_in, model.precision)
    if rescale and spec is None:
        raise ProfileLookupError(
            f"gpu_type={gpu_type!r}: layers profiled in {measured_in}, the plan computes in "
            f"{model.precision}, and no GPU spec to scale the times by: profile {gpu_type} in "
            f"{model.precision}"
        )
    held_model = model.model_copy(update={"precision": measured_in}) if rescale else model

    def estimate(t: int, m: ModelSpec = model) -> list[LayerProfile]:
        if spec is None:
            raise ProfileLookupError(
                f"gpu_type={gpu_type!r}: no profile at tp={tp} and no GPU spec to estimate one"
            )
        return [estimate_layer_timing(m, spec, t, mbs, layer, activations) for layer in range(n)]

    def link_at(t: int, priced: bool) -> TPLink:
        """The link the TP all-reduces at ``t`` are priced over. What a measured time holds
        is taken out at the evidence's point value, not the corner's: else a costlier link
        took more out, and a pessimistic corner priced a TP degree below the profiled one
        faster."""
        specs = {gpu_type: spec} if spec else {}
        eff = spec_link_efficiency(specs, gpu_type, cal if priced else None)
        return tp_link(network, specs, gpu_type, t, eff)

    def comm(t: int, priced: bool = True) -> list[tuple[float, float]]:
        """The TP all-reduces of every layer at ``t`` (none at TP 1); ``priced``: added to
        the table (a note says over what), not only taken out of a measured time (then in
        the dtype of the engine that measured it, not the planned one's)."""
        if t <= 1:
            return [(0.0, 0.0)] * n
        link = link_at(t, priced)
        if priced:
            notes.append(f"{tag}: estimated TP all-reduces at tp={t} over the {link.note}")
            return model_comm_s(model, t, mbs, link, vocab_parallel, embed_bytes)
        return model_comm_s(held_model, t, mbs, link, vocab_parallel, held_bytes(t))

    def held_bytes(t: int) -> float:
        """Bytes per element of the embedding's all-reduce a measured time at ``t`` holds:
        Sailor's profiler runs its engine (fp32 under autocast); an imported profile is
        Megatron's (the compute dtype it was measured in)."""
        entry = profiles.timing(gpu_type, t, grid[t][0], 0) if grid.get(t) else None
        if entry is not None and entry.source == "measured":
            return 4.0
        return held_model.param_bytes()

    def hook_free(
        t: int, rows: list[tuple[float, float, float]]
    ) -> list[tuple[float, float, float]]:
        """``rows`` profiled at ``t`` without an imported profiler's per-layer hook cost."""
        if cal.profiler_overhead_s <= 0 or not _hooked(profiles, gpu_type, t, grid[t][-1]):
            return rows
        bmax = grid[t][-1]
        big, _ = _raw(profiles, gpu_type, t, bmax, n, grid[t])
        return _hook_corrected(rows, big, mbs, bmax, cal.profiler_overhead_s)

    added = [(0.0, 0.0)] * n  # the TP all-reduces of an estimated layer
    raise0: float | None = None  # what the embedding's backward is raised to (its forward)
    # estimated entries that hold the compute alone: their TP all-reduces are priced here
    compute_only = calibrated and f"{gpu_type}.{COMPUTE_ONLY_META}" in profiles.meta
    if tp in grid:
        rows, how = _raw(profiles, gpu_type, tp, mbs, n, grid[tp])
        if how:
            notes.append(f"{tag}: {how}")
        rows = hook_free(tp, rows)
        if vocab_parallel and tp > 1 and measured_whole_ends(profiles, gpu_type, tp, mbs, n):
            notes.append(
                f"{tag}: the embedding and head were measured whole on every TP rank (Sailor's "
                "profiler before the engine split them by vocabulary): priced as measured, up "
                f"to {tp}x too slow; re-run `sailor profile layers` for {gpu_type} at tp={tp}"
            )
        rows, spread = _spread_update(rows, sizes)
        if spread:
            notes.append(
                f"{gpu_type} tp={tp}: update_s is one value for every layer; read as the "
                f"step of the profiling model (embedding + {PROFILING_MODEL_BLOCKS} blocks + "
                "head) and spread by parameter count"
            )
        estimated = calibrated
        if compute_only and tp > 1:
            added = comm(tp)
        elif vocab_parallel and tp > 1 and not measured_whole_ends(profiles, gpu_type, tp, mbs, n):
            # a measured split embedding's forward holds its all-reduce, its backward none:
            # the raise below is to the forward's compute (at least the share the roofline
            # gives compute, as rule 3 takes all-reduces out)
            # (layer 0 alone: this runs for every measured table at TP > 1)
            roof0 = (
                estimate_layer_timing(held_model, spec, tp, mbs, 0, activations).fwd_s
                if spec is not None
                else 0.0
            )
            held0, _ = layer_comm_s(
                held_model, tp, mbs, 0, link_at(tp, False), vocab_parallel, held_bytes(tp)
            )
            raise0 = compute_part(rows[0][0], held0, roof0)
    elif profiled_at is not None:  # a profile at another TP degree
        near = profiled_at
        base, _ = _raw(profiles, gpu_type, near, mbs, n, grid[near])
        base = hook_free(near, base)  # before the scaling, as at rule 1
        base, _ = _spread_update(
            base, layer_sizes(profiles, model, near, activations=activations)[0]
        )
        est_tp, est_near = estimate(tp, held_model), estimate(near, held_model)
        rows = []
        # the profile at ``near`` holds its all-reduces: its compute (the time less their
        # estimate; at least the share the estimate gives compute, when the measured time
        # is below the roofline plus that estimate) scales by the roofline's ratio, and the
        # all-reduces at ``tp`` are added (all in the precision the profile was measured in;
        # another plan's is priced below)
        added = comm(tp)
        held = [(0.0, 0.0)] * n if compute_only else comm(near, priced=False)
        zipped = zip(base, est_tp, est_near, held, strict=True)
        for (f, g, u), a, b, (nf, nb) in zipped:
            rows.append(
                (
                    _scaled(f, nf, a.fwd_s, b.fwd_s),
                    _scaled(g, nb, a.bwd_s, b.bwd_s),
                    u * (a.update_s / b.update_s if b.update_s > 0 else 1.0),
                )
            )
        notes.append(
            f"{tag}: TP degree not profiled; profile at tp={near} scaled by the analytic "
            "estimate's ratio, plus the TP all-reduces"
        )
        estimated = True
    else:
        rows = [(e.fwd_s, e.bwd_s, e.update_s) for e in estimate(tp)]
        added = comm(tp)
        notes.append(
            f"{tag}: no profile for this GPU type; analytic roofline estimate plus the TP "
            "all-reduces"
        )
        estimated = True
    if rescale and spec is not None and measured_in is not None:
        # layers measured in another precision than the plan computes in (an fp32 job on
        # types profiled under bf16 autocast): priced at the profile's, fp32 ran up to the
        # peak ratio (16x on an A100) too fast
        ratio = _precision_ratio(model, held_model, spec, tp, mbs, activations)
        comm_note = ""
        if tp in grid and tp > 1 and not compute_only:
            comm_note = "; the TP all-reduces measured in them by the plan's bytes"
            # a time measured at ``tp`` holds the layer's all-reduces: only its compute
            # scales by the roofline's ratio; the all-reduces by the link's (the plan's
            # bytes over the profile's, on the same link: 2x for fp32 where bandwidth-bound,
            # 1x where latency-bound or already fp32, as the embedding's sum under autocast)
            rows = _rescaled_with_comm(
                rows,
                ratio,
                model,
                held_model,
                spec,
                tp,
                mbs,
                activations,
                link_at(tp, False),
                vocab_parallel and not measured_whole_ends(profiles, gpu_type, tp, mbs, n),
                held_bytes(tp),
                embed_bytes,
            )
        else:  # the rows are compute alone
            rows = [(f * r, g * r, u) for (f, g, u), r in zip(rows, ratio, strict=True)]
        if raise0 is not None:
            raise0 *= ratio[0]
        notes.append(
            f"{tag}: layers profiled in {measured_in}, priced in {model.precision}: forward "
            f"and backward compute scaled by the roofline's ratio, x{min(ratio):.3g}-"
            f"x{max(ratio):.3g} (peaks {_peak(spec, model.precision):g} vs "
            f"{_peak(spec, measured_in):g} TFLOPS; memory-bound layers by their bytes)"
            f"{comm_note}, marked estimated"
        )
        estimated = True
    out: list[LayerCost] = []
    k = cal.compute_scale
    if k != 1.0:
        notes.append(f"{gpu_type}: layer compute x{k:.3g} (calibrated compute_scale)")
    # the TP all-reduces of an estimated layer are added last: a link's time, neither a
    # compute time the calibrated scale multiplies nor part of the embedding's raise
    for layer, ((f, g, u), (cf, cb)) in enumerate(zip(rows, added, strict=True)):
        if layer == 0 and g < (f if raise0 is None else raise0):
            g = f if raise0 is None else raise0
        out.append(LayerCost(fwd_s=f * k + cf, bwd_s=g * k + cb, update_s=u, estimated=estimated))
    if not vocab_parallel and tp > 1:
        _whole_ends(
            profiles, model, cal, spec, gpu_type, tp, mbs, activations, grid, out, notes, network
        )
    return StageCosts(layers=tuple(out), notes=tuple(notes))


def _profile_precision(
    profiles: ProfileDB, gpu_type: str, t: int | None, grid: Mapping[int, list[int]]
) -> str | None:
    """The precision ``gpu_type``'s profile at TP ``t`` was measured in (its embedding's
    entry at the smallest microbatch size); None: no profile, or not recorded."""
    if t is None or not grid.get(t):
        return None
    entry = profiles.timing(gpu_type, t, grid[t][0], 0)
    return entry.precision if entry is not None else None


def _differs(spec: GPUSpec | None, measured_in: str, precision: str) -> bool:
    """Whether a time measured in ``measured_in`` is not one in ``precision``: they differ,
    unless both are 16-bit and ``spec`` gives them the same peak (fp16 and bf16 move the
    same bytes); without a spec two precisions always differ."""
    if measured_in == precision:
        return False
    if spec is not None and "fp32" not in (measured_in, precision):
        return _peak(spec, measured_in) != _peak(spec, precision)
    return True


def _peak(spec: GPUSpec | None, precision: str) -> float:
    """The catalog's peak TFLOPS of ``spec`` in ``precision`` (0 without a spec). Sailor's
    engine runs fp32 matmuls as fp32, not TF32: it never sets ``allow_tf32`` and torch's
    default leaves it off for matmuls, so fp32 is priced at the fp32 peak."""
    return spec.peak_tflops(precision) if spec is not None else 0.0


def _precision_ratio(
    model: ModelSpec,
    there: ModelSpec,
    spec: GPUSpec,
    tp: int,
    mbs: int,
    activations: Activations,
) -> list[float]:
    """Per layer, the roofline's time in the plan's precision (``model``'s) over its time in
    the profile's (``there``'s): the compute-bound part scales by the peaks' ratio, the
    memory-bound part by the bytes' (``estimate_layer_timing``: the larger of flops over
    peak and bytes over bandwidth). An upper bound for a compute-bound layer where the
    16-bit kernels reach a larger share of their peak than fp32 ones do."""
    out = []
    for layer in range(model.num_all_layers):
        a = estimate_layer_timing(model, spec, tp, mbs, layer, activations).fwd_s
        b = estimate_layer_timing(there, spec, tp, mbs, layer, activations).fwd_s
        out.append(a / b if b > 0 else 1.0)
    return out


def _rescaled_with_comm(
    rows: list[tuple[float, float, float]],
    ratio: list[float],
    model: ModelSpec,
    there: ModelSpec,
    spec: GPUSpec,
    tp: int,
    mbs: int,
    activations: Activations,
    link: TPLink,
    vocab_parallel: bool,
    held_embed_bytes: float,
    embed_bytes: float,
) -> list[tuple[float, float, float]]:
    """``rows`` measured at ``tp`` in ``there``'s precision, priced in ``model``'s: each
    time less its all-reduces (:func:`~sailor.simulator.tp_comm.compute_part`, the estimate
    over ``link`` in the profile's bytes) is scaled by ``ratio``; the rest, the all-reduces
    as measured, by the estimate's ratio of the plan's bytes to the profile's."""
    held = model_comm_s(there, tp, mbs, link, vocab_parallel, held_embed_bytes)
    plan = model_comm_s(model, tp, mbs, link, vocab_parallel, embed_bytes)
    out = []
    for layer, (f, g, u) in enumerate(rows):
        roof = estimate_layer_timing(there, spec, tp, mbs, layer, activations)
        parts = (
            (f, held[layer][0], plan[layer][0], roof.fwd_s),
            (g, held[layer][1], plan[layer][1], roof.bwd_s),
        )
        f2, g2 = (
            _compute_and_comm(measured, comm, to, r, ratio[layer])
            for measured, comm, to, r in parts
        )
        out.append((f2, g2, u))
    return out


def _compute_and_comm(
    measured: float, comm: float, plan_comm: float, roof: float, r: float
) -> float:
    """A time ``measured`` holding all-reduces estimated at ``comm``, in another precision:
    its compute times ``r``, its all-reduces times ``plan_comm/comm``."""
    compute = compute_part(measured, comm, roof)
    return compute * r + (measured - compute) * (plan_comm / comm if comm > 0 else 1.0)


def _scaled(measured: float, comm: float, roof_tp: float, roof_near: float) -> float:
    """A layer's compute at another TP degree: ``measured`` at the nearest one less its
    estimated all-reduces ``comm`` there (:func:`~sailor.simulator.tp_comm.compute_part`),
    times the roofline's ratio ``roof_tp/roof_near``."""
    if roof_near <= 0:
        return measured
    return compute_part(measured, comm, roof_near) * roof_tp / roof_near


def measured_whole_ends(
    profiles: ProfileDB, gpu_type: str, tp: int, mbs: int, n_layers: int
) -> bool:
    """Whether Sailor's profiler measured the head at ``tp`` before the engine split it: a
    ``measured`` entry without the split's meta stamp (imported profiles are Megatron's,
    split; their source is ``imported``)."""
    if f"{gpu_type}.tp{tp}.{VOCAB_SPLIT_META}" in profiles.meta:
        return False
    head = profiles.timing(gpu_type, tp, mbs, n_layers - 1)
    return head is not None and head.source == "measured"


def _whole_ends(
    profiles: ProfileDB,
    model: ModelSpec,
    cal: GPUCalibration,
    spec: GPUSpec | None,
    gpu_type: str,
    tp: int,
    mbs: int,
    activations: Activations,
    grid: dict[int, list[int]],
    out: list[LayerCost],
    notes: list[str],
    network: NetworkProfile | None,
) -> None:
    """Time the embedding and the head in ``out`` as an engine that replicates them runs them
    at ``tp``: whole on every TP rank. In order: as Sailor's own profiler timed them at ``tp``
    before the engine split them (whole already; no split stamp); else as it timed them so at
    the nearest TP degree it profiled (a whole layer's time does not depend on the TP
    degree); else their TP 1 time (a split, imported or estimated time scaled to TP 1 by the
    estimate, which splits them); else, when nothing prices TP 1 (no spec sheet), their split
    time at ``tp`` times ``tp``."""
    tag = f"{gpu_type} tp={tp} mbs={mbs}"
    for layer in range(model.num_all_layers):
        if model.layer_kind(layer) == "block" or _measured(profiles, gpu_type, tp, grid, layer):
            continue
        near = [t for t in grid if _measured(profiles, gpu_type, t, grid, layer)]
        if near:
            t = min(near, key=lambda t: (abs(t - tp), t))
            # the table at ``t`` as the profile has it (the split head's path: no recursion)
            at = _table(profiles, model, cal, spec, gpu_type, t, mbs, True, activations, network)
            out[layer] = at.layers[layer]
            notes.append(f"{tag}: layer {layer} whole on every TP rank, as measured at tp={t}")
            continue
        try:
            one = _table(profiles, model, cal, spec, gpu_type, 1, mbs, True, activations, network)
        except ProfileLookupError:
            c = out[layer]
            out[layer] = LayerCost(c.fwd_s * tp, c.bwd_s * tp, c.update_s * tp, estimated=True)
            notes.append(
                f"{tag}: layer {layer} whole on every TP rank: its split time x {tp} "
                "(nothing prices tp=1)"
            )
            continue
        out[layer] = one.layers[layer]
        notes.extend(n for n in one.notes if n not in notes)
        notes.append(f"{tag}: layer {layer} whole on every TP rank, timed at tp=1")


def _measured(
    profiles: ProfileDB, gpu_type: str, tp: int, grid: dict[int, list[int]], layer: int
) -> bool:
    """Sailor's own profiler timed ``layer`` whole at ``tp`` (at its largest measured or
    imported microbatch size there; estimated entries are not timings): measured, by an
    engine before the vocabulary split (the profile has no split stamp for ``tp``)."""
    sizes = grid.get(tp)
    if not sizes or f"{gpu_type}.tp{tp}.{VOCAB_SPLIT_META}" in profiles.meta:
        return False
    t = profiles.timing(gpu_type, tp, max(sizes), layer)
    return t is not None and t.source == "measured"


def _split_stamp(profiles: ProfileDB, tp: int) -> bool:
    """Whether Sailor's profiler measured some GPU type at ``tp`` with the vocabulary split
    (sizes are per model, not per GPU type)."""
    return tp > 1 and any(k.endswith(f".tp{tp}.{VOCAB_SPLIT_META}") for k in profiles.meta)
