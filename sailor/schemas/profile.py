"""Per-layer profiles: time and size of each layer per (GPU type, TP degree, microbatch size).

A profile entry says where it came from: ``measured`` (our profiler), ``imported`` (converted
from another tool's measurements) or ``estimated`` (analytic roofline). Measured and imported
entries always win over estimates when the database is queried.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, Self

from pydantic import Field, model_validator

from sailor.schemas._base import Frozen, field_error
from sailor.schemas.model import LayerKind
from sailor.schemas.precision import Precision

__all__ = [
    "COMPUTE_ONLY_META",
    "VOCAB_SPLIT_META",
    "DeviceOverhead",
    "FrameworkTime",
    "HostSharing",
    "LayerMemory",
    "LayerProfile",
    "LayerSize",
    "ProfileDB",
    "ProfileSource",
]

ProfileSource = Literal["measured", "imported", "estimated"]

_RANK: dict[str, int] = {"measured": 0, "imported": 1, "estimated": 2}


class LayerProfile(Frozen):
    """Time of one layer on one GPU type at one TP degree and microbatch size."""

    gpu_type: str = Field(description="GPU type.")
    tp: int = Field(gt=0, description="Tensor-parallel degree.")
    microbatch_size: int = Field(gt=0, description="Microbatch size (samples).")
    layer: int = Field(ge=0, description="Global layer index (0 = embedding).")
    kind: LayerKind = Field(description="Layer kind.")
    fwd_s: float = Field(ge=0, description="Forward time, s.")
    bwd_s: float = Field(ge=0, description="Backward time, s.")
    update_s: float = Field(ge=0, description="Optimizer update time of this layer, s.")
    fwd_spread_s: float = Field(default=0.0, ge=0, description="Std. dev. of forward time.")
    bwd_spread_s: float = Field(default=0.0, ge=0, description="Std. dev. of backward time.")
    source: ProfileSource = Field(default="measured", description="Provenance.")
    precision: Precision | None = Field(
        default=None,
        description=(
            "Precision the layer computed in (measured: the autocast dtype, fp32 without "
            "autocast; estimated: the model's precision the roofline was taken in). None: not "
            "recorded (imported profiles, and estimated or measured ones written before)."
        ),
    )


class LayerSize(Frozen):
    """Sizes of one layer for one TP degree (per TP rank), per sample of a microbatch."""

    tp: int = Field(gt=0, description="Tensor-parallel degree.")
    layer: int = Field(ge=0, description="Global layer index.")
    params: int = Field(ge=0, description="Parameters held by one TP rank.")
    activation_bytes_per_sample: int = Field(
        ge=0, description="Activation bytes kept for backward per sample, per TP rank."
    )
    output_bytes_per_sample: int = Field(
        ge=0, description="Bytes of the layer's output per sample (what a stage boundary sends)."
    )
    input_bytes_per_sample: int = Field(default=0, ge=0, description="Input bytes per sample.")
    per_microbatch_bytes: int = Field(
        default=0,
        ge=0,
        description="Bytes saved for backward once per microbatch whatever its size, per TP "
        "rank: the intercept of the saved bytes fitted over microbatch sizes (the slope is "
        "activation_bytes_per_sample). Under autocast mostly the compute-dtype copy of the "
        "layer's weights (schemas.precision); 0 when not measured (one microbatch size, "
        "imported or estimated sizes).",
    )
    source: ProfileSource = Field(default="measured", description="Provenance.")
    precision: Precision | None = Field(
        default=None,
        description=(
            "Precision the layer computed in when its bytes were measured (the saved "
            "activations are that wide). Sizes are per model, read for every GPU type: a "
            "database holds measured or imported sizes in one precision. None: not recorded "
            "(imported and estimated sizes, measured ones written before)."
        ),
    )


class LayerMemory(Frozen):
    """Memory one layer needs on a GPU at a TP degree and microbatch size (bytes, per GPU).

    What the Varuna-style memory profiles hold: the footprint of the layer's weights, gradients,
    optimizer state and activations of one microbatch, as measured by the tool that made them.
    """

    gpu_type: str = Field(default="*", description="GPU type, '*' when the source does not say.")
    tp: int = Field(gt=0, description="Tensor-parallel degree.")
    microbatch_size: int = Field(gt=0, description="Microbatch size.")
    layer: int = Field(ge=0, description="Global layer index.")
    bytes: int = Field(ge=0, description="Bytes per GPU.")
    source: ProfileSource = Field(default="imported", description="Provenance.")


class DeviceOverhead(Frozen):
    """Memory a training process uses beyond model state and activations, per GPU type.

    Context, allocator fragmentation, communication buffers. One value per GPU type and
    TP degree, with the measurement it came from.
    """

    gpu_type: str = Field(description="GPU type.")
    tp: int = Field(default=1, gt=0, description="Tensor-parallel degree.")
    bytes: int = Field(ge=0, description="Overhead bytes per GPU.")
    source: str = Field(description="Measurement it came from.")


class FrameworkTime(Frozen):
    """Time the training framework spends per iteration outside the profiled layers.

    Measured on the real training engine running a model whose layers cost almost nothing
    (``sailor.profiler.framework_time``), minus that model's own layer profile. Absent (all
    zero) for imported profiles: their framework's fixed costs are in the calibration
    (``GPUCalibration.sync_fixed_s``) or unknown.
    """

    gpu_type: str = Field(description="GPU type (device) measured.")
    iteration_s: float = Field(
        default=0.0,
        ge=0,
        description=(
            "Fixed time per iteration on every rank (zeroing gradients, the schedule's set-up, "
            "the optimizer's per-step work beyond the per-layer updates, the end of the "
            "iteration on one rank), s."
        ),
    )
    microbatch_s: float = Field(
        default=0.0,
        ge=0,
        description=(
            "Time per microbatch per stage outside the layers (schedule step, loss scaling, "
            "autograd entry), s."
        ),
    )
    sample_s: float = Field(
        default=0.0,
        ge=0,
        description=(
            "Data-pipeline time per sample on a stage that reads the data (first and last "
            "stage), s."
        ),
    )
    source: str = Field(description="Measurement it came from.")


class HostSharing(Frozen):
    """How ranks started on one host share its cores (CPU devices; absent for GPUs).

    CPU test scaffolding: measured by ``sailor.profiler.cpu_host.sharing`` with the profiled
    model's own layers, never on the plans it predicts; read only by
    ``sailor.simulator.cpu_host`` (a plan's ranks all on one host, as ``launch_local`` runs
    them), never by the GPU path. Kept here so that profile files holding it still load.
    """

    gpu_type: str = Field(description="Device kind measured (e.g. cpu).")
    cores: int = Field(ge=1, description="Cores of the host the ranks may run on.")
    slowdown: tuple[float, ...] = Field(
        min_length=1,
        description=(
            "slowdown[n-1]: the time of the model's work while n ranks compute at once, over "
            "its time alone (slowdown[0] = 1)."
        ),
    )
    wake_s: float = Field(
        ge=0,
        description=(
            "Mean extra delay before a rank blocked on a receive runs again when its message "
            "arrives while at least `cores` ranks compute, s."
        ),
    )
    rendezvous_s: float = Field(
        default=0.0,
        ge=0,
        description=(
            "Mean wait of a receive posted after its message was sent, while a core is free, s. "
            "The backend hands an unmatched send over only when the receiver asks for it "
            "(gloo's rendezvous: notify, then the sender's communication thread writes)."
        ),
    )
    rendezvous_busy_s: float = Field(
        default=0.0,
        ge=0,
        description=(
            "The same wait when the receive is posted while at least `cores` ranks compute: "
            "the sender's communication thread waits for a core, s."
        ),
    )
    collective_wake_s: float = Field(
        default=0.0,
        ge=0,
        description=(
            "Mean extra time of a collective entered after computing (the backend's threads "
            "asleep) over one entered right after another, s. Older probes; the simulator "
            "uses it only when `allreduce_after_compute_s` is empty."
        ),
    )
    allreduce_after_compute_s: tuple[float, ...] = Field(
        default=(),
        description=(
            "[n-2] for n = 2, 3, ...: mean time of a small all-reduce among n ranks that enter "
            "it right after computing the model's forward and backward (the engine's first "
            "gradient collective of an iteration), from the later entry to the later exit, s."
        ),
    )
    allreduce_after_allreduce_s: tuple[float, ...] = Field(
        default=(),
        description=(
            "[n-2]: the same for an all-reduce entered right after another one in another "
            "group (the engine's next gradient collectives), s."
        ),
    )
    allreduce_after_update_s: tuple[float, ...] = Field(
        default=(),
        description=(
            "[n-2]: the same for an all-reduce of one scalar entered right after the "
            "optimizer step (the engine's loss all-reduce that ends an iteration), s."
        ),
    )
    allreduce_probe_bytes: int = Field(
        default=0,
        ge=0,
        description=(
            "Bytes of the gradient all-reduces timed for `allreduce_after_compute_s` and "
            "`allreduce_after_allreduce_s` (their bandwidth time is part of the figure)."
        ),
    )
    pinned: bool = Field(
        default=False,
        description=(
            "Measured with rank r bound to core r % cores (launch_local(pin_cores=True)): the "
            "simulator then shares each core among the ranks bound to it."
        ),
    )
    slowdown_spread: tuple[float, ...] = Field(
        default=(), description="Standard deviation of each slowdown factor across its ranks."
    )
    source: str = Field(description="Measurement it came from.")

    @model_validator(mode="after")
    def _check(self) -> HostSharing:
        if any(f <= 0 for f in self.slowdown):
            raise field_error("slowdown", self.slowdown, "factors must be > 0")
        entries = (
            ("allreduce_after_compute_s", self.allreduce_after_compute_s),
            ("allreduce_after_allreduce_s", self.allreduce_after_allreduce_s),
            ("allreduce_after_update_s", self.allreduce_after_update_s),
        )
        for name, values in entries:
            if any(v < 0 for v in values):
                raise field_error(name, values, "times must be >= 0")
            if len(values) != len(self.allreduce_after_compute_s):
                raise field_error(
                    name,
                    values,
                    f"needs one entry per rank count, as allreduce_after_compute_s has "
                    f"{len(self.allreduce_after_compute_s)}",
                )
        return self

    def allreduce_entry_s(self, after: Literal["compute", "allreduce", "update"], n: int) -> float:
        """Measured mean time of an all-reduce among ``n`` ranks entered after ``after``
        (0 for one rank; past the measured rank counts, the largest one measured)."""
        values = {
            "compute": self.allreduce_after_compute_s,
            "allreduce": self.allreduce_after_allreduce_s,
            "update": self.allreduce_after_update_s,
        }[after]
        if n <= 1 or not values:
            return 0.0
        return values[min(n, len(values) + 1) - 2]

    @property
    def measures_allreduce_entries(self) -> bool:
        """Whether the probe timed the engine's all-reduces as it enters them."""
        return bool(self.allreduce_after_compute_s)

    def factor(self, n: int) -> float:
        """Slowdown while ``n`` ranks compute; past the measured range, a fair share of the
        last measured factor (``n`` ranks take ``n / K`` times as long as ``K`` did)."""
        if n <= 1:
            return 1.0 if n <= 0 else self.slowdown[0]
        k = len(self.slowdown)
        if n <= k:
            return self.slowdown[n - 1]
        return self.slowdown[-1] * n / k


COMPUTE_ONLY_META = "estimated_compute_only"
"""Profile meta ``"{gpu}.estimated_compute_only"``: that GPU type's estimated entries
(``sailor profile estimate``) hold its compute alone, and the simulator adds the TP
all-reduces at TP > 1 over the plan's link, as it does for a TP degree nobody profiled (the
calibration's link efficiency, the network profile's intra-node curve). Estimated entries
without it (written before 2026-11-28) hold the measured GPUs' all-reduces in their
efficiency."""

VOCAB_SPLIT_META = "vocab_parallel"
"""Profile meta ``"{gpu}.tp{t}.vocab_parallel"``: Sailor's profiler measured that GPU type at TP
``t`` with the embedding and head split by vocabulary (every run since the engine split them;
a ``measured`` TP > 1 entry without it timed an older engine's whole head)."""


class ProfileDB(Frozen):
    """All profiles of one model."""

    model: str = Field(description="Model name these profiles belong to.")
    timings: tuple[LayerProfile, ...] = Field(default=(), description="Per-layer timings.")
    sizes: tuple[LayerSize, ...] = Field(default=(), description="Per-layer sizes.")
    overheads: tuple[DeviceOverhead, ...] = Field(default=(), description="Memory overheads.")
    framework: tuple[FrameworkTime, ...] = Field(
        default=(),
        description="Framework time outside the layers, per GPU type (at most one each).",
    )
    hosts: tuple[HostSharing, ...] = Field(
        default=(),
        description="How co-located ranks share a host's cores, per device kind (at most one "
        "each).",
    )
    memory: tuple[LayerMemory, ...] = Field(
        default=(), description="Per-layer memory footprints (e.g. imported Varuna profiles)."
    )
    meta: dict[str, str] = Field(
        default_factory=dict, description="Device, software versions, date, tool."
    )

    @model_validator(mode="after")
    def _check(self) -> ProfileDB:
        precisions: dict[tuple[str, int], dict[str, LayerProfile]] = {}
        for t in self.timings:
            if t.bwd_s < 0 or t.fwd_s < 0:
                raise field_error("timings", t, "negative time")
            if t.precision is not None and t.source != "estimated":
                precisions.setdefault((t.gpu_type, t.tp), {}).setdefault(t.precision, t)
        for (gpu, tp), seen in precisions.items():
            if len(seen) > 1:
                # the simulator reads one precision per GPU type and TP degree (its embedding's
                # entry at the least microbatch size) and scales every entry from it
                where = ", ".join(
                    f"{p} (e.g. mbs={e.microbatch_size} layer={e.layer})"
                    for p, e in sorted(seen.items())
                )
                raise field_error(
                    "timings.precision",
                    sorted(seen),
                    f"{gpu} at tp={tp} has measured or imported layers in more than one "
                    f"precision: {where}; profile it in one precision (another profile "
                    "file for the other)",
                )
        size_precisions: dict[str, LayerSize] = {}
        for s in self.sizes:
            if s.precision is not None and s.source != "estimated":
                size_precisions.setdefault(s.precision, s)
        if len(size_precisions) > 1:
            # sizes are keyed by (TP, layer) alone and price every GPU type's memory: an fp32
            # run's activation bytes would price a 16-bit GPU's at twice its size
            where = ", ".join(
                f"{p} (e.g. tp={e.tp} layer={e.layer})" for p, e in sorted(size_precisions.items())
            )
            raise field_error(
                "sizes.precision",
                sorted(size_precisions),
                f"measured or imported layer sizes in more than one precision: {where}; sizes "
                "are per model, read for every GPU type: keep one precision's sizes in a file "
                "(another profile file for the other)",
            )
        kinds = [f.gpu_type for f in self.framework]
        if len(kinds) != len(set(kinds)):
            raise field_error("framework", kinds, "at most one entry per GPU type")
        hosts = [h.gpu_type for h in self.hosts]
        if len(hosts) != len(set(hosts)):
            raise field_error("hosts", hosts, "at most one entry per device kind")
        return self

    # Indexing is computed once per (immutable) instance.
    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Self:
        """A copy without the lookup caches of this instance (they index the old data)."""
        copy = super().model_copy(update=update, deep=deep)
        for key in ("_tidx", "_sidx", "_grids"):
            copy.__dict__.pop(key, None)
        return copy

    def _timing_index(self) -> dict[tuple[str, int, int, int], LayerProfile]:
        idx = self.__dict__.get("_tidx")
        if idx is None:
            idx = {}
            for t in self.timings:
                key = (t.gpu_type, t.tp, t.microbatch_size, t.layer)
                old = idx.get(key)
                if old is None or _RANK[t.source] < _RANK[old.source]:
                    idx[key] = t
            self.__dict__["_tidx"] = idx
        return idx

    def _size_index(self) -> dict[tuple[int, int], LayerSize]:
        idx = self.__dict__.get("_sidx")
        if idx is None:
            idx = {}
            for s in self.sizes:
                key = (s.tp, s.layer)
                old = idx.get(key)
                if old is None or _RANK[s.source] < _RANK[old.source]:
                    idx[key] = s
            self.__dict__["_sidx"] = idx
        return idx

    def timing(self, gpu_type: str, tp: int, mbs: int, layer: int) -> LayerProfile | None:
        return self._timing_index().get((gpu_type, tp, mbs, layer))

    def size(self, tp: int, layer: int) -> LayerSize | None:
        return self._size_index().get((tp, layer))

    def gpu_types(self) -> list[str]:
        return sorted({t.gpu_type for t in self.timings})

    def grid(self, gpu_type: str) -> dict[int, list[int]]:
        """TP degree -> sorted microbatch sizes profiled for ``gpu_type`` (a fresh copy; the
        index behind it is built once: every simulated stage asks, ~1 ms a scan)."""
        grids = self.__dict__.get("_grids")
        if grids is None:
            acc: dict[str, dict[int, set[int]]] = {}
            for g, tp, mbs, _ in self._timing_index():
                acc.setdefault(g, {}).setdefault(tp, set()).add(mbs)
            grids = {
                g: {tp: sorted(v) for tp, v in sorted(by_tp.items())} for g, by_tp in acc.items()
            }
            self.__dict__["_grids"] = grids
        return {tp: list(v) for tp, v in grids.get(gpu_type, {}).items()}

    def overhead(self, gpu_type: str, tp: int) -> DeviceOverhead | None:
        exact = [o for o in self.overheads if o.gpu_type == gpu_type and o.tp == tp]
        if exact:
            return exact[0]
        any_tp = [o for o in self.overheads if o.gpu_type == gpu_type]
        return any_tp[0] if any_tp else None

    def framework_time(self, gpu_type: str) -> FrameworkTime | None:
        """The measured framework time of ``gpu_type``, if any."""
        for f in self.framework:
            if f.gpu_type == gpu_type:
                return f
        return None

    def host_sharing(self, gpu_type: str) -> HostSharing | None:
        """The measured host sharing of ``gpu_type``, if any."""
        for h in self.hosts:
            if h.gpu_type == gpu_type:
                return h
        return None

    def is_estimated(self, gpu_type: str) -> bool:
        srcs = {t.source for t in self.timings if t.gpu_type == gpu_type}
        return bool(srcs) and srcs <= {"estimated"}

    def merged(self, other: ProfileDB) -> ProfileDB:
        """Union of two databases of one model; on conflicts the better source wins."""
        if other.model != self.model:
            raise field_error("model", other.model, f"cannot merge into profiles of {self.model}")
        return ProfileDB(
            model=self.model,
            timings=other.timings + self.timings,
            sizes=other.sizes + self.sizes,
            memory=other.memory + self.memory,
            overheads=other.overheads
            + tuple(
                o
                for o in self.overheads
                if not any(p.gpu_type == o.gpu_type and p.tp == o.tp for p in other.overheads)
            ),
            framework=other.framework
            + tuple(f for f in self.framework if other.framework_time(f.gpu_type) is None),
            hosts=other.hosts
            + tuple(h for h in self.hosts if other.host_sharing(h.gpu_type) is None),
            meta={**self.meta, **other.meta},
        )
