"""The training loop of one rank: 1F1B over its pipeline's microbatches, weighted gradient
sync, AdamW, and the iteration-boundary hook.

One iteration on every rank:

1. zero gradients;
2. 1F1B over this pipeline's microbatches (``schedule``), each microbatch's mean loss scaled
   by ``microbatch_size / global_batch_size``;
3. gradient sync per layer segment (``grad_sync``), a plain SUM that thereby weights each
   pipeline by the samples it processed;
4. optionally, clipping by the global gradient norm (``clipping``: each element counted once
   whatever the layout, so equal to single-process clipping);
5. the iteration's one world collective (``step_agreement``: the loss, clipping's squares,
   each rank's non-finite and bad-label flags, read by the host once): a bad label on any
   rank raises the same ``LabelOutOfRangeError`` on every rank (``bad_labels``); an
   iteration whose gradients hold an inf or NaN on any rank skips its update on every rank,
   up to ``max_nonfinite_skips`` in a row, then every rank raises
   ``NonFiniteGradientsError`` (``nonfinite``); otherwise the
   AdamW step on the local fp32 master weights (elementwise, so a sharded step equals the
   full step) at the learning rate of the schedule for this step (``ScheduleConfig.lr_at``, a pure
   function of ``step``: a resumed run continues the schedule exactly), with weight decay
   per group (``optim.param_groups``);
6. ``step += 1``, ``consumed_samples += global_batch_size``; every ``eval_every`` steps the
   validation loss (forward only, over the same ``eval_batches`` global batches each time);
   the hook runs.

Data comes from anything with ``batch(indices) -> (inputs, labels)`` (``data.TokenSource``):
the seeded synthetic tokens by default, a real corpus when the caller passes one.

Interfaces others use (keep stable):

- ``Trainer.step`` and ``Trainer.consumed_samples``: the global iteration and data
  position (they survive re-layouts through the checkpoint).
- ``IterationHook``: ``hook(trainer) -> bool``, called at every iteration boundary (before the
  first iteration and after each one) on every rank; returning True stops the run at that
  boundary (stop-at-step, checkpoint-then-stop). The hook may call
  ``state.stage_state(trainer.stage)`` and ``state.optimizer_state(trainer.stage,
  trainer.optimizer)`` to checkpoint.

Precision (``precision``): fp32 on CPU; on GPU bf16 autocast with fp32 master weights and
fp32 optimizer state where the GPU has bf16, else fp16 autocast with a dynamic loss scale
whose overflow skip is agreed by every rank (``precision.LossScaler``; in any precision with
``loss_scaling.mode='dynamic'``); without a scaler, the non-finite check above skips alike. A
skipped iteration still advances ``step`` and the data
(as Megatron's): ``skipped_steps`` counts them, AdamW has taken ``adam_step`` steps, and
both they, the scale and a non-finite streak under way survive checkpoints and re-layouts
(``scaling_state``).

The host waits for the device once per iteration: the agreement's read (the loss, the
agreed flags, clipping's norm and, under an agent, the control request's all-reduce issued
beside it: ``control.start_agree``), before the optimizer step. Phases are timed with marks
that never wait (``clock.StepClock``: CUDA events on a GPU, read after that wait), so on a
GPU ``optim_s`` is the last optimizer step known done, the previous iteration's (0.0 on a
process's first; on CPU this iteration's). Two waits under fp16 with clipping (the norm of
the unscaled gradients, after the agreed overflow) and one more on an evaluation iteration
(its loss). ``tests/unit/test_engine_host_waits.py`` counts them. Inside the
1F1B phase, forward, backward and pipeline exchanges are timed apart (``clock.SpanTimer``:
CUDA events on a GPU, no extra synchronization) for online calibration:
``StepResult.fwd_s``/``bwd_s`` per microbatch and ``p2p_s`` per step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from pydantic import Field

from sailor.comm import api as comm
from sailor.comm.device_copy import to_device
from sailor.megatron_patch.architecture import Architecture
from sailor.megatron_patch.bad_labels import LabelWatch, training_batch, validation_batches
from sailor.megatron_patch.clipping import clip_by_global_norm, local_squares, scale_to_norm
from sailor.megatron_patch.clock import SpanTimer, StepClock, synchronize
from sailor.megatron_patch.control import ControlRequest, read_agreed, start_agree
from sailor.megatron_patch.data import (
    VALIDATION_SEED_OFFSET,
    IndexedTokens,
    SyntheticTokens,
    TokenSource,
    microbatch_indices,
    vocab_bound,
)
from sailor.megatron_patch.grad_sync import sync_gradients
from sailor.megatron_patch.groups import ProcessGroups
from sailor.megatron_patch.model import GPTStage
from sailor.megatron_patch.nonfinite import SkipStreak
from sailor.megatron_patch.optim import param_groups
from sailor.megatron_patch.precision import (
    LossScaler,
    Precision,
    autocast_of,
    check_state_precision,
    compute_dtype,
    device_precision,
    scaled_step,
)
from sailor.megatron_patch.roles import RankRole
from sailor.megatron_patch.schedule import P2P, run_1f1b, run_forward
from sailor.megatron_patch.state import place
from sailor.megatron_patch.step_agreement import (
    BAD_LABELS,
    NONFINITE,
    Agreed,
    local_nonfinite,
    rank_hosts,
    read_step,
    start_step,
)
from sailor.schemas._base import Frozen
from sailor.schemas.model import ModelSpec
from sailor.schemas.plan import Plan
from sailor.schemas.training import (
    LossScalingConfig,
    NoDecay,
    ScheduleConfig,
    TrainingConfig,
)

__all__ = [
    "IterationHook",
    "StepResult",
    "TrainConfig",
    "Trainer",
    "evaluation_sum",
    "make_optimizer",
    "resumed_skipped_steps",
    "to_device",
    "validation_data",
]


def resumed_skipped_steps(state: Mapping[str, Any], step: int) -> int:
    """The iterations a checkpoint's run skipped (``skipped_steps`` of its globals, 0 when
    it does not say), checked against its ``step``: AdamW took ``step`` minus these."""
    skipped = int(state.get("skipped_steps", 0))
    if not 0 <= skipped <= step:
        raise ValueError(f"skipped_steps={skipped}: must be in [0, step={step}]")
    return skipped


class TrainConfig(Frozen):
    """Optimizer and data settings shared by every rank of a run (and the reference)."""

    seed: int = Field(default=0, ge=0, description="Seed of init and data.")
    lr: float = Field(default=1e-3, gt=0, description="AdamW learning rate.")
    weight_decay: float = Field(default=0.01, ge=0, description="AdamW weight decay.")
    beta1: float = Field(default=0.9, ge=0, lt=1, description="AdamW beta1.")
    beta2: float = Field(default=0.95, ge=0, lt=1, description="AdamW beta2.")
    eps: float = Field(default=1e-8, gt=0, description="AdamW epsilon.")
    schedule: ScheduleConfig = Field(
        default_factory=ScheduleConfig, description="Warmup and decay of lr, by step."
    )
    clip_grad_norm: float = Field(
        default=0.0, ge=0, description="Clip gradients to this global norm; 0: no clipping."
    )
    no_decay: tuple[NoDecay, ...] = Field(
        default=(), description="Parameter kinds without weight decay (empty: decay all)."
    )
    eval_every: int = Field(
        default=0, ge=0, description="Validation loss every this many steps; 0: never."
    )
    eval_batches: int = Field(
        default=1, gt=0, description="Global batches of the validation split per evaluation."
    )
    loss_scaling: LossScalingConfig = Field(
        default_factory=LossScalingConfig,
        description="Dynamic loss scaling: under fp16 by default, in any precision if asked.",
    )
    max_nonfinite_skips: int = Field(
        default=3,
        ge=0,
        description="Iterations in a row whose non-finite gradients every rank skips; the "
        "next one raises NonFiniteGradientsError (0: the first one does).",
    )
    allow_precision_change: bool = Field(
        default=False,
        description="Continue from a state (a checkpoint, live holders) saved in another "
        "precision than this run computes in; False: refused (TrainingConfig's field).",
    )
    allow_data_change: bool = Field(
        default=False,
        description="Resume from a checkpoint whose recorded data identity differs from "
        "this run's data; False: refused before any shard is read (TrainingConfig's field).",
    )

    @classmethod
    def of(cls, tc: TrainingConfig) -> TrainConfig:
        """The engine's settings of a training config (what every rank and the reference
        run under it)."""
        o = tc.optimizer
        return cls(
            seed=tc.seed,
            lr=o.lr,
            weight_decay=o.weight_decay,
            beta1=o.betas[0],
            beta2=o.betas[1],
            eps=o.eps,
            no_decay=o.no_decay,
            schedule=tc.schedule,
            clip_grad_norm=tc.clipping.max_norm or 0.0,
            eval_every=tc.eval.every_steps,
            eval_batches=tc.eval.batches,
            loss_scaling=tc.loss_scaling,
            max_nonfinite_skips=tc.nonfinite.max_skips,
            allow_precision_change=tc.allow_precision_change,
            allow_data_change=tc.allow_data_change,
        )


def validation_data(spec: ModelSpec, cfg: TrainConfig) -> SyntheticTokens:
    """The synthetic validation split (a real corpus brings its own)."""
    return SyntheticTokens(spec.vocab_size, spec.seq_length, cfg.seed + VALIDATION_SEED_OFFSET)


def make_optimizer(params: Any, cfg: TrainConfig, foreach: bool = False) -> torch.optim.AdamW:
    """AdamW as every rank and the reference build it.

    Non-foreach by default (bitwise per element, what the CPU exactness tests compare);
    the engine asks for ``foreach`` on CUDA, where the per-parameter kernels would dominate.
    """
    return torch.optim.AdamW(
        params,
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        foreach=foreach,
    )


@dataclass(frozen=True)
class StepResult:
    """Figures of one iteration as seen by one rank."""

    step: int
    consumed_samples: int
    loss: float
    step_s: float
    compute_s: float
    sync_s: float
    optim_s: float
    samples: int
    """Samples of this iteration (the global batch)."""
    lr: float = 0.0
    """Learning rate of this iteration's optimizer step."""
    grad_norm: float | None = None
    """Global gradient norm before clipping (when clipping is on)."""
    eval_loss: float | None = None
    """Validation loss after this iteration (every ``eval_every`` steps)."""
    fwd_s: float = 0.0
    """Mean forward compute of one microbatch on this rank's stage (p2p excluded)."""
    bwd_s: float = 0.0
    """Mean backward compute of one microbatch on this rank's stage."""
    p2p_s: float = 0.0
    """Time in pipeline exchanges this iteration (transfers and waits for neighbours)."""
    microbatches: int = 0
    """Microbatches this rank ran."""
    skipped: bool = False
    """Every rank skipped this iteration's update: a gradient held an inf or NaN on some rank
    (under a loss scale: overflowed)."""
    loss_scale: float | None = None
    """The loss scale this iteration ran under (None without loss scaling)."""

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.step_s if self.step_s > 0 else 0.0


def _mean(span: tuple[float, int] | None) -> float:
    return span[0] / span[1] if span and span[1] else 0.0


def evaluation_sum(
    stage: GPTStage,
    role: RankRole,
    p2p: P2P,
    batch: Callable[[int], Callable[[int], tuple[torch.Tensor, torch.Tensor]]],
    batches: int,
    loss_scale: float,
    autocast: Callable[[], Any] | None,
    bad_labels: Callable[[], bool],
) -> torch.Tensor:
    """Evaluation's collectives, issued and not read: a forward-only pass over ``batches``
    global batches (``batch(k)``: batch ``k``'s microbatches), then one world all-reduce
    SUM of ``1 + world`` float64 values: slot 0 the loss, ``1 + r`` rank ``r``'s bad-label
    flag (``bad_labels``, asked after the pass: raised alike). What ``Trainer.evaluate``
    reads, and the dry run records."""
    total = torch.zeros(1 + role.world_size, dtype=torch.float64, device=p2p.device)
    for k in range(batches):
        local = run_forward(stage, role, p2p, batch(k), loss_scale, autocast)
        if role.is_last_stage and role.tp_rank == 0:
            total[0] += local.reshape(())
    total[1 + role.rank] = float(bad_labels())
    comm.all_reduce(total)
    return total


IterationHook = Callable[["Trainer"], bool]
"""Called at every iteration boundary; return True to stop there."""


class Trainer:
    """One rank's training state and loop. Build it after ``dist.init_process_group``."""

    def __init__(
        self,
        plan: Plan,
        spec: ModelSpec,
        role: RankRole,
        groups: ProcessGroups,
        cfg: TrainConfig,
        device: torch.device,
        step: int = 0,
        consumed_samples: int = 0,
        precision: Precision | None = None,
        arch: Architecture | None = None,
        data: TokenSource | None = None,
        eval_data: TokenSource | None = None,
        empty: bool = False,
    ) -> None:
        """``empty``: the stage's parameters are left on ``meta`` (no memory, no
        initialisation) for the caller to fill, each placed on ``device`` by
        :func:`~sailor.megatron_patch.state.place` or :meth:`materialize` (an in-place
        relayout: its kept layers take over the held tensors, so the new stage never holds a
        second copy of them)."""
        if spec.num_all_layers != plan.num_layers:
            raise ValueError(
                f"plan covers {plan.num_layers} layers, model {spec.name!r} has "
                f"{spec.num_all_layers} (embedding + {spec.num_layers} blocks + head)"
            )
        self.plan, self.spec, self.role, self.groups, self.cfg = plan, spec, role, groups, cfg
        self.device = device
        self.step = step
        self.consumed_samples = consumed_samples
        # built on its device: a stage built on the host first held the whole shard there
        # in fp32 (every rank of a node at once) before moving it
        with torch.device("meta" if empty else device):
            self.stage = GPTStage(
                spec,
                role.first_layer,
                role.last_layer,
                tp=groups.tp,
                recompute=role.recompute,
                seed=cfg.seed,
                arch=arch,
                init=not empty,
            )
        self.precision: Precision = precision or device_precision(device)
        if self.precision != "fp32" and device.type != "cuda":
            raise ValueError(f"precision={self.precision!r} needs a CUDA device, got {device}")
        groups_ = param_groups(
            self.stage.keyed_parameters(), cfg.weight_decay, cfg.no_decay, spec.tie_embeddings
        )
        self.optimizer = make_optimizer(groups_, cfg, foreach=device.type == "cuda")
        self.data: TokenSource = data or SyntheticTokens(spec.vocab_size, spec.seq_length, cfg.seed)
        self.eval_data: TokenSource = eval_data or validation_data(spec, cfg)
        self.last_grad_norm: float | None = None
        self.p2p = P2P(
            role,
            (role.microbatch_size, spec.seq_length, spec.hidden_size),
            device,
            wire_dtype=compute_dtype(self.precision),
            tp_group=groups.tp.group,
        )
        self.loss_scale = role.microbatch_size / plan.global_batch_size
        self._autocast = autocast_of(self.precision, device)
        ls = cfg.loss_scaling
        self.scaler = (
            LossScaler(
                scale=2.0**ls.initial_scale_power,
                growth_interval=ls.loss_scale_window,
                min_scale=ls.min_loss_scale,
            )
            if self.precision == "fp16" or ls.mode == "dynamic"
            else None
        )
        self.data_changes = ""
        """What a restore accepted of a checkpoint trained on other data (the training
        config's ``allow_data_change``), '' if nothing: the worker's ``ready`` event says it."""
        self.skipped_steps = 0
        """Iterations whose update every rank skipped for an overflow or a non-finite gradient
        (AdamW took ``step - skipped_steps`` steps): checkpointed, carried across re-layouts."""
        self.nonfinite = SkipStreak(cfg.max_nonfinite_skips)
        """Non-finite iterations skipped in a row, and where they began: checkpointed and
        carried across re-layouts with the skipped steps (``scaling_state``)."""
        self.after_grad_sync: Callable[[Trainer], None] | None = None
        """Test hook: called after the gradient sync, before clipping and the optimizer step
        (tests put an inf or NaN into one rank's gradient)."""
        self.spans = SpanTimer(device)
        self.clock = StepClock(device)
        self.control_source: Callable[[], ControlRequest] | None = None
        """This rank's control request (the agent's file, ``control.read_control``): when
        set, every iteration agrees it beside the step's agreement, on the same host wait
        (``control.start_agree``), for the boundary after it (:meth:`take_agreed_control`).
        Set on every rank or on none: it adds a collective to the iteration."""
        self._agreed_control: tuple[int, ControlRequest] | None = None
        self.labels = LabelWatch(
            min(spec.vocab_size, vocab_bound(self.data), vocab_bound(self.eval_data))
        )
        """This rank's out-of-range labels of the iteration in flight (``bad_labels``)."""

    def _microbatch(self, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._batch(microbatch_indices(self.role, self.consumed_samples, mb), self.data)

    def _batch(self, indices: range, data: TokenSource) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(data, IndexedTokens):  # its ids checked, an error noted, not raised
            x, y, problem = data.checked_batch(indices)
            if problem:
                self.labels.note(problem)
        else:
            x, y = data.batch(indices)
        # on the host, before the copy: no device sync in the hot loop (at TP > 1 the loss
        # would take an id out of range silently; on a GPU, F.cross_entropy's is a device
        # assert that kills the process without a message). Noted and masked, not raised:
        # every rank raises it after the iteration's collective (``bad_labels``)
        x, y = self.labels.screen_tokens(x), self.labels.screen(y)
        return to_device(x, self.device), to_device(y, self.device)

    def _clip(self) -> None:
        self.last_grad_norm = clip_by_global_norm(
            self.stage, self.role, self.cfg.clip_grad_norm, self.device
        )

    def take_agreed_control(self, step: int) -> ControlRequest | None:
        """The control request agreed in the iteration that ended at ``step`` (None: none,
        or another step's), once: the boundary at ``step`` acts on it without a collective
        of its own."""
        got, self._agreed_control = self._agreed_control, None
        if got is None or got[0] != step:
            return None
        return got[1]

    def _agree(self, local_loss: torch.Tensor, scale: float) -> tuple[Agreed, Any]:
        """The iteration's one world collective (``step_agreement``: the loss, clipping's
        squares without a loss scaler, each rank's non-finite and bad-label flags) and, with
        a :attr:`control_source`, the control request's, read after one host wait, the
        iteration's only one. Returns the agreement and the clock's mark where its
        collectives end. Raises the agreed ``LabelOutOfRangeError`` on every rank if some
        rank read a bad label."""
        loss = torch.zeros(1, dtype=torch.float64, device=self.device)
        if self.role.is_last_stage and self.role.tp_rank == 0:
            loss += local_loss / scale if scale != 1.0 else local_loss
        squares = None
        if self.scaler is None and self.cfg.clip_grad_norm > 0:
            squares = local_squares(self.stage, self.role, self.device)
            flag = ~torch.isfinite(squares)
        else:
            grads = [p.grad for p in self.stage.parameters() if p.grad is not None]
            flag = local_nonfinite(grads, self.device)
        role = self.role
        vec = start_step(loss, squares, flag, self.labels.seen, role.rank, role.world_size)
        local = self.control_source() if self.control_source is not None else None
        pending = start_agree(local, self.device, role.world_size) if local is not None else None
        done = self.clock.mark()  # recorded before the wait: run by the time it returns
        agreed = read_step(vec)  # the host wait
        if local is not None:
            self._agreed_control = (self.step + 1, read_agreed(local, pending))
        if agreed.ranks(BAD_LABELS):
            first = self.consumed_samples
            samples = range(first, first + self.plan.global_batch_size)
            self.labels.raise_agreed(
                agreed.ranks(BAD_LABELS), self.step + 1, training_batch(samples), role.pipeline
            )
        self.labels.reset()
        return agreed, done

    def _optimizer_step(self, agreed: Agreed) -> tuple[float, bool]:
        """AdamW at this step's rate, after clipping, unless some rank's gradient holds an inf
        or NaN (``agreed`` by every rank: ``nonfinite``); under fp16 only if no rank
        overflowed (agreed), gradients unscaled (then clipped) first. Returns the rate and
        whether the step was skipped; raises ``NonFiniteGradientsError`` on every rank past
        the limit of skips in a row."""
        lr = self.cfg.schedule.lr_at(self.step, self.cfg.lr)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        skipped = agreed.nonfinite
        if self.scaler is None:
            if self.cfg.clip_grad_norm > 0:
                self.last_grad_norm = norm = math.sqrt(agreed.squares)
                scale_to_norm(self.stage, norm, self.cfg.clip_grad_norm)
            at_floor = True
            if skipped:
                self.optimizer.zero_grad(set_to_none=False)
            else:
                self.optimizer.step()
        else:
            # an overflow above the scale's floor is the scaler's (it halves the scale); one
            # at the floor is divergence, counted as a non-finite step
            at_floor = self.scaler.scale <= self.scaler.min_scale
            clip = self._clip if self.cfg.clip_grad_norm > 0 else None
            params = list(self.stage.parameters())
            taken = scaled_step(
                self.optimizer, params, self.scaler, self.device, before_step=clip, overflow=skipped
            )
            skipped = not taken
        if skipped:
            self.skipped_steps += 1
        ranks = agreed.ranks(NONFINITE)
        self.nonfinite.observe(self.step + 1, skipped, at_floor, ranks, rank_hosts)
        return lr, skipped

    @property
    def adam_step(self) -> int:
        """The optimizer's step count: iterations minus those skipped for an overflow."""
        return self.step - self.skipped_steps

    def scaling_state(self) -> dict[str, Any]:
        """What a checkpoint or a re-layout carries beyond weights, moments and position:
        the steps skipped so far, the loss scale (None without loss scaling), the
        non-finite streak under way (``{}``: none; ``nonfinite``) and the precision the
        state was trained in (a run in another refuses it: :meth:`load_scaling_state`)."""
        return {
            "precision": self.precision,
            "skipped_steps": self.skipped_steps,
            "loss_scale": self.scaler.state() if self.scaler is not None else None,
            "nonfinite": self.nonfinite.state(),
        }

    def materialize(self) -> list[str]:
        """Every parameter still on ``meta`` (an ``empty`` stage's unfilled ones) placed on
        the device, uninitialised; returns their keys."""
        out: list[str] = []
        for key, p in self.stage.keyed_parameters():
            if p.is_meta:
                place(p, torch.empty(p.shape, dtype=p.dtype, device=self.device))
                out.append(key)
        return out

    def load_scaling_state(self, state: Mapping[str, Any]) -> None:
        """Continue from a :meth:`scaling_state`. A scale saved by a run with loss scaling
        is dropped by one without (bf16, fp32), and one without leaves ours at its start. A
        non-finite streak under way continues (none saved: none under way).

        A state trained in another precision than this run computes in is refused (a bf16
        model resumed in fp16 overflows where it did not; the reverse changes the numerics
        silently) unless ``allow_precision_change``; a state that does not say (saved
        before it was recorded) is taken as this run's."""
        check_state_precision(
            state.get("precision"), self.precision, self.cfg.allow_precision_change
        )
        self.skipped_steps = resumed_skipped_steps(state, self.step)
        scale = state.get("loss_scale")
        if self.scaler is not None and scale is not None:
            self.scaler.load_state(scale)
        self.nonfinite.load_state(state.get("nonfinite"))

    def evaluate(self) -> float:
        """Mean loss over the validation split's first ``eval_batches`` global batches
        (forward only; collective over all ranks; the same value on every rank)."""
        batches = self.cfg.eval_batches

        def batch(k: int) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
            pos = k * self.plan.global_batch_size

            def get(mb: int) -> tuple[torch.Tensor, torch.Tensor]:
                return self._batch(microbatch_indices(self.role, pos, mb), self.eval_data)

            return get

        total = evaluation_sum(
            self.stage,
            self.role,
            self.p2p,
            batch,
            batches,
            self.loss_scale,
            self._autocast,
            lambda: self.labels.seen,
        )
        synchronize(self.device)  # abortable where the host waits (in-place workers)
        got = total.tolist()
        bad = tuple(r for r, f in enumerate(got[1:]) if f)
        if bad:
            where = validation_batches(batches, self.plan.global_batch_size)
            self.labels.raise_agreed(bad, self.step, where, self.role.pipeline)
        return float(got[0]) / batches

    def train_step(self) -> StepResult:
        """Run one iteration (collective over all ranks): one host wait for the device, the
        agreement's read (two under fp16 with clipping, whose norm of the unscaled gradients
        is agreed after the overflow; one more on an evaluation iteration, for its loss)."""
        clock = self.clock
        m0 = clock.mark()
        self.optimizer.zero_grad(set_to_none=False)
        scale = self.scaler.scale if self.scaler is not None else 1.0
        local_loss = run_1f1b(
            self.stage,
            self.role,
            self.p2p,
            self._microbatch,
            self.loss_scale * scale if scale != 1.0 else self.loss_scale,
            self._autocast,
            self.spans,
        )
        m1 = clock.mark()
        sync_gradients(self.stage, self.groups.sync)
        if self.after_grad_sync is not None:
            self.after_grad_sync(self)
        # the one host wait; the loss read with it. The agreement waits for the slowest
        # rank's sync as the sync does: timed with it (m1 to m2)
        agreed, m2 = self._agree(local_loss, scale)
        clock.settle()  # the previous iteration's optimizer step ran before the wait
        spans = self.spans.collect()  # after the wait: every span's events are done
        compute_s, sync_s = clock.seconds(m0, m1), clock.seconds(m1, m2)
        lr, skipped = self._optimizer_step(agreed)
        # on CPU this step's; on CUDA the last one known done (no wait for this one)
        optim_s = clock.optimizer(m2, clock.mark())
        self.step += 1
        self.consumed_samples += self.plan.global_batch_size
        value = agreed.loss
        every = self.cfg.eval_every
        eval_loss = self.evaluate() if every and self.step % every == 0 else None
        return StepResult(
            step=self.step,
            consumed_samples=self.consumed_samples,
            loss=value,
            step_s=compute_s + sync_s + optim_s,
            compute_s=compute_s,
            sync_s=sync_s,
            optim_s=optim_s,
            samples=self.plan.global_batch_size,
            lr=lr,
            grad_norm=self.last_grad_norm if self.cfg.clip_grad_norm > 0 else None,
            eval_loss=eval_loss,
            fwd_s=_mean(spans.get("fwd")),
            bwd_s=_mean(spans.get("bwd")),
            p2p_s=spans.get("p2p", (0.0, 0))[0],
            microbatches=self.role.num_microbatches,
            skipped=skipped,
            loss_scale=scale if self.scaler is not None else None,
        )

    def run(
        self,
        steps: int,
        hook: IterationHook | None = None,
        on_step: Callable[[StepResult], None] | None = None,
    ) -> list[StepResult]:
        """Run up to ``steps`` iterations, calling ``hook`` at every boundary."""
        out: list[StepResult] = []
        if hook is not None and hook(self):
            return out
        for _ in range(steps):
            res = self.train_step()
            out.append(res)
            if on_step is not None:
                on_step(res)
            if hook is not None and hook(self):
                break
        return out
