"""Shared test fixtures: where the reference data of the original artifact lives; which
tests ``make test`` runs.

Tests marked ``long`` (CPU host-sharing scaffolding, further random crash points, layouts
that another test already covers) are deselected unless ``SAILOR_LONG=1`` (what ``make
long-test`` sets), so that ``make test`` stays inside its time budget.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

_LONG = os.environ.get("SAILOR_LONG") == "1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
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
