"""The per-node agent: registration lease, preemption watchers and the worker supervisor."""
