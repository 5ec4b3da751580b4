"""SIGKILL the writer at random points of a save: the last commit survives; gc sweeps debris.

A child process saves step 2 over a committed step 1 and kills itself (SIGKILL, no cleanup)
inside its k-th object written, either before the write starts or after its first chunk
(k and the moment drawn from a seeded RNG: inside a shard, between shards, after the part,
before the marker, inside the marker). Another child saves continuously with retention while
the parent kills it after a random delay. After every kill: the newest committed checkpoint
loads and verifies, and ``gc`` leaves nothing but committed checkpoints and their own files.
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Iterable, Iterator, Sequence
from multiprocessing.process import BaseProcess
from pathlib import Path

import pytest
import torch

from sailor.checkpoint import (
    LocalStorage,
    ParamState,
    TrainingGlobals,
    collect,
    committed_steps,
    latest_step,
    load,
    read_manifest,
    save_full,
    verify,
)
from sailor.checkpoint.format import MARKER, step_dir
from sailor.checkpoint.storage import Chunk
from tests.spawn import start_process

LAYERS = 5


class _Killing(LocalStorage):
    """Counts objects written (each object of a write_all counts, in order) and kills the
    process before the ``kill_at``-th one starts (``when="before"``) or after its first
    chunk (``"after"``)."""

    def __init__(self, root: str, kill_at: int, when: str) -> None:
        super().__init__(root)
        self.kill_at, self.when, self.calls = kill_at, when, 0

    def _wrap(self, chunks: Iterable[Chunk]) -> Iterator[Chunk]:
        k = self.calls
        self.calls += 1

        def gen() -> Iterator[Chunk]:
            if k == self.kill_at and self.when == "before":
                os.kill(os.getpid(), signal.SIGKILL)
            for i, c in enumerate(chunks):
                yield c
                if k == self.kill_at and i == 0:
                    os.kill(os.getpid(), signal.SIGKILL)

        return gen()

    def write(self, path: str, chunks: Iterable[Chunk]) -> int:
        return super().write(path, self._wrap(chunks))

    def write_all(
        self, objects: Sequence[tuple[str, Iterable[Chunk]]], *, workers: int = 4
    ) -> list[int]:
        return super().write_all([(p, self._wrap(c)) for p, c in objects], workers=workers)


def _child(root: str, kill_at: int, when: str, loop: bool) -> None:
    """The saving child: step 2 (and, with ``loop``, every next step, keeping two) over
    ``root``; its stderr goes beside ``root`` (:func:`_stderr_path`)."""
    err = os.open(_stderr_path(root), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(err, 2)
    g = torch.Generator().manual_seed(3)
    state = {
        f"{layer}.{n}": ParamState(*(torch.randn(256, 64, generator=g) for _ in range(3)), tp_dim=0)
        for layer in range(LAYERS)
        for n in ("a", "b")
    }
    storage = _Killing(root, kill_at, when)
    step = 2
    while True:
        save_full(
            storage,
            state,
            TrainingGlobals(step, step, {}),
            model="toy",
            num_layers=LAYERS,
            save_id=f"s{step}",
            keep=2,
        )
        if not loop:
            break
        step += 1


def _start_child(root: Path, kill_at: int, when: str, loop: bool) -> BaseProcess:
    """:func:`_child` in a process of its own, forked ready (torch and the checkpoint code
    imported) by the tests' fork server: a fresh interpreter spent ~2 s of CPU on imports
    for a save of a few MB."""
    return start_process(_child, args=(str(root), kill_at, when, loop))


def _stderr_path(root: str | Path) -> Path:
    return Path(root).parent / "child-stderr.txt"


def _stderr(root: Path) -> str:
    f = _stderr_path(root)
    return f.read_text(errors="replace")[-2000:] if f.exists() else ""


def _state() -> dict[str, ParamState]:
    return {
        f"{layer}.{n}": ParamState(*(torch.full((4, 4), float(layer)) for _ in range(3)))
        for layer in range(LAYERS)
        for n in ("a", "b")
    }


def _check_recoverable(root: Path, at_least: int) -> None:
    s = LocalStorage(root)
    step = latest_step(s)
    assert step >= at_least
    assert verify(s, step) == []
    got = load(s, range(LAYERS), tp_rank=1, tp_size=2)
    assert got.globals.step == step and len(got.params) == 2 * LAYERS
    collect(s)
    for name in s.listdir(""):
        assert (root / name / MARKER).exists(), f"gc left uncommitted {name}"
        stp = int(name.split("-")[1])
        m = read_manifest(s, stp)
        keep = {"manifest.json", MARKER, *(sh.path for sh in m.shards)}
        extra = [f for f in s.walk(name) if f.split("/", 1)[1] not in keep and "/parts/" not in f]
        assert extra == [], extra
        assert verify(s, stp) == []


# Objects of one save: LAYERS shards (written in parallel, so the others are mid-write too),
# one part, one manifest, one marker.
# Always the riskiest two (inside the manifest, inside the marker), plus a seeded random sample.
_ALL = [(k, w) for k in range(LAYERS + 3) for w in ("before", "after")]
_RISKY = [(LAYERS + 1, "after"), (LAYERS + 2, "after")]
_SAMPLE = random.Random(2024).sample([p for p in _ALL if p not in _RISKY], 5)
_POINTS = [
    *_RISKY,
    _SAMPLE[0],
    *(pytest.param(*p, marks=pytest.mark.long) for p in _SAMPLE[1:]),  # make long-test
]


@pytest.mark.parametrize(("k", "when"), _POINTS)
def test_sigkill_at_random_write(tmp_path: Path, k: int, when: str) -> None:
    root = tmp_path / "ckpt"  # the child's stderr beside it
    save_full(LocalStorage(root), _state(), TrainingGlobals(1, 1, {}), model="t", num_layers=5)
    proc = _start_child(root, k, when, loop=False)
    proc.join(120)
    if proc.exitcode is None:  # hung: never leave it running
        proc.kill()
        proc.join()
    assert proc.exitcode == -signal.SIGKILL, _stderr(root)
    # Killed anywhere before the marker is durable: step 1 is still the newest commit.
    assert committed_steps(LocalStorage(root)) == [1]
    assert (root / step_dir(2)).exists()
    _check_recoverable(root, at_least=1)
    assert [p.name for p in root.iterdir()] == [step_dir(1)]


def test_sigkill_continuous_saver_at_random_times(tmp_path: Path) -> None:
    rng = random.Random(7)
    root = tmp_path / "ckpt"  # the child's stderr beside it
    save_full(LocalStorage(root), _state(), TrainingGlobals(1, 1, {}), model="t", num_layers=5)
    for _ in range(3):
        proc = _start_child(root, -1, "none", loop=True)
        # Wait until it is saving (a step beyond what is committed appears), then a bit more.
        start = latest_step(LocalStorage(root))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(
            int(p.name.split("-")[1]) > start for p in root.iterdir()
        ):
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.5))
        proc.kill()
        proc.join(30)
        assert proc.exitcode == -signal.SIGKILL, _stderr(root)
        _check_recoverable(root, at_least=start)
