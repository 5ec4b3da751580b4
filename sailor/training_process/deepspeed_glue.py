"""Sailor's layer-keyed checkpoints for the DeepSpeed adapter, and its entry point.

:class:`DeepSpeedLayerIO` is the adapter's checkpoint IO (``deepspeed_state.
DeepSpeedCheckpointIO``): it saves a :class:`~sailor.megatron_patch.deepspeed_state.
DeepSpeedRun` through the same ``CheckpointSaves`` (``Checkpointer``, manifest, commit) as
Sailor's engine, with the same globals (``adam_step``, ``seed``, the precision, the skipped
steps, the loss scale and the non-finite streak), and restores one from a checkpoint written
by either under any layout (the reader relayouts by layer), refusing other data (the
recorded ``DataIdentity``, seed included), another seed or another precision as the engine
does. Lives here, not in ``sailor.megatron_patch``, for the same reason
as ``ckpt_glue`` (the engine never imports ``sailor.checkpoint``).

``python -m sailor.training_process.deepspeed_glue ARGS`` runs one adapter rank with it (the
worker's arguments: ``deepspeed_adapter``).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping

from sailor.checkpoint import (
    ParamState,
    TrainingGlobals,
    load_for_rank,
    open_storage,
    place_of,
    read_manifest,
    writer_assignment,
)
from sailor.megatron_patch.deepspeed_state import DeepSpeedRun
from sailor.megatron_patch.state import key_layer
from sailor.megatron_patch.tp_layers import tp_dim_of
from sailor.training_process.ckpt_glue import (
    CheckpointSaves,
    check_model_fit,
    check_resumed_data,
    pad_vocab_rows,
    unpadded_vocab,
)

__all__ = ["DeepSpeedLayerIO", "main"]


def _state(
    run: DeepSpeedRun, lent: Mapping[str, ParamState]
) -> tuple[dict[str, ParamState], TrainingGlobals]:
    # Only the layers this rank writes: the ``Checkpointer`` (``CheckpointSaves``, built
    # without layer sizes, hence the same writer assignment) writes those alone (TP is 1
    # here), so in bf16 each full master and moment is reduced to its layer's writer alone
    # and lands in the host copies ``lent`` by the last save, which the checkpointer then
    # keeps as they are (``owned``): one host copy of what the rank writes, on the writer
    # only (``DeepSpeedRun.state``).
    into = {k: (ps.weight, ps.exp_avg, ps.exp_avg_sq) for k, ps in lent.items()}
    got = run.state(writer_assignment(run.plan), into)
    params = {k: ParamState(w, m, v, dim) for k, (w, m, v, dim) in got.items()}
    extra = {"adam_step": run.adam_step, "seed": run.cfg.seed, **run.scaling_state()}
    return params, TrainingGlobals(run.step, run.consumed_samples, extra, run.data)


class DeepSpeedLayerIO:
    """The adapter's checkpoint IO: Sailor's format, one ``Checkpointer`` per root."""

    def __init__(self, keep: int | None = None) -> None:
        self._saves = CheckpointSaves(keep)

    def position(self, root: str, step: int) -> tuple[int, int]:
        m = read_manifest(open_storage(root), step)
        return m.step, m.consumed_samples

    def restore(self, run: DeepSpeedRun, root: str, step: int) -> None:
        run.check_checkpointable()
        dims = {k: tp_dim_of(p) for k, p in run.keyed_parameters()}
        storage = open_storage(root)
        # a checkpoint from before the engine padded the vocabulary: its embedding and LM
        # head are read whole and padded as the engine pads them (``ckpt_glue``)
        layers = {key_layer(k) for k in dims}
        manifest = read_manifest(storage, step)  # once, for the two checks before the load
        unpadded = unpadded_vocab(run.spec, manifest, layers) if run.spec else set()
        where = f"{storage.url.rstrip('/')} step {step}"
        check_model_fit(
            manifest,
            where,
            run.keyed_parameters(),
            tp_size=place_of(run.plan, run.rank).tp_size,
            num_layers=run.plan.num_layers,
            unpadded=unpadded,
            vocab_size=run.spec.vocab_size if run.spec else 0,
        )
        run.data_changes = check_resumed_data(
            manifest, where, run.data, run.cfg.allow_data_change, run.rank
        )
        for key in unpadded:
            dims[key] = None
        got = load_for_rank(storage, run.plan, run.rank, step=step, tp_dims=dims)
        if run.spec is not None:
            for key in unpadded:
                got.params[key] = pad_vocab_rows(got.params[key], run.spec.vocab_size)
        extra = got.globals.extra
        saved_seed = extra.get("seed")
        # compared with the recorded data before the read (allow_data_change may accept it)
        compared = manifest.data is not None and run.data is not None
        if not compared and saved_seed is not None and int(saved_seed) != run.cfg.seed:
            raise ValueError(
                f"checkpoint {step} under {root} was trained with seed={saved_seed}, this run "
                f"has seed={run.cfg.seed}: resume with the same seed, or start a new run"
            )
        # as the engine reads them (``ckpt_glue.restore_trainer``): a checkpoint without
        # ``adam_step`` (nor ``skipped_steps``) skipped nothing, so AdamW took every step
        adam_step = int(extra.get("adam_step", got.globals.step))
        run.load_scaling_state(
            {
                "skipped_steps": extra.get("skipped_steps", got.globals.step - adam_step),
                "precision": extra.get("precision"),
            }
        )
        run.load(
            {k: ps.weight for k, ps in got.params.items()},
            {k: (ps.exp_avg, ps.exp_avg_sq) for k, ps in got.params.items()},
        )

    def save(
        self,
        trainer: DeepSpeedRun,
        root: str,
        keep: int | None = None,
        prune_below: int = -1,
        optional: bool = False,
        drop_steps: tuple[int, ...] | None = None,
    ) -> float:
        # In bf16 the state is host copies made for the save (``read_full``): they fill the
        # last save's copies, lent, and are handed back as they are (owned). In fp32 it is
        # the live parameters and moments, which the checkpointer copies.
        try:
            owned = trainer.bf16
        except Exception:  # raised again by the state, in the save's own failure path
            owned = False
        lent = (
            self._saves.lend_copies(trainer.plan, trainer.rank, trainer.tp_group, root, keep)
            if owned
            else {}
        )
        return self._saves.save(
            lambda: _state(trainer, lent),
            trainer.plan,
            trainer.rank,
            trainer.tp_group,
            root,
            keep,
            prune_below,
            optional,
            owned=owned,
            drop_steps=drop_steps,
        )

    def done(self) -> bool:
        return self._saves.done()

    def wait(self) -> None:
        self._saves.wait()

    def abandon(self) -> None:
        self._saves.abandon()

    def close(self) -> None:
        self._saves.close()


def main(argv: list[str] | None = None) -> int:
    """One DeepSpeed adapter rank with Sailor's checkpoints (``deepspeed_adapter.main``)."""
    from sailor.megatron_patch.deepspeed_adapter import main as adapter_main

    return adapter_main(argv, ckpt=DeepSpeedLayerIO())


if __name__ == "__main__":
    sys.exit(main())
