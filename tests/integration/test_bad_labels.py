"""A label outside the vocabulary on one pipeline's microbatch: every rank raises the same
``LabelOutOfRangeError`` before the update, none waits in a collective (gloo, tiny-gpt, two
data-parallel ranks).

The bad id is in a sample of pipeline 1 only, so only rank 1 reads it. Before, rank 1 raised
at once (from the engine's host check) and rank 0 waited in the gradient all-reduce until the
process group's timeout (under NCCL: a hang until the controller's abort); its node and rank
1's were charged. Now the engine notes it, masks it, and every rank raises the same error
after the iteration's one collective. Removing the engine's check (``Trainer._batch``) makes
rank 1 raise from ``vocab_cross_entropy`` alone again: this test fails then too. The
``token`` case puts the bad id in the input too, as a badly tokenized sample does (the labels
are the inputs shifted by one): before, the first stage's embedding raised on it alone
(review).
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from sailor.megatron_patch.data import SyntheticTokens
from sailor.megatron_patch.engine import TrainConfig, Trainer
from sailor.megatron_patch.groups import build_process_groups
from sailor.megatron_patch.launch import free_port
from sailor.megatron_patch.model import tiny_model
from sailor.megatron_patch.roles import role_of
from tests.integration.test_in_place_worker import DP2, GBS
from tests.spawn import spawn

BAD_ITERATION = 1
BAD_SAMPLE = BAD_ITERATION * GBS + 3
"""The last sample of iteration 1: pipeline 1's (DP2: samples 2-3 of each batch)."""


class _BadLabelAt:
    def __init__(self, inner: SyntheticTokens, sample: int, vocab: int, token: bool) -> None:
        self.inner, self.sample, self.vocab, self.token = inner, sample, vocab, token

    def batch(self, indices: range | list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.inner.batch(indices)
        if self.sample in indices:
            i = list(indices).index(self.sample)
            x, y = x.clone(), y.clone()
            y[i, 5] = self.vocab + 7
            if self.token:
                x[i, 6] = self.vocab + 7
        return x, y


def _rank_main(rank: int, root: str, port: int, token: bool) -> None:
    torch.set_num_threads(1)
    # a short timeout: the code before this fix left rank 0 in the all-reduce until it
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=20),
    )
    spec = tiny_model(DP2.model, GBS)
    role = role_of(DP2, rank)
    groups = build_process_groups(DP2, role, spec.tie_embeddings, 20.0)
    cfg = TrainConfig(seed=0)
    data = _BadLabelAt(
        SyntheticTokens(spec.vocab_size, spec.seq_length, 0), BAD_SAMPLE, spec.vocab_size, token
    )
    tr = Trainer(DP2, spec, role, groups, cfg, torch.device("cpu"), data=data)
    out: dict[str, Any] = {}
    try:
        tr.run(3)
        out["error"] = None
    except Exception as exc:  # the type is what the test checks
        out["error"] = [type(exc).__name__, str(exc)]
    out["step"], out["vocab"] = tr.step, spec.vocab_size
    out["finite"] = all(bool(torch.isfinite(p).all()) for p in tr.stage.parameters())
    Path(root, f"{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


@pytest.fixture(scope="module", params=["label", "token"])
def outs(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("bad-labels")
    spawn(_rank_main, args=(str(root), free_port(), request.param == "token"), nprocs=2)
    return [json.loads((root / f"{r}.json").read_text()) for r in (0, 1)]


def test_every_rank_raises_the_same_label_error_before_the_update(
    outs: list[dict[str, Any]],
) -> None:
    errors = [o["error"] for o in outs]
    assert errors[0] is not None and errors[0][0] == "LabelOutOfRangeError", errors
    assert errors[0] == errors[1], "every rank raises the same text (the controller's grouping)"
    text = errors[0][1]
    vocab = outs[0]["vocab"]
    assert f"step {BAD_ITERATION + 1}:" in text and f"[0, {vocab})" in text
    assert f"the first id {vocab + 7}" in text and "rank 1 (" in text and "rank 0 (" not in text
    assert f"samples {BAD_ITERATION * GBS}..{BAD_ITERATION * GBS + GBS - 1}" in text
    for o in outs:  # the bad iteration's update was not applied, nothing non-finite
        assert o["step"] == BAD_ITERATION and o["finite"]
