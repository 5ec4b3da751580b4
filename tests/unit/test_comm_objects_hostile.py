"""A hostile rank cannot run code on its peers through the object collectives.

Three real gloo ranks. Rank 2 plays a compromised node: it speaks the object collectives'
wire protocol itself (the sizes, then the bytes, each a plain tensor collective: the same
as torch's own ``all_gather_object`` / ``broadcast_object_list``) and sends a crafted
pickle whose ``__reduce__`` writes a marker file where the receiver unpickles it. Before,
every receiver unpickled it (torch's own collectives with polling off, ``pickle.loads`` in
``sailor.comm.objects`` with it on) and the marker appeared; now no receiver runs it, and
each raises ``PeerObjectError`` naming rank 2. Then the same world goes on: an honest rank
whose object cannot be encoded raises its own ``TypeError`` while the others raise naming
it, and an announced size out of bounds is refused before anything that large is
allocated; nobody is left waiting in a collective.
"""

from __future__ import annotations

import json
import pickle
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from sailor.checkpoint.checkpointer import agree_save_start
from sailor.comm import abort
from sailor.comm import api as comm
from sailor.comm.codec import PeerObjectError, decode, encode, expect
from sailor.megatron_patch.bad_labels import LabelWatch
from sailor.megatron_patch.errors import classify
from sailor.megatron_patch.in_place import handshake
from sailor.megatron_patch.step_agreement import HOST_NAME_MAX, gathered_hosts, rank_hosts
from sailor.profiler.collective_probe import gather_times, gathered_times
from sailor.profiler.timing import Stats
from tests.spawn import spawn

_HOSTILE = 2


class _Payload:
    """Unpickling it runs ``exec`` of code that writes ``<stem>-<pid>`` (the receiver's)."""

    def __init__(self, stem: str) -> None:
        self.stem = stem

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        code = f"open({self.stem!r} + '-' + str(__import__('os').getpid()), 'w').write('ran')"
        return (exec, (code,))


def _hostile_gather(blob: bytes) -> None:
    size = torch.tensor([len(blob)], dtype=torch.int64)
    sizes = [torch.zeros_like(size) for _ in range(3)]
    dist.all_gather(sizes, size)
    longest = max(int(s.item()) for s in sizes)
    data = torch.zeros(longest, dtype=torch.uint8)
    data[: len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    dist.all_gather([torch.empty(longest, dtype=torch.uint8) for _ in range(3)], data)


def _hostile_broadcast(blob: bytes) -> None:
    dist.broadcast(torch.tensor([len(blob)], dtype=torch.int64), src=_HOSTILE)
    dist.broadcast(torch.frombuffer(bytearray(blob), dtype=torch.uint8), src=_HOSTILE)


def _outcome(call: Any, *args: Any, **kwargs: Any) -> str:
    try:
        call(*args, **kwargs)
    except PeerObjectError as exc:
        return f"PeerObjectError rank={exc.rank}: {exc}"
    except TypeError as exc:
        return f"TypeError: {exc}"
    return "no error"


def _rank(rank: int, store: str, out: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=3,
        timeout=timedelta(seconds=60),
    )  # fmt: skip
    got: dict[str, str] = {}
    for polled in (False, True):  # each path the backend takes
        abort.set_polling(polled)
        if rank == _HOSTILE:
            _hostile_gather(pickle.dumps(_Payload(str(Path(out, f"ran-gather-{polled}")))))
            _hostile_broadcast(pickle.dumps(_Payload(str(Path(out, f"ran-bcast-{polled}")))))
            continue
        got[f"gather-{polled}"] = _outcome(comm.all_gather_object, [None] * 3, ("ok", rank))
        got[f"bcast-{polled}"] = _outcome(comm.broadcast_object_list, [None], src=_HOSTILE)
    abort.set_polling(False)
    # an honest rank whose object cannot be sent: its own TypeError, the others name it
    outs = [None] * 3
    got["unencodable"] = _outcome(
        lambda: comm.all_gather_object(outs, {1, 2} if rank == 1 else rank)
    )
    # an announced size out of bounds: refused before its buffer is allocated
    # and one under the per-object bound whose gather (3 x 100 MiB) is over it
    for key, announced in (("huge", 1 << 40), ("wide", 100 << 20)):
        if rank == _HOSTILE:
            size = torch.tensor([announced], dtype=torch.int64)
            dist.all_gather([torch.zeros_like(size) for _ in range(3)], size)
        else:
            got[key] = _outcome(comm.all_gather_object, [None] * 3, rank)
    dist.barrier()
    # objects that decode but are not what the call site reads: the sender is named too
    if rank == _HOSTILE:
        comm.all_gather_object([None] * 3, ["not", "a", "tuple"])  # agree_save_start
        comm.all_gather_object([None] * 3, (0, -1, False, "p", 0, "{not json", ""))  # handshake
        comm.all_gather_object([None] * 3, (0, -1, False, "p", 0, "{}", ""))  # handshake again
        comm.broadcast_object_list(["not a plan"], src=_HOSTILE)
        comm.all_gather_object([None] * 3, ("h", "1", 1, 0, ""))  # raise_agreed
        comm.all_gather_object([None] * 3, ["not", "a", "host"])  # rank_hosts
        nan = {"median_s": float("nan"), "stdev_s": 0.0, "n": 5, "mean_s": 0.0}
        comm.all_gather_object([None] * 3, {"8": nan})  # the all-reduce probe's times
    else:
        got["save_start"] = _outcome(agree_save_start, None)
        got["held"] = _outcome(handshake, None, -1, rank, 3)
        got["plan"] = _outcome(handshake, None, -1, rank, 3)
        watch = LabelWatch(vocab_size=8)
        got["labels"] = _outcome(watch.raise_agreed, (_HOSTILE,), 3, "batch", 0)
        got["hosts"] = _outcome(rank_hosts, (0,))
        got["times"] = _outcome(gather_times, {"8": Stats.of([1e-4]).to_dict()}, [8])
    dist.barrier()  # everyone left the collectives above
    Path(out, f"r{rank}.json").write_text(json.dumps(got))
    dist.destroy_process_group()


def test_a_crafted_pickle_runs_nothing_and_names_its_sender(tmp_path: Path) -> None:
    spawn(_rank, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=3)
    ran = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("ran-"))
    assert ran == [], f"a peer's pickle ran code on a receiver: {ran}"
    for rank in (0, 1):
        got = json.loads((tmp_path / f"r{rank}.json").read_text())
        for polled in ("False", "True"):
            for op in ("gather", "bcast"):
                assert got[f"{op}-{polled}"].startswith("PeerObjectError rank=2: rank 2 sent"), got
        assert got["huge"].startswith("PeerObjectError rank=2: rank 2 announced"), got
        assert got["wide"].startswith(
            f"PeerObjectError rank=2: rank 2 announced an object of {100 << 20} bytes, times 3"
        ), got
        assert got["save_start"].startswith("PeerObjectError rank=2: rank 2 sent ['not'"), got
        assert "its save id and failure flag: (str, bool) expected" in got["save_start"], got
        assert got["held"].startswith("PeerObjectError rank=2: rank 2 sent its scaling state"), got
        assert got["plan"].startswith("PeerObjectError rank=2: rank 2 sent the old plan"), got
        assert got["labels"].startswith("PeerObjectError rank=2: rank 2 sent ('h', '1'"), got
        assert got["hosts"] == (
            "PeerObjectError rank=2: rank 2 sent ['not', 'a', 'host'] as its host name: "
            "str expected"
        ), got
        assert got["times"] == (
            "PeerObjectError rank=2: rank 2 sent times['8']['median_s']=nan: a finite float "
            ">= 0 expected"
        ), got
    assert json.loads((tmp_path / "r1.json").read_text())["unencodable"].startswith(
        "TypeError: obj: an object collective sends"
    )
    for rank in (0, 2):
        got = json.loads((tmp_path / f"r{rank}.json").read_text())
        assert got["unencodable"].startswith("PeerObjectError rank=1: rank 1 could not"), got


_VALUES = [
    None,
    True,
    0,
    -(10**30),
    2.5,
    float("inf"),
    "",
    "ünïcode \x00",
    b"\x00\xff",
    [],
    (),
    [1, (2, [3, {"k": b"v"}])],
    {"a": 1, 2: "b", (3, "c"): None, None: [1.5]},
    ("step", 7, (1, 2), None),
]


@pytest.mark.parametrize("value", _VALUES, ids=[f"v{i}" for i in range(len(_VALUES))])
def test_codec_round_trips_every_type_exactly(value: Any) -> None:
    back = decode(encode(value), 0)
    assert back == value and repr(back) == repr(value)


def test_codec_round_trips_nan() -> None:
    back = decode(encode((float("nan"),)), 0)
    assert isinstance(back, tuple) and back[0] != back[0]


@pytest.mark.parametrize(
    ("value", "named"),
    [
        ({1}, "builtins.set"),
        ([1, object()], "obj[1]"),
        (ValueError, "builtins.type"),
        (True.__class__.__mro__, "builtins.type"),
        (bytearray(b"x"), "builtins.bytearray"),
    ],
    ids=["set", "nested-object", "a-class", "classes-in-tuple", "bytearray"],
)
def test_codec_refuses_other_types_naming_them(value: Any, named: str) -> None:
    with pytest.raises(TypeError, match="an object collective sends") as info:
        encode(value)
    assert named in str(info.value)


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (pickle.dumps(("a", 1)), "does not decode"),
        (b"\xff\xfe", "UnicodeDecodeError"),
        (b'{"pickle": "x"}', "'pickle'"),
        (b'{"tuple": [1], "bytes": "AA=="}', "exactly one expected"),
        (b'{"bytes": "@@"}', "not base64"),
        (b'{"dict": [[[1], 2]]}', "unhashable dict key"),
        (b'{"dict": [[1]]}', "pair expected"),
        (b"[" * 100000, "RecursionError"),
    ],
    ids=[
        "pickle",
        "not-utf8",
        "unknown-tag",
        "two-tags",
        "bad-base64",
        "list-key",
        "bad-pair",
        "deep",
    ],
)
def test_codec_names_the_sender_of_bytes_that_do_not_decode(raw: bytes, says: str) -> None:
    with pytest.raises(PeerObjectError, match="rank 5 sent an object that does not decode") as info:
        decode(raw, 5)
    assert says in str(info.value) and info.value.rank == 5


def test_a_peers_undecodable_object_is_charged_to_the_peer() -> None:
    exc = PeerObjectError("rank 2 sent an object that does not decode: x", rank=2)
    assert classify(exc, in_training=True) == "peer"
    assert classify(exc, in_training=False) == "peer"  # a ValueError, yet not a config error


@pytest.mark.parametrize(
    ("value", "shape", "ok"),
    [
        (("a", True), (str, bool), True),
        (("a", 1), (str, bool), False),
        ((True, "a"), (int, str), False),  # a bool is no int here
        (None, frozenset({int, None}), True),
        (3, frozenset({int, None}), True),
        ("3", frozenset({int, None}), False),
        (["a", True], (str, bool), False),  # a list is no tuple
        (("a",), (str, bool), False),
    ],
    ids=["tuple", "int-for-bool", "bool-for-int", "none", "alt", "str-for-int", "list", "short"],
)
def test_expect_checks_exact_shapes(value: Any, shape: Any, ok: bool) -> None:
    if ok:
        assert expect(value, shape, 4, "a thing") is value
        return
    with pytest.raises(PeerObjectError, match=r"^rank 4 sent .* as a thing: .* expected") as e:
        expect(value, shape, 4, "a thing")
    assert e.value.rank == 4


_GOOD = {"median_s": 1e-4, "stdev_s": 0.0, "n": 5, "mean_s": 1e-4}


@pytest.mark.parametrize(
    ("sent", "says"),
    [
        ([1], "rank 1 sent times [1]: a dict of the sizes ['8', '64'] expected"),
        ({"8": _GOOD}, "rank 1 sent times ['8']: a dict of the sizes ['8', '64'] expected"),
        ({"8": _GOOD, "64": [1]}, "rank 1 sent times['64']=[1]: a dict of"),
        ({"8": _GOOD, "64": {**_GOOD, "n": 0}}, "times['64']['n']=0: an int >= 1 expected"),
        ({"8": _GOOD, "64": {**_GOOD, "n": True}}, "times['64']['n']=True: an int >= 1"),
        ({"8": _GOOD, "64": {**_GOOD, "stdev_s": -1.0}}, "['stdev_s']=-1.0: a finite float"),
        ({"8": _GOOD, "64": {**_GOOD, "mean_s": float("inf")}}, "['mean_s']=inf: a finite"),
        ({"8": _GOOD, "64": {**_GOOD, "mean_s": "1"}}, "['mean_s']=1: a finite float >= 0"),
    ],
    ids=["not-a-dict", "a-size-missing", "stats-not-a-dict", "no-reps", "a-bool", "negative",
         "infinite", "a-str"],
)  # fmt: skip
def test_the_probes_gathered_times_name_a_malformed_sender(sent: object, says: str) -> None:
    good = {"8": _GOOD, "64": _GOOD}
    assert gathered_times([good, good], [8, 64]) == [good, good]
    with pytest.raises(PeerObjectError, match=r"^rank 1 sent") as info:
        gathered_times([good, sent], [8, 64])
    assert info.value.rank == 1 and says in str(info.value)


@pytest.mark.parametrize(
    ("sent", "says"),
    [
        (None, "rank 1 sent None as its host name: str expected"),
        ("", "rank 1 sent a host name of 0 characters"),
        ("h" * (HOST_NAME_MAX + 1), f"of {HOST_NAME_MAX + 1} characters ('hhhh"),
    ],
    ids=["none", "empty", "too-long"],
)
def test_gathered_hosts_name_a_malformed_sender(sent: object, says: str) -> None:
    assert gathered_hosts(["a", "b" * HOST_NAME_MAX]) == ["a", "b" * HOST_NAME_MAX]
    with pytest.raises(PeerObjectError) as info:
        gathered_hosts(["a", sent])
    assert info.value.rank == 1 and says in str(info.value)
