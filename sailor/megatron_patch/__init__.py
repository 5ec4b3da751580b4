"""Heterogeneous training on torch.distributed: run any plan the planner can emit.

Pure layout logic (no torch): ``roles`` (plan, rank) -> role, ``sync_groups`` (gradient-sync
groups per layer segment, mixed TP), ``megatron_adapter`` (Megatron-core parallel state).
torch side: ``tp_layers``, ``model`` (GPT stage keyed by global layer), ``data``, ``groups``,
``schedule`` (1F1B), ``grad_sync``, ``engine`` (training loop and hooks), ``state``
(checkpoint interface), ``reference`` (single-process ground truth), ``rank_main`` (one
rank's training process, ``main(argv)``), ``deepspeed_adapter``. See docs/training.md.

The package root imports nothing heavy so that ``roles`` can be used without torch.
"""
