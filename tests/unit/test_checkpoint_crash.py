"""SIGKILL the writer at random points of a save: the last commit survives; gc sweeps debris.

A child process saves step 2 over a committed step 1 and kills itself (SIGKILL, no cleanup)
inside its k-th object written, either before the write starts or after its first chunk
(k and the moment drawn from a seeded RNG: inside a shard, between shards, after the part,
before the marker, inside the marker). Another child saves continuously with retention while
the parent kills it after a random delay. After every kill: the newest committed checkpoint
loads and verifies, and ``gc`` leaves nothing but committed checkpoints and their own files.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
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

LAYERS = 5

CHILD = r"""
import os, signal, sys, torch
from sailor.checkpoint import LocalStorage, ParamState, TrainingGlobals, save_full

root, kill_at, when, loop = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4] == "loop"

# Counts objects written (each object of a write_all counts, in order) and kills the process
# before the kill_at-th one starts or after its first chunk.
class Killing(LocalStorage):
    calls = 0
    def _wrap(self, chunks):
        k = Killing.calls
        Killing.calls += 1
        def gen():
            if k == kill_at and when == "before":
                os.kill(os.getpid(), signal.SIGKILL)
            for i, c in enumerate(chunks):
                yield c
                if k == kill_at and i == 0:
                    os.kill(os.getpid(), signal.SIGKILL)
        return gen()
    def write(self, path, chunks):
        return super().write(path, self._wrap(chunks))
    def write_all(self, objects, **kw):
        return super().write_all([(p, self._wrap(c)) for p, c in objects], **kw)

g = torch.Generator().manual_seed(3)
state = {
    f"{l}.{n}": ParamState(*(torch.randn(256, 64, generator=g) for _ in range(3)), tp_dim=0)
    for l in range(LAYERS) for n in ("a", "b")
}
step = 2
while True:
    save_full(Killing(root), state, TrainingGlobals(step, step, {}), model="toy",
              num_layers=LAYERS, save_id=f"s{step}", keep=2)
    if not loop:
        break
    step += 1
""".replace("LAYERS", str(LAYERS))


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
    save_full(LocalStorage(tmp_path), _state(), TrainingGlobals(1, 1, {}), model="t", num_layers=5)
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path), str(k), when, "once"],
        capture_output=True,
        timeout=120,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    # Killed anywhere before the marker is durable: step 1 is still the newest commit.
    assert committed_steps(LocalStorage(tmp_path)) == [1]
    assert (tmp_path / step_dir(2)).exists()
    _check_recoverable(tmp_path, at_least=1)
    assert [p.name for p in tmp_path.iterdir()] == [step_dir(1)]


def test_sigkill_continuous_saver_at_random_times(tmp_path: Path) -> None:
    rng = random.Random(7)
    save_full(LocalStorage(tmp_path), _state(), TrainingGlobals(1, 1, {}), model="t", num_layers=5)
    for _ in range(3):
        proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(tmp_path), "-1", "none", "loop"],
            stderr=subprocess.PIPE,
        )
        # Wait until it is saving (a step beyond what is committed appears), then a bit more.
        start = latest_step(LocalStorage(tmp_path))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(
            int(p.name.split("-")[1]) > start for p in tmp_path.iterdir()
        ):
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.5))
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        assert proc.returncode == -signal.SIGKILL
        _check_recoverable(tmp_path, at_least=start)
