"""Token ids in an indexed data set outside its vocabulary: every rank raises the same
``LabelOutOfRangeError``, which names the ``.bin``, the sample and the id, before the update
(gloo, tiny-gpt, two data-parallel ranks).

The data's vocabulary (40, as its manifest would say) is smaller than the model's (64), and
the ``.bin`` holds id 50: the model can embed it, so before nothing noticed and the run
trained on ids the data's tokenizer never produces (an id at or past the model's vocabulary
was caught by the engine's screen alone, without the file or the sample). Now each batch is
checked against the data's vocabulary (one min and max) and the engine agrees the error.
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from sailor.data import IndexedDataset, IndexedDatasetWriter, TokenDataset
from sailor.megatron_patch.data import IndexedTokens
from sailor.megatron_patch.engine import TrainConfig, Trainer
from sailor.megatron_patch.groups import build_process_groups
from sailor.megatron_patch.launch import free_port
from sailor.megatron_patch.model import tiny_model
from sailor.megatron_patch.roles import role_of
from sailor.megatron_patch.vocab_parallel import LabelOutOfRangeError
from tests.integration.test_in_place_worker import DP2, GBS
from tests.spawn import spawn

DATA_VOCAB = 40
BAD_ID = 50


def _write(prefix: Path) -> None:
    """Documents of ids below ``DATA_VOCAB``, each with one ``BAD_ID``: every sample holds
    one (a window of 17 tokens spans a document of 12)."""
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for _ in range(40):
            doc = rng.integers(0, DATA_VOCAB, 12)
            doc[5] = BAD_ID
            w.add_document(doc)


def _data(prefix: str, seq_length: int) -> IndexedTokens:
    tokens = TokenDataset(IndexedDataset(prefix), seq_length, seed=0)
    return IndexedTokens(tokens, DATA_VOCAB, "the manifest ds.json")


def test_a_batch_names_the_file_sample_and_id(tmp_path: Path) -> None:
    _write(tmp_path / "ds")
    data = _data(str(tmp_path / "ds"), 16)
    with pytest.raises(LabelOutOfRangeError) as exc:
        data.batch(range(3, 5))
    text = str(exc.value)
    assert f"{tmp_path / 'ds.bin'}: sample 3 holds token id {BAD_ID} at position" in text
    assert f"outside the vocabulary [0, {DATA_VOCAB}) of the manifest ds.json" in text
    x, y, problem = data.checked_batch(range(3, 5))  # the engine's: noted, not raised
    assert problem == text and x.shape == y.shape == (2, 16)


def _rank_main(rank: int, root: str, port: int) -> None:
    torch.set_num_threads(1)
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
    data = _data(str(Path(root) / "ds"), spec.seq_length)
    tr = Trainer(DP2, spec, role, groups, TrainConfig(seed=0), torch.device("cpu"), data=data)
    out: dict[str, Any] = {}
    try:
        tr.run(2)
        out["error"] = None
    except Exception as exc:  # the type is what the test checks
        out["error"] = [type(exc).__name__, str(exc)]
    out["step"], out["vocab"] = tr.step, spec.vocab_size
    Path(root, f"{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


def test_every_rank_raises_the_same_error_naming_the_file(tmp_path: Path) -> None:
    _write(tmp_path / "ds")
    spawn(_rank_main, args=(str(tmp_path), free_port()), nprocs=2)
    outs = [json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1)]
    assert outs[0]["vocab"] > BAD_ID  # the model could embed it
    errors = [o["error"] for o in outs]
    assert errors[0] is not None and errors[0][0] == "LabelOutOfRangeError", errors
    assert errors[0] == errors[1], "every rank raises the same text"
    text = errors[0][1]
    assert f"[0, {DATA_VOCAB})" in text and f"the first id {BAD_ID}" in text
    assert f"(first: {tmp_path / 'ds.bin'}: sample " in text and f"token id {BAD_ID}" in text
    assert all(o["step"] == 0 for o in outs)  # nothing applied
