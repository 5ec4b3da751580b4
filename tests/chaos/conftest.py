"""The chaos suite: which scenarios run, and the table ``make chaos`` prints.

Every scenario is marked ``chaos``. The long ones are also ``chaos_long`` and are deselected
unless ``SAILOR_CHAOS=all`` (what ``make chaos`` sets), so that ``make test`` runs only the
CI subset inside its time budget. Each run appends its :class:`~tests.chaos.harness.Outcome`
to the file named by ``SAILOR_CHAOS_TABLE`` (a temporary one by default); the table is
printed at the end of the session.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest

from tests.chaos.harness import TABLE_ENV

# the secure servers and the task-leak guard of the integration tests (the fuzz tests)
# (``servers`` stands on ``_secure_pair``: both are needed here)
from tests.integration.conftest import _secure_pair, no_task_leak, servers  # noqa: F401

_ALL = os.environ.get("SAILOR_CHAOS") == "all"


_OWN_TABLE: list[str] = []


def pytest_configure(config: pytest.Config) -> None:
    if not os.environ.get(TABLE_ENV):
        fd, path = tempfile.mkstemp(prefix="sailor-chaos-", suffix=".jsonl")
        os.close(fd)
        os.environ[TABLE_ENV] = path
        _OWN_TABLE.append(path)


def pytest_unconfigure(config: pytest.Config) -> None:
    for path in _OWN_TABLE:  # ours only: a table file make chaos named is left to it
        Path(path).unlink(missing_ok=True)
        os.environ.pop(TABLE_ENV, None)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _ALL:
        return
    # Deselected, not skipped: nothing is missing from this machine, the CI subset is a choice.
    keep = [item for item in items if "chaos_long" not in item.keywords]
    if len(keep) < len(items):
        config.hook.pytest_deselected(items=[i for i in items if i not in keep])
        items[:] = keep


def _fmt_downtime(values: list[float]) -> str:
    return ", ".join(f"{v:.1f}" for v in values) if values else "-"


def pytest_terminal_summary(terminalreporter) -> None:  # type: ignore[no-untyped-def]
    path = Path(os.environ.get(TABLE_ENV, ""))
    if not path.is_file():
        return
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        return
    tr = terminalreporter
    tr.section("chaos scenarios")
    head = ("scenario", "injected faults", "reconf", "downtime per reconf (s)", "redone",
            "lost", "audit", "losses", "params", "moments", "wall s", "result")  # fmt: skip
    body = [
        (
            r["scenario"],
            "; ".join(r["faults"]),
            str(r["reconfigurations"]),
            _fmt_downtime(r["downtime_s"]),
            str(r["steps_redone"]),
            str(r["steps_lost"]),
            "ok" if r["audit_ok"] else "FAIL",
            f"{r['max_loss_diff']:.1e}",
            f"{r['max_param_diff']:.1e} (floor {r['param_floor']:.1e}) @{r['params_step']}",
            f"{r['max_moment_diff']:.1e} (floor {r['moment_floor']:.1e})",
            f"{r['wall_s']:.0f}",
            "PASS" if r["ok"] else "FAIL",
        )
        for r in rows
    ]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    line = " | ".join(h.ljust(w) for h, w in zip(head, widths, strict=True))
    tr.write_line(line)
    tr.write_line("-+-".join("-" * w for w in widths))
    for b in body:
        tr.write_line(" | ".join(c.ljust(w) for c, w in zip(b, widths, strict=True)))
