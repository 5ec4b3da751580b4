"""The control file the agent writes and every rank reads at each boundary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sailor.comm.codec import PeerObjectError
from sailor.megatron_patch.control import (
    ControlRequest,
    agree_target,
    gathered_targets,
    merge_drop_steps,
    read_control,
)
from sailor.megatron_patch.errors import failure_record


def test_a_save_request_carries_its_prune_point(tmp_path: Path) -> None:
    f = tmp_path / "control.json"
    f.write_text(json.dumps({"save_step": 12, "save_dir": "/ck", "prune_below": 9}))
    want = ControlRequest(save_step=12, save_dir="/ck", prune_below=9, drop_for=12)
    assert read_control(f) == want


@pytest.mark.parametrize("bad", [-3, "9", True, None, [9]])
def test_a_missing_or_malformed_prune_point_prunes_nothing(tmp_path: Path, bad: object) -> None:
    f = tmp_path / "control.json"
    f.write_text(json.dumps({"save_step": 12, "save_dir": "/ck", "prune_below": bad}))
    assert read_control(f).prune_below == -1
    f.write_text(json.dumps({"save_step": 12, "save_dir": "/ck"}))  # an older agent's file
    assert read_control(f).prune_below == -1


def test_a_save_request_carries_the_abandoned_steps_to_drop(tmp_path: Path) -> None:
    """``drop_steps`` (``Checkpoint.drop_steps``): a list of steps, sorted once each, with
    the save step it came with (``drop_for``); anything else, or none (an older
    controller's request), is None: no deletion of abandoned saves."""
    f = tmp_path / "control.json"
    req = {"save_step": 12, "save_dir": "/ck", "prune_below": 9}
    f.write_text(json.dumps(req | {"drop_steps": [11, 9, 11]}))
    assert read_control(f).drop_steps == (9, 11) and read_control(f).drop_for == 12
    f.write_text(json.dumps(req | {"drop_steps": []}))
    assert read_control(f).drop_steps == ()
    for bad in (None, 9, "9", [9, -1], [9, "10"], [True]):
        f.write_text(json.dumps(req | {"drop_steps": bad}))
        assert read_control(f).drop_steps is None, bad
    f.write_text(json.dumps(req))
    assert read_control(f).drop_steps is None
    # alone (no process group): the local request's own
    assert agree_target(read_control(f)) == ("/ck", None)
    one = ControlRequest(save_step=12, save_dir="/ck", drop_steps=(3,), drop_for=12)
    assert agree_target(one) == ("/ck", (3,))


def test_the_ranks_agree_the_intersection_of_the_agreed_requests_steps_to_drop() -> None:
    """Over the ranks whose request is the agreed save's (``drop_for`` == its step): the
    intersection; a rank holding an earlier request (its list sent before a step of it was
    saved again and recorded) counts for nothing; None if one of them has none (an older
    controller's), or if no rank holds the agreed request."""
    merge = merge_drop_steps
    assert merge([("/ck", 20, (5, 9)), ("/ck", 20, (9, 12)), ("", -1, None)], 20) == (9,)
    # rank 1 still holds the periodic request of step 10, which named 15: since then 15
    # was saved again and recorded, and the request of step 20 does not name it
    assert merge([("/ck", 20, (9,)), ("/ck", 10, (9, 15))], 20) == (9,)
    assert merge([("/ck", 20, (5,)), ("/ck", 20, None)], 20) is None
    assert merge([("/ck", 20, (5,)), ("/ck", 10, None)], 20) == (5,)
    assert merge([("", -1, None), ("", 20, (4,))], 20) is None
    assert merge([("/ck", 10, (4,))], 20) is None
    assert merge([("/ck", 20, ()), ("/ck", 20, ())], 20) == ()


_GOOD = ("/ck", 20, (5, 9))


def test_the_gathered_save_targets_are_each_ranks_own() -> None:
    got: list[object] = [_GOOD, ("", -1, None), ("/ck", 20, ())]
    assert gathered_targets(got) == got


@pytest.mark.parametrize(
    "bad",
    [
        None,
        ("/ck", 20),
        ("/ck", 20, (5,), 1),
        ["/ck", 20, (5,)],
        (7, 20, (5,)),
        ("/ck", "20", (5,)),
        ("/ck", True, (5,)),
        ("/ck", 20, [5]),
        ("/ck", 20, (5, "9")),
        ("/ck", 20, (5, -1)),
        ("/ck", 20, (False,)),
    ],
    ids=lambda bad: repr(bad),
)
def test_a_malformed_save_target_names_its_sender(bad: object) -> None:
    """A rank's object of the wrong shape is its fault: ``PeerObjectError`` naming it (its
    index in the gather), which the failure record carries as ``culprit``, where the gather
    used to skip it and decide on the other ranks' targets alone."""
    with pytest.raises(PeerObjectError, match=r"^rank 2 sent .*") as info:
        gathered_targets([_GOOD, _GOOD, bad, _GOOD])
    assert info.value.rank == 2
    record = failure_record(info.value, rank=0, step=20, in_training=True)
    assert record["origin"] == "peer" and record["culprit"] == 2


def test_a_periodic_save_request_is_optional(tmp_path: Path) -> None:
    f = tmp_path / "control.json"
    f.write_text(json.dumps({"save_step": 12, "save_dir": "/ck", "save_optional": True}))
    want = ControlRequest(save_step=12, save_dir="/ck", save_optional=True, drop_for=12)
    assert read_control(f) == want
    for bad in (1, "true", None):  # only JSON true: anything else is a required save
        f.write_text(json.dumps({"save_step": 12, "save_dir": "/ck", "save_optional": bad}))
        assert not read_control(f).save_optional


_MIXED = [
    # (rank 0's request, rank 1's) -> (agreed save step, optional)
    ((5, True), (5, False), (5, False)),
    ((5, True), (-1, False), (5, True)),
    # a required request of an earlier step is answered by the save agreed: required too
    ((7, True), (5, False), (7, False)),
    ((5, True), (7, False), (7, False)),
    ((5, True), (5, True), (5, True)),
]


def _agree_rank(rank: int, store: str, out: str) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from sailor.megatron_patch.control import agree

    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=2, timeout=timedelta(30)
    )
    got = []
    for case in _MIXED:
        step, optional = case[rank]
        req = ControlRequest(save_step=step, save_dir="/ck", save_optional=optional)
        agreed = agree(req, torch.device("cpu"))
        got.append([agreed.save_step, agreed.save_optional])
    dist.destroy_process_group()
    Path(out, f"r{rank}.json").write_text(json.dumps(got))


def test_ranks_agree_a_save_optional_only_if_none_knows_it_required(tmp_path: Path) -> None:
    """A reconfiguration's Checkpoint replaces a periodic request in the agent's file, and
    the nodes read it at different boundaries: the save agreed is required if any rank
    knows a required request, of that step or another (two gloo ranks)."""
    from tests.spawn import spawn

    spawn(_agree_rank, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    want = [list(c[2]) for c in _MIXED]
    for r in (0, 1):
        assert json.loads((tmp_path / f"r{r}.json").read_text()) == want
