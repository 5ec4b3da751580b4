"""The README's shell blocks run as written, in order, from the repository's root.

Each ```sh block is preceded by a marker comment saying what the test does with it:

* ``<!-- readme-test: run -->``: run (all such blocks as one bash script, so that a variable
  set in one block is seen by the next);
* ``<!-- readme-test: needs reference/sailor -->``: run too when the original artifact's files
  are at ``reference/sailor/``, else skipped with that reason;
* ``<!-- readme-test: skip (WHY) -->``: never run; WHY says why (the set-up itself, or a
  running cluster).

A block without a marker fails the test: every command shown to a newcomer is either run here
or excluded with its reason. Needs ``.venv/bin/sailor`` (``make demo`` or ``make test`` makes
it); the commands write only under ``out/``, which git ignores.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
_BLOCK = re.compile(
    r"(?:<!--\s*readme-test:\s*(?P<mark>[^>]*?)\s*-->\s*\n)?```sh\n(?P<body>.*?)```", re.S
)


def readme_blocks(text: str) -> list[tuple[str, str]]:
    """(marker, body) of every ```sh block, in order; marker "" when there is none."""
    return [(m["mark"] or "", m["body"]) for m in _BLOCK.finditer(text)]


def test_every_block_is_marked() -> None:
    blocks = readme_blocks(README.read_text())
    assert len(blocks) >= 4
    for mark, body in blocks:
        assert mark == "run" or mark.startswith(("skip (", "needs ")), body
    assert blocks[0][1].startswith("make demo"), "the two commands stay first"
    marks = [m for m, _ in blocks]
    assert marks.count("run") >= 1


def test_marker_parsing() -> None:
    text = "x\n<!-- readme-test: run -->\n```sh\necho a\n```\n\n```sh\necho b\n```\n"
    assert readme_blocks(text) == [("run", "echo a\n"), ("", "echo b\n")]


@pytest.mark.timeout(1800)
def test_readme_blocks_run_in_order() -> None:
    sailor = ROOT / ".venv" / "bin" / "sailor"
    if not sailor.exists():
        pytest.skip(f"{sailor} is missing: run `make demo` first (the README's order)")
    have_reference = (ROOT / "reference" / "sailor").is_dir()
    script = ["set -euo pipefail", "mkdir -p out"]
    for mark, body in readme_blocks(README.read_text()):
        if mark == "run" or (mark == "needs reference/sailor" and have_reference):
            script.append(body)
    res = subprocess.run(
        ["bash", "-c", "\n".join(script)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1700,
    )
    assert res.returncode == 0, f"{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    assert "Traceback" not in res.stderr
    assert (ROOT / "out" / "plan.json").is_file() and (ROOT / "out" / "t.png").is_file()
    untracked = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=all"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    ).stdout
    assert not any(
        line.startswith("??") and ("profiles" in line or "out/" in line)
        for line in untracked.splitlines()
    ), untracked
