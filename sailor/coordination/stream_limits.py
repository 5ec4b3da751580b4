"""The limits of a job's event stream (JetStream), in their own module without nats-py: the
controller's config checks ``event_stream_max_bytes`` against them, and ``sailor config
check`` need not load the NATS client (nats-py and aiohttp, ~0.1 CPU-s) to do so.
:mod:`nats_bus` makes the stream with them.
"""

from __future__ import annotations

__all__ = ["EVENT_MAX_BYTES", "EVENT_MAX_MSGS_PER_SUBJECT", "EVENT_MAX_MSG_SIZE"]

EVENT_MAX_MSG_SIZE = 256 * 1024
"""Largest event the stream stores, bytes. The largest an agent publishes is a NodeJoined
whose facts hold every bounded error text at its bound (probe 4096, CUDA 1024, two
endpoints 1024 each, each character escaped to 6 bytes in the worst case) and 16 devices:
~47 KB (tests/unit/test_event_stream_limits.py measures it); a usual one is 2-5 KB. Larger
is refused at the publish (its publisher's alone) rather than stored: one agent stored
40 x 1 MB events in 2 s."""

EVENT_MAX_MSGS_PER_SUBJECT = 1000
"""Events kept per subject (``sailor.<job>.events.<node>.<kind>``), oldest dropped first: a
node that floods one subject drops its own older events of that kind only. An agent
publishes a handful of each kind between two reads of the controller (a join per
registration, a failure per launch, a notice per preemption), and the controller reads
continuously and needs none it has acked (it acks each after handling it)."""

EVENT_MAX_BYTES = 64 * 1024**2
"""The stream's total by default, bytes (64 MiB; ``event_stream_max_bytes`` in the
controller's config), oldest dropped first: a full stream never refuses a publish (a
preemption notice above all), where the server's JetStream store filling up refused every
node's. JetStream *reserves* a stream's ``max_bytes`` on each replica's server out of its
``max_file_store`` when the stream is made (and the growth when it is raised), whether or
not it is ever used; the other limits (per subject, message size, age) reserve nothing. So
the total is sized for what it must hold, not for the worst flood: the events a controller
has not read yet, which pile up only while no controller leads (a failover, seconds to
minutes). 64 MiB holds a join of 1000 nodes at the largest NodeJoined (~47 KB each) or
~15 000 usual events (2-5 KB); with 8 GB of ``max_file_store``
(deploy/config/nats-server.conf) a server holds the streams of ~120 jobs. A reservation
that does not fit is refused (``StreamStorageError``, :mod:`nats_bus`)."""
