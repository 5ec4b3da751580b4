"""Workers are started with the caching allocator's settings in their environment.

``PYTORCH_CUDA_ALLOC_CONF`` is read once, at the allocator's first use: set by the worker
itself after ``import torch`` it comes too late if anything allocated first. So the agent's
supervisor and ``launch_local`` put it in the environment the process starts with
(``devices.worker_env``), the user's own setting winning; a stand-in worker
(``env_probe``) reports what it was started with.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest

from sailor.agent.supervisor import Supervisor
from sailor.megatron_patch.launch import launch_local
from tests.integration.test_worker_signals import PLAN, launch_of

ROOT = Path(__file__).resolve().parents[2]
PROBE = (sys.executable, "-m", "tests.integration.env_probe")


@pytest.fixture
def probe_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    return monkeypatch


async def _started_by_agent(run_dir: Path) -> dict[str, object]:
    argv = (*PROBE, "--rank", "{rank}", "--progress", "{run_dir}/env-{rank}.jsonl", "--hold")
    sup = Supervisor(run_dir, worker_argv=argv)
    await sup.launch(launch_of(PLAN))
    try:
        report = run_dir / "gen-00001" / "env-0.jsonl"
        async with asyncio.timeout(60):
            while not report.exists() or not report.read_text().endswith("\n"):
                await asyncio.sleep(0.05)
        line: dict[str, object] = json.loads(report.read_text())
        return line
    finally:
        await sup.abort()


async def test_the_agent_starts_its_workers_with_expandable_segments(
    probe_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    seen = await _started_by_agent(tmp_path / "a")
    assert seen["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    probe_env.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    seen = await _started_by_agent(tmp_path / "b")
    assert seen["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"  # the user's wins


def test_launch_local_starts_its_ranks_with_expandable_segments(
    probe_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    run = launch_local(PLAN, 1, tmp_path, module="tests.integration.env_probe", deadline_s=60)
    assert run.ok, run.stderr
    assert run.progress[0][0]["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    probe_env.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:False")
    run = launch_local(PLAN, 1, tmp_path / "own", module="tests.integration.env_probe")
    assert run.ok, run.stderr
    assert run.progress[0][0]["PYTORCH_CUDA_ALLOC_CONF"] is None  # the user's config, whole
