"""One training run's configuration: ``TrainingConfig``, the file every worker is given.

What to train (model source), on what (data), and how (optimizer, LR schedule, precision,
gradient clipping, evaluation, checkpointing, metrics). The controller hands the same file to
every rank; a rank validates it before any process group starts, so a wrong field is refused
with its name and value (``field_error``) and no rank waits on a peer that already failed.

Also here, because they are pure functions of the config and every rank must agree on them
bit for bit: the learning rate at a step (:meth:`ScheduleConfig.lr_at`) and whether a
parameter gets weight decay (:meth:`OptimizerConfig.decays`).

Pure data: no I/O, no torch. Paths are kept as strings and resolved by the reader.
"""

from __future__ import annotations

import json
import math
from typing import Annotated, Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from sailor.schemas._base import Frozen, WireMessage, field_error
from sailor.schemas.model import ModelSpec

__all__ = [
    "BuiltinModel",
    "CheckpointConfig",
    "ClippingConfig",
    "DataConfig",
    "EvalConfig",
    "HuggingFaceModel",
    "IndexedData",
    "LossScalingConfig",
    "MetricsConfig",
    "ModelSource",
    "NoDecay",
    "NonFiniteConfig",
    "OptimizerConfig",
    "ScheduleConfig",
    "SpecFileModel",
    "SyntheticData",
    "TrainingConfig",
    "TrainingPrecision",
    "decays",
    "param_kind",
    "parse_training_config",
]

TrainingPrecision = Literal["auto", "fp32", "bf16", "fp16"]


# --- model source ------------------------------------------------------------------------


class BuiltinModel(Frozen):
    """A model of the catalog by name (the tiny CPU models, or any catalog architecture)."""

    kind: Literal["builtin"] = Field(default="builtin", description="Discriminator.")
    name: str = Field(min_length=1, description="Catalog model name, e.g. 'tiny-gpt'.")


class SpecFileModel(Frozen):
    """A ``ModelSpec`` given inline or as a JSON file."""

    kind: Literal["spec"] = Field(default="spec", description="Discriminator.")
    path: str | None = Field(default=None, description="ModelSpec JSON file.")
    spec: ModelSpec | None = Field(default=None, description="The ModelSpec itself.")

    @model_validator(mode="after")
    def _one(self) -> SpecFileModel:
        if (self.path is None) == (self.spec is None):
            raise field_error("path", self.path, "give exactly one of 'path' and 'spec'")
        return self


class HuggingFaceModel(Frozen):
    """A Hugging Face model: a local directory with ``config.json`` (and, to start from its
    weights, ``*.safetensors``). Read locally only; nothing is downloaded at run time.

    Families: GPT-2, OPT, GPT-NeoX and Llama (``sailor.megatron_patch.hf``); a config field
    the engine cannot reproduce exactly is refused with its name and value.
    """

    kind: Literal["huggingface"] = Field(default="huggingface", description="Discriminator.")
    path: str = Field(min_length=1, description="Local directory holding config.json.")
    family: Literal["gpt2", "opt", "gpt_neox", "llama"] | None = Field(
        default=None, description="Architecture family; None: from config.json's model_type."
    )
    load_weights: bool = Field(
        default=False, description="Start from the directory's safetensors weights."
    )
    seq_length: int | None = Field(
        default=None, gt=0, description="Training sequence length; None: the config's maximum."
    )


ModelSource = Annotated[
    BuiltinModel | SpecFileModel | HuggingFaceModel, Field(discriminator="kind")
]


# --- data -------------------------------------------------------------------------------


class SyntheticData(Frozen):
    """Seeded synthetic tokens (``SyntheticTokens``): no files, the loss still falls."""

    kind: Literal["synthetic"] = Field(default="synthetic", description="Discriminator.")


class IndexedData(Frozen):
    """A Megatron indexed dataset (``PREFIX.bin``/``PREFIX.idx``)."""

    kind: Literal["indexed"] = Field(default="indexed", description="Discriminator.")
    prefix: str = Field(min_length=1, description="Data set path without .bin/.idx.")
    manifest: str | None = Field(
        default=None,
        description="Manifest of `sailor data prepare` (splits, tokenizer); None: "
        "PREFIX.json if it exists, else the data set alone with validation_fraction.",
    )
    validation_fraction: float = Field(
        default=0.0,
        ge=0.0,
        lt=1.0,
        description="Without a manifest: the last fraction of documents is the validation "
        "split. With one, the manifest's splits are used and this must stay 0.",
    )


DataConfig = Annotated[SyntheticData | IndexedData, Field(discriminator="kind")]


# --- optimization -----------------------------------------------------------------------


NoDecay = Literal["bias", "norm", "embedding"]
"""Kinds of parameters that can be exempt from weight decay."""


def param_kind(name: str, tied: bool) -> Literal["bias", "norm", "embedding", "matrix"]:
    """Kind of the layer-keyed parameter ``name`` (``'{layer}.{module}.{leaf}'``): decided from
    the name alone, so every rank and layout puts a parameter in the same group. A tied LM
    head is the embedding."""
    _, _, pname = name.partition(".")
    module, _, leaf = pname.rpartition(".")
    if leaf == "bias":
        return "bias"
    if module in ("ln1", "ln2", "norm"):
        return "norm"
    if module in ("wte", "wpe") or (tied and module == "lm_head"):
        return "embedding"
    return "matrix"


def decays(name: str, no_decay: tuple[NoDecay, ...], tied: bool) -> bool:
    """Whether the layer-keyed parameter ``name`` gets weight decay."""
    return param_kind(name, tied) not in no_decay


class OptimizerConfig(Frozen):
    """AdamW (decoupled weight decay)."""

    lr: float = Field(default=1e-3, gt=0, description="Peak learning rate.")
    betas: tuple[float, float] = Field(default=(0.9, 0.95), description="AdamW (beta1, beta2).")
    eps: float = Field(default=1e-8, gt=0, description="AdamW epsilon.")
    weight_decay: float = Field(default=0.01, ge=0, description="Decoupled weight decay.")
    no_decay: tuple[NoDecay, ...] = Field(
        default=("bias", "norm"),
        description="Kinds exempt from weight decay: 'bias', 'norm' (norm weights), "
        "'embedding' (token and position tables, a tied head). Default: biases and norms, "
        "as Megatron-LM does; empty: decay everything.",
    )

    @field_validator("betas")
    @classmethod
    def _betas(cls, v: tuple[float, float]) -> tuple[float, float]:
        for i, b in enumerate(v):
            if not 0.0 <= b < 1.0:
                raise field_error(f"betas[{i}]", b, "must be in [0, 1)")
        return v

    def decays(self, param_name: str, tied: bool = False) -> bool:
        """Whether parameter ``param_name`` gets weight decay."""
        return decays(param_name, self.no_decay, tied)


class ScheduleConfig(Frozen):
    """Linear warmup from 0 to the peak LR, then constant, linear or cosine decay to
    ``min_lr_ratio`` × peak at ``total_steps`` (and flat after it).

    The factors are those of ``transformers``' ``get_linear_schedule_with_warmup`` and
    ``get_cosine_with_min_lr_schedule_with_warmup`` (tested against them): the update made
    at step ``s`` (0-based) uses ``lr_at(s)``, so the first warmup update has rate 0.
    """

    warmup_steps: int = Field(default=0, ge=0, description="Steps of linear warmup from 0.")
    decay: Literal["cosine", "linear", "constant"] = Field(
        default="constant", description="Shape after warmup."
    )
    min_lr_ratio: float = Field(
        default=0.0, ge=0.0, le=1.0, description="Floor of the decay, as a fraction of lr."
    )
    total_steps: int | None = Field(
        default=None,
        gt=0,
        description="Step where the decay reaches its floor; required for cosine and linear.",
    )

    @model_validator(mode="after")
    def _steps(self) -> ScheduleConfig:
        if self.decay != "constant" and self.total_steps is None:
            raise field_error("total_steps", None, f"is required by decay={self.decay!r}")
        if self.decay != "constant" and (self.total_steps or 0) <= self.warmup_steps:
            raise field_error(
                "warmup_steps",
                self.warmup_steps,
                f"must be below total_steps={self.total_steps} for decay={self.decay!r}",
            )
        return self

    def lr_at(self, step: int, peak_lr: float) -> float:
        """Learning rate of the update made at ``step`` (0-based): a pure function, so a
        run resumed at any step under any layout continues the curve exactly."""
        if step < 0:
            raise field_error("step", step, "must be >= 0")
        if step < self.warmup_steps:
            return peak_lr * step / self.warmup_steps
        if self.decay == "constant" or self.total_steps is None:
            return peak_lr
        span = self.total_steps - self.warmup_steps
        frac = min(1.0, (step - self.warmup_steps) / span)
        shape = 0.5 * (1.0 + math.cos(math.pi * frac)) if self.decay == "cosine" else 1.0 - frac
        return peak_lr * (self.min_lr_ratio + (1.0 - self.min_lr_ratio) * shape)


class ClippingConfig(Frozen):
    """Gradient clipping by the global L2 norm over every parameter of the model."""

    max_norm: float | None = Field(
        default=None, gt=0, description="Clip when the global norm exceeds this; None: off."
    )


class LossScalingConfig(Frozen):
    """Dynamic loss scaling (fp16): DeepSpeed's ``fp16`` settings of the same names.

    The scale starts at ``2**initial_scale_power``; a step whose gradients overflow on any
    rank is skipped by every rank and halves it (not below ``min_loss_scale``); after
    ``loss_scale_window`` good steps in a row it doubles. Its state (and how many steps were
    skipped) is checkpointed and carried across re-layouts, so a resumed run continues it.
    """

    mode: Literal["auto", "dynamic"] = Field(
        default="auto",
        description="'auto': dynamic loss scaling when the run computes in fp16, none "
        "otherwise; 'dynamic': in every precision (harmless in fp32 and bf16).",
    )
    initial_scale_power: int = Field(
        default=16, ge=0, le=127, description="The scale starts at 2**this (DeepSpeed: 16)."
    )
    loss_scale_window: int = Field(
        default=1000, gt=0, description="Good steps in a row before the scale doubles."
    )
    min_loss_scale: float = Field(default=1.0, gt=0, description="The scale's floor.")


class NonFiniteConfig(Frozen):
    """What a run does with an iteration whose gradients hold an inf or NaN on any rank.

    Every rank skips its update (weights and Adam moments untouched, the step and the data
    advance), up to ``max_skips`` iterations in a row; the next one in a row stops the run on
    every rank with ``NonFiniteGradientsError``. Under fp16 the loss scaler's overflow skips
    are not counted unless the scale is at ``min_loss_scale`` already.
    """

    max_skips: int = Field(
        default=3,
        ge=0,
        description="Iterations in a row with non-finite gradients that are skipped; the "
        "next one stops the run (0: the first one does).",
    )


class EvalConfig(Frozen):
    """Validation loss during training."""

    every_steps: int = Field(default=0, ge=0, description="Evaluate every N steps; 0: never.")
    batches: int = Field(default=4, gt=0, description="Global batches per evaluation.")


class CheckpointConfig(Frozen):
    """Periodic checkpoints (the agent's save requests come on top)."""

    dir: str | None = Field(default=None, description="Checkpoint root; None: no checkpoints.")
    every_steps: int = Field(default=0, ge=0, description="Save every N steps; 0: never.")
    keep: int = Field(default=2, gt=0, description="Committed checkpoints kept.")

    @model_validator(mode="after")
    def _dir(self) -> CheckpointConfig:
        if self.every_steps and self.dir is None:
            raise field_error("every_steps", self.every_steps, "needs a checkpoint 'dir'")
        return self


class MetricsConfig(Frozen):
    """Where per-step metrics go (tokens/s, MFU per GPU type, loss, lr)."""

    jsonl: str | None = Field(
        default=None, description="JSON-lines file ('{rank}' is replaced); None: none."
    )
    tensorboard_dir: str | None = Field(
        default=None, description="TensorBoard event files go here; None: none."
    )
    every_steps: int = Field(default=1, gt=0, description="Log every N steps.")

    @model_validator(mode="after")
    def _local(self) -> MetricsConfig:
        # written by rank 0 with plain file writes: a URL would become a local directory
        # named after its scheme (a checkpoint root may be a URL; these may not)
        for name in ("jsonl", "tensorboard_dir"):
            value = getattr(self, name)
            if value is not None and "://" in value:
                raise field_error(name, value, "must be a local path (URLs are not written to)")
        return self


class TrainingConfig(WireMessage):
    """Everything about a training run that is not the plan (which is the placement)."""

    model: ModelSource = Field(description="What to train.")
    data: DataConfig = Field(default_factory=SyntheticData, description="Training data.")
    seed: int = Field(default=0, ge=0, description="Seed of initial weights and data order.")
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig, description="AdamW.")
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig, description="LR schedule.")
    precision: TrainingPrecision = Field(
        default="auto",
        description="The job's precision, fixed for its life. 'auto': the first launched "
        "plan's (bf16 where every GPU type of it has bf16 units, else fp16, fp32 on CPU: "
        "schemas.precision.choose_precision), kept by every later plan; otherwise forced "
        "from the start, and the planner leaves out GPU types that cannot run it.",
    )
    allow_precision_change: bool = Field(
        default=False,
        description="Let the job's precision change: a forced 'precision' other than the "
        "one the job recorded, and a checkpoint saved in another precision than the run "
        "loading it computes in. False: both are refused (a bf16 model resumed in fp16 can "
        "overflow; the reverse changes the numerics silently). Wire version 5.",
    )
    allow_data_change: bool = Field(
        default=False,
        description="Resume from a checkpoint trained on other data than this run's "
        "(another corpus, sequence length, tokenizer, split or seed: the checkpoint's "
        "recorded data identity differs). False: refused before any shard is read, naming "
        "the field; True: resumed, and what changed is logged. Wire version 9.",
    )
    clipping: ClippingConfig = Field(default_factory=ClippingConfig, description="Clipping.")
    loss_scaling: LossScalingConfig = Field(
        default_factory=LossScalingConfig, description="Dynamic loss scaling (fp16)."
    )
    nonfinite: NonFiniteConfig = Field(
        default_factory=NonFiniteConfig, description="Non-finite gradients: skip, then stop."
    )
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Evaluation.")
    checkpoint: CheckpointConfig = Field(
        default_factory=CheckpointConfig, description="Checkpointing."
    )
    metrics: MetricsConfig = Field(default_factory=MetricsConfig, description="Metrics.")

    @model_validator(mode="after")
    def _consistent(self) -> TrainingConfig:
        if (
            isinstance(self.data, IndexedData)
            and self.data.manifest is not None
            and self.data.validation_fraction
        ):
            raise field_error(
                "data.validation_fraction",
                self.data.validation_fraction,
                "must stay 0 when a manifest gives the splits",
            )
        return self

    def lr_at(self, step: int) -> float:
        """Learning rate of the update at ``step``."""
        return self.schedule.lr_at(step, self.optimizer.lr)


def _where(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def parse_training_config(text: str, source: str = "<config>") -> TrainingConfig:
    """A ``TrainingConfig`` from JSON (``source`` ending in ``.json``) or YAML text.

    Every problem is reported in one ``ValueError`` whose lines read
    ``SOURCE: field.path=value: why``, e.g. ``run.yaml: optimizer.lr=-1.0: Input should be
    greater than 0``.
    """
    try:
        raw: Any = json.loads(text) if source.endswith(".json") else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ValueError(
            f"{source}: not valid {'JSON' if source.endswith('.json') else 'YAML'}: {exc}"
        ) from exc
    except RecursionError as exc:  # the parsers' own depth limit
        raise ValueError(f"{source}: nested too deep to read") from exc
    if not isinstance(raw, dict):
        raise ValueError(f"{source}: a training config is a mapping, got {type(raw).__name__}")
    try:
        return TrainingConfig.model_validate(raw)
    except ValidationError as exc:
        lines = []
        for err in exc.errors(include_url=False):
            loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p in _TAGS))
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] == "missing":
                lines.append(f"{source}: {_where(loc)}: {msg}")
            elif "input" in err and err["type"] != "value_error":
                lines.append(f"{source}: {_where(loc)}={err['input']!r}: {msg}")
            elif loc and msg.startswith(str(loc[-1])):  # a field validator names its field
                head = _where(loc[:-1])
                lines.append(f"{source}: {head}.{msg}" if loc[:-1] else f"{source}: {msg}")
            elif loc:  # a model validator's field_error: "field=value: why", relative to loc
                lines.append(f"{source}: {_where(loc)}.{msg}")
            else:
                lines.append(f"{source}: {msg}")
        raise ValueError("\n".join(lines)) from exc


_TAGS = {"builtin", "spec", "huggingface", "synthetic", "indexed"}
"""Discriminator tags pydantic puts into an error's location; dropped for readability."""
