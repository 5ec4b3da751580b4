"""Communication of the training processes: one API (``api``) over a swappable backend.

``api`` forwards to ``torch.distributed`` by default; ``strict`` records and checks every
call against NCCL's rules (for tests, or opt-in with ``SAILOR_STRICT_COMM``);
``nccl_replay`` replays recorded per-rank logs under NCCL semantics to find deadlocks.
"""
