"""Replay per-rank communication logs under NCCL's semantics: deadlock or mismatch, or ok.

The model (what NCCL guarantees and no more):

- **One ordered channel per rank pair**, shared by both directions. On each side, an
  operation starts only when the side's earlier operations on that channel are complete,
  except operations posted in the same ``batch_isend_irecv`` (one NCCL group), which start
  together.
- **Rendezvous**: a send completes only when the peer's matching receive has started (no
  eager buffering; real NCCL buffers small messages, large ones do not). The ``k``-th send
  from ``a`` to ``b`` matches the ``k``-th receive of ``b`` from ``a``; their dtype and
  element count must agree (tags do not exist).
- **Posting does not block**; a ``wait`` on a batch blocks its rank until every operation of
  the batch is complete.
- **Collectives block**: the ``k``-th collective of a group completes when every member has
  reached its ``k``-th collective on that group; kind, dtype, element count and root/op
  must agree.
- A rank at the end of its log still needs its posted operations to complete.

Pure: no torch, no I/O. Logs come from ``sailor.comm.strict`` (or are written by hand).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

__all__ = ["P2P_KINDS", "CommOp", "ReplayResult", "Stuck", "replay"]

P2P_KINDS = frozenset({"send", "recv"})


@dataclass(frozen=True)
class CommOp:
    """One call a rank made, in issue order.

    ``kind`` is ``send``/``recv`` (posted in batch ``batch`` to global rank ``peer``),
    ``wait`` (on batch ``batch``), or a collective's name on the global ranks ``group``.
    """

    kind: str
    batch: int = -1
    peer: int = -1
    group: tuple[int, ...] = ()
    dtype: str = ""
    shape: tuple[int, ...] = ()
    numel: int = 0
    device: str = ""
    detail: str = ""
    """Reduce op or root of a collective ("" for p2p)."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @staticmethod
    def from_json(line: str) -> CommOp:
        d: dict[str, Any] = json.loads(line)
        d["group"] = tuple(d.get("group", ()))
        d["shape"] = tuple(d.get("shape", ()))
        return CommOp(**d)

    def describe(self) -> str:
        if self.kind in P2P_KINDS:
            where = "to" if self.kind == "send" else "from"
            return (
                f"{self.kind} {where} {self.peer} ({self.dtype}x{self.numel}, batch {self.batch})"
            )
        if self.kind == "wait":
            return f"wait on batch {self.batch}"
        return f"{self.kind} on {list(self.group)} ({self.dtype}x{self.numel} {self.detail})"


@dataclass(frozen=True)
class Stuck:
    """A rank that cannot go on: the op it is at (index in its log) and why."""

    rank: int
    index: int
    op: str
    reason: str


@dataclass(frozen=True)
class ReplayResult:
    """Outcome of a replay: ``ok``, or the deadlock or mismatch with the ranks involved."""

    status: Literal["ok", "deadlock", "mismatch"]
    stuck: tuple[Stuck, ...] = ()
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass(eq=False)
class _Posted:
    rank: int
    index: int
    op: CommOp
    done: bool = False
    started: bool = False


@dataclass
class _State:
    pc: dict[int, int]
    side: dict[tuple[int, int], list[_Posted]] = field(default_factory=dict)
    """(rank, peer) -> ops of ``rank`` on the channel to ``peer``, in posting order."""
    direction: dict[tuple[str, int, int], list[_Posted]] = field(default_factory=dict)
    """(kind, src, dst) -> posted sends of src to dst / receives of dst from src, in order."""
    matched: dict[tuple[int, int], int] = field(default_factory=dict)
    batches: dict[tuple[int, int], list[_Posted]] = field(default_factory=dict)
    coll_count: dict[tuple[int, tuple[int, ...]], int] = field(default_factory=dict)
    arrived: dict[int, tuple[tuple[int, ...], int]] = field(default_factory=dict)


def _post(st: _State, rank: int, index: int, op: CommOp) -> None:
    p = _Posted(rank, index, op)
    st.side.setdefault((rank, op.peer), []).append(p)
    key = ("send", rank, op.peer) if op.kind == "send" else ("recv", op.peer, rank)
    st.direction.setdefault(key, []).append(p)
    st.batches.setdefault((rank, op.batch), []).append(p)


def _mark_started(st: _State) -> None:
    # Batches are posted contiguously, so on one side the started ops are the done ones and
    # those of the first undone op's batch.
    for ops in st.side.values():
        head: int | None = None
        for p in ops:
            if p.done:
                continue
            if head is None:
                head = p.op.batch
            if p.op.batch != head:
                break
            p.started = True


def _advance_p2p(st: _State) -> tuple[bool, ReplayResult | None]:
    progress = False
    for (_, src, dst), sends in st.direction.items():
        if _ != "send":
            continue
        recvs = st.direction.get(("recv", src, dst), [])
        k = st.matched.get((src, dst), 0)
        while k < min(len(sends), len(recvs)):
            s, r = sends[k], recvs[k]
            if (s.op.dtype, s.op.numel) != (r.op.dtype, r.op.numel):
                return progress, ReplayResult(
                    "mismatch",
                    (
                        Stuck(src, s.index, s.op.describe(), "send does not match the receive"),
                        Stuck(dst, r.index, r.op.describe(), "receive does not match the send"),
                    ),
                    f"send {src}->{dst} #{k}: {s.op.dtype}x{s.op.numel} vs receive "
                    f"{r.op.dtype}x{r.op.numel}",
                )
            if not (s.started and r.started):
                break
            s.done = r.done = True
            k += 1
            progress = True
        st.matched[(src, dst)] = k
    return progress, None


def _signature(op: CommOp) -> tuple[str, str, int, str]:
    return (op.kind, op.dtype, op.numel, op.detail)


def _advance_collectives(
    st: _State, logs: Mapping[int, Sequence[CommOp]]
) -> tuple[bool, ReplayResult | None]:
    progress = False
    for rank, (group, k) in list(st.arrived.items()):
        if rank not in st.arrived:
            continue
        if any(st.arrived.get(m) != (group, k) for m in group):
            continue
        ops = {m: logs[m][st.pc[m]] for m in group}
        sigs = {m: _signature(op) for m, op in ops.items()}
        if len(set(sigs.values())) > 1:
            return progress, ReplayResult(
                "mismatch",
                tuple(Stuck(m, st.pc[m], ops[m].describe(), "collective differs") for m in group),
                f"collective #{k} on {list(group)} differs between members: {sigs}",
            )
        for m in group:
            del st.arrived[m]
            st.pc[m] += 1
        progress = True
    return progress, None


def _run_rank(st: _State, rank: int, log: Sequence[CommOp]) -> bool:
    progress = False
    while st.pc[rank] < len(log) and rank not in st.arrived:
        i = st.pc[rank]
        op = log[i]
        if op.kind in P2P_KINDS:
            _post(st, rank, i, op)
        elif op.kind == "wait":
            if not all(p.done for p in st.batches.get((rank, op.batch), [])):
                break
        else:
            group = op.group
            k = st.coll_count.get((rank, group), 0)
            st.coll_count[(rank, group)] = k + 1
            st.arrived[rank] = (group, k)
            return True
        st.pc[rank] = i + 1
        progress = True
    return progress


def _why(st: _State, p: _Posted) -> str:
    if not p.started:
        first = next(q for q in st.side[(p.rank, p.op.peer)] if not q.done)
        busy = f"#{first.index} {first.op.describe()}"
        return f"not started: channel to {p.op.peer} busy with its {busy}"
    other = "recv" if p.op.kind == "send" else "send"
    return f"started, waiting for {p.op.peer} to start the matching {other}"


def _deadlock(st: _State, logs: Mapping[int, Sequence[CommOp]]) -> ReplayResult:
    stuck: list[Stuck] = []
    for rank, log in sorted(logs.items()):
        i = st.pc[rank]
        if i < len(log):
            op = log[i]
            if op.kind == "wait":
                undone = [p for p in st.batches.get((rank, op.batch), []) if not p.done]
                reason = "; ".join(f"{p.op.describe()}: {_why(st, p)}" for p in undone)
            else:
                group, _ = st.arrived.get(rank, ((), 0))
                missing = [m for m in group if st.arrived.get(m) != st.arrived.get(rank)]
                reason = f"waiting for ranks {missing} to reach it"
            stuck.append(Stuck(rank, i, op.describe(), reason))
            continue
        for p in (q for ops in st.batches.values() for q in ops):
            if p.rank == rank and not p.done:
                stuck.append(
                    Stuck(rank, p.index, p.op.describe(), "never completes: " + _why(st, p))
                )
    lines = [f"rank {s.rank} at #{s.index} {s.op}: {s.reason}" for s in stuck]
    return ReplayResult("deadlock", tuple(stuck), "deadlock:\n" + "\n".join(lines))


def replay(logs: Mapping[int, Sequence[CommOp]]) -> ReplayResult:
    """Replay every rank's log (global rank -> ops in issue order) under NCCL semantics."""
    for rank, log in logs.items():
        for i, op in enumerate(log):
            if op.kind in P2P_KINDS and (op.peer == rank or op.peer not in logs):
                return ReplayResult(
                    "mismatch",
                    (Stuck(rank, i, op.describe(), "peer is not another rank of the logs"),),
                    f"rank {rank} #{i}: {op.describe()}",
                )
            if (
                op.kind not in P2P_KINDS
                and op.kind != "wait"
                and (rank not in op.group or any(m not in logs for m in op.group))
            ):
                return ReplayResult(
                    "mismatch",
                    (
                        Stuck(
                            rank,
                            i,
                            op.describe(),
                            "group is not a set of ranks of the logs holding this rank",
                        ),
                    ),
                    f"rank {rank} #{i}: {op.describe()}",
                )
    st = _State(pc=dict.fromkeys(logs, 0))
    progress = True
    while progress:
        progress = False
        for rank, log in logs.items():
            progress |= _run_rank(st, rank, log)
        _mark_started(st)
        moved, bad = _advance_p2p(st)
        if bad is not None:
            return bad
        progress |= moved
        moved, bad = _advance_collectives(st, logs)
        if bad is not None:
            return bad
        progress |= moved
    finished = all(st.pc[r] == len(log) for r, log in logs.items())
    if finished and all(p.done for ops in st.batches.values() for p in ops):
        return ReplayResult("ok")
    return _deadlock(st, logs)
