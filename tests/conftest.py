"""Shared test fixtures: where the reference data of the original artifact lives; which
tests ``make test`` runs.

Tests marked ``long`` (CPU host-sharing scaffolding, further random crash points, layouts
that another test already covers) are deselected unless ``SAILOR_LONG=1`` (what ``make
long-test`` sets), so that ``make test`` stays inside its time budget.

The longest files run first (:data:`_FIRST`): ``make test`` hands whole files to two
workers in collection order, and a two-minute file collected last kept one worker busy
while the other had nothing left to do.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

_LONG = os.environ.get("SAILOR_LONG") == "1"


_FIRST = (
    "tests/integration/test_readme.py",
    "tests/chaos/test_chaos_servers.py",
    "tests/chaos/test_chaos_nodes.py",
    "tests/integration/test_checkpoint_resume.py",
    "tests/integration/test_demo.py",
    "tests/integration/test_megatron_patch_training.py",
    "tests/integration/test_profiler_real.py",
    "tests/integration/test_runtime_scenarios.py",
    "tests/integration/test_in_place_worker.py",
)
"""Files of make test by decreasing wall time (the durations of a CI run, 2026-11-27; the two
chaos files were one, test_chaos_faults.py, then)."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = Path(str(config.rootpath))

    def rank(item: pytest.Item) -> int:
        rel = item.path.relative_to(root).as_posix() if item.path.is_relative_to(root) else ""
        return _FIRST.index(rel) if rel in _FIRST else len(_FIRST)

    items.sort(key=rank)  # stable: the order within a file, and of the other files, is kept
    if _LONG:
        return
    # Deselected, not skipped: nothing is missing from this machine, the subset is a choice.
    keep = [item for item in items if "long" not in item.keywords]
    if len(keep) < len(items):
        config.hook.pytest_deselected(items=[i for i in items if i not in keep])
        items[:] = keep


REFERENCE = Path(__file__).resolve().parents[1].parent / "shared" / "reference" / "sailor"


@pytest.fixture(scope="session")
def reference() -> Path:
    if not REFERENCE.is_dir():
        pytest.skip(f"reference data not found at {REFERENCE}")
    return REFERENCE


@pytest.fixture
def gloo_world(tmp_path: Path) -> Iterator[None]:
    """A torch.distributed world of this one process (gloo), for code that needs a default
    process group (the checkpointer, the trainer's groups) without peers."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()
