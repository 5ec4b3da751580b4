"""``sailor demo`` end to end, as a user runs it: a subprocess, real servers, real workers.

The JSON run must show the three injected changes (preemption notice, node lost, node
joined) each resumed, every committed step's loss equal to the uninterrupted reference, the
PNG written, and no process left behind. The interrupted runs (SIGINT as Ctrl-C, SIGTERM)
must end every process they started, workers of the agents included. "Left behind" is found
without psutil: every descendant inherits an environment variable unique to the test, and
``/proc/*/environ`` is scanned for it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from sailor.cli.demo.processes import marked_pids
from sailor.cli.demo.report import LOSS_ATOL, LOSS_RTOL
from sailor.cli.demo.run import KEPT_RUN_DIR

_TEST_ENV = "SAILOR_DEMO_TEST_TOKEN"
_FAST = ("--steps", "15", "--timeout-s", "60")
"""15 steps between changes: ~55 steps in all (those after the lost node's commit are redone),
where the uninterrupted run's last ten at lr 1e-3 average 5.5 (10 steps: ~37 in all, 5.7,
too near the check's ln 512 - 0.5 = 5.74). Unpaced under quotas: ~1 s more than 10."""


def _demo(tmp: Path, token: str, *args: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, _TEST_ENV: token, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "sailor.cli.main", "demo", "--out", str(tmp / "out"), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        start_new_session=True,  # a test failure must not leave the demo to the terminal
    )


def _left(token: str) -> list[int]:
    end = time.monotonic() + 3.0
    left = marked_pids(token, _TEST_ENV)
    while left and time.monotonic() < end:  # exits race with the scan for a moment
        time.sleep(0.1)
        left = marked_pids(token, _TEST_ENV)
    return left


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _kill_leftovers(token: str) -> None:
    for pid in marked_pids(token, _TEST_ENV):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _kept_run_dir(stderr: str) -> Path | None:
    """The run directory ``--keep --json`` named on stderr (None if it named none)."""
    found = [ln[len(KEPT_RUN_DIR) :] for ln in stderr.splitlines() if ln.startswith(KEPT_RUN_DIR)]
    return Path(found[-1]) if found else None


def _log_tails(run_dir: Path | None, lines: int = 40, width: int = 400) -> str:
    """The last ``lines`` lines of the controller's and every agent's log (and the
    servers'), each cut to ``width`` characters: what a failed run leaves to diagnose it."""
    if run_dir is None:
        return "no run directory was named on stderr"
    logs = sorted((run_dir / "logs").glob("*.log"), key=lambda p: (p.stem in ("etcd", "nats"), p))
    parts = [f"run directory kept: {run_dir}"]
    for log in logs:
        try:
            tail = log.read_text(errors="replace").splitlines()[-lines:]
        except OSError as exc:
            tail = [f"unreadable: {exc}"]
        parts.append(f"----- {log.name} (last {len(tail)} lines)")
        parts.extend(ln[:width] for ln in tail)
    return "\n".join(parts)


def test_demo_json_end_to_end(tmp_path: Path) -> None:
    """Run with ``--keep``: on a failure the logs' tails are printed (pytest shows a failed
    test's output) and the run directory stays; on success it is removed."""
    token = uuid.uuid4().hex
    proc = _demo(tmp_path, token, "--json", "--keep", *_FAST)
    try:
        out, err = proc.communicate(timeout=300)  # ~50 s alone; make test runs 2 at once
    finally:
        proc.kill()
        left = _left(token)
        _kill_leftovers(token)
    run_dir = _kept_run_dir(err.decode(errors="replace"))
    try:
        _check_end_to_end(proc.returncode, out, err, left)
        assert run_dir is not None and (run_dir / "logs").is_dir(), err.decode()[-3000:]
    except BaseException:
        print(_log_tails(run_dir))
        raise
    shutil.rmtree(run_dir, ignore_errors=True)


def _check_end_to_end(returncode: int, out: bytes, err: bytes, left: list[int]) -> None:
    assert returncode == 0, err.decode()[-3000:]
    assert not left, [_cmdline(p) for p in left]
    summ = json.loads(out)["cluster"]
    causes = [r["cause"] for r in summ["reconfigurations"]]
    assert causes == ["start", "preemption notice", "node lost", "node joined"]
    assert all(r["resumed"] for r in summ["reconfigurations"]), summ["reconfigurations"]
    # in place every time: the workers survived each change (docs/runtime.md)
    assert [r["path"] for r in summ["reconfigurations"][1:]] == ["in_place"] * 3, [
        (r["path"], r["path_reason"]) for r in summ["reconfigurations"]
    ]
    lost = summ["reconfigurations"][2]
    assert lost["phases_s"].get("teardown") is not None  # an abort, not a checkpoint
    # a notice and a join checkpoint first, so no step is retrained
    assert summ["reconfigurations"][1]["redone_steps"] == 0
    losses = summ["losses"]
    tol = losses["tolerance"]
    assert LOSS_ATOL <= tol <= 1e-4, tol  # fp32 rounding, measured: not a loose bound
    assert losses["ok"] and losses["max_abs_diff"] <= tol + LOSS_RTOL * 7.0  # losses < 7
    committed = [c["step"] for c in losses["committed"]]
    assert len(committed) >= 2  # the notice's and the join's checkpoints
    assert all(c["abs_diff"] <= tol + LOSS_RTOL * c["reference"] for c in losses["committed"])
    _check_heterogeneous_layouts(summ, err.decode())
    # a GPT-2 on the Python docs: the loss falls well below the uniform guess ln(512)
    assert losses["last_mean"] < losses["first_mean"] - 0.3, losses
    assert losses["last_mean"] < losses["uniform"] - 0.5, losses
    assert summ["audit_ok"] and summ["leftover_processes"] == []
    png = Path(summ["png"])
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _work(shape: dict[str, Any], kind: str) -> int:
    """The most layer-samples one stage of ``kind`` computes per step in a layout."""
    return max(
        (
            n * p["samples"]
            for p in shape["pipelines"]
            for k, n in zip(p["kinds"], p["layers"], strict=True)
            if k == kind
        ),
        default=0,
    )


def _check_heterogeneous_layouts(summ: dict[str, Any], stderr: str) -> None:
    """Two kinds, planned apart: the slow kind gets less work wherever it runs beside the full
    one, the layouts change shape with membership, and each has its predicted and measured
    step side by side."""
    kinds = summ["node_kinds"]
    assert {n: v["kind"] for n, v in kinds["nodes"].items()} == {
        "n1": "cpu-full",
        "n2": "cpu-slow",
        "n3": "cpu-full",
        "n4": "cpu-slow",
    }
    if kinds["quota"]["available"]:  # unpaced, so that the quotas bind
        assert kinds["min_step_s"] == 0.0
    else:  # said clearly, and run unthrottled (paced)
        assert "CPU quotas unavailable" in stderr and kinds["min_step_s"] > 0
    rows = summ["layouts"]
    # every generation's layout is in its launch record (a slow start may launch on the
    # first nodes to register, then on all: five generations)
    gens = [g["generation"] for g in rows]
    assert gens == sorted(gens) and len(gens) >= 4, gens
    mixed = [g for g in rows if len(g["shape"]["kinds"]) == 2]
    # {full, slow, full}, {slow, full}, {full, slow}: the first planned from the prior alone
    assert len(mixed) >= 3, [g["layout"] for g in rows]
    for g in mixed:
        shape = g["shape"]
        assert shape["uneven"], g["layout"]
        assert 0 < _work(shape, "cpu-slow") < _work(shape, "cpu-full"), g["layout"]
    # the shape changes with membership: a pipeline beside a replica, replicas of 8 and 4
    # samples, one node (kinds and node names aside)
    shapes = {
        tuple((tuple(p["layers"]), p["mbs"], p["microbatches"]) for p in g["shape"]["pipelines"])
        for g in rows
    }
    assert len(shapes) >= 3, shapes
    # predicted beside measured, per layout: a unit slip is 1000x. The layouts' median ratio
    # within 20x; each within 100x: a 2-core machine shared with other jobs slows a layout's
    # quota-throttled workers by more than the rest (measured in CI: one layout 23x, from the
    # prior, under the load of the whole suite)
    assert all(g["predicted_step_s"] for g in rows)
    both = [g for g in rows if g["measured_step_s"] is not None]
    assert len(both) >= 4, rows
    ratios = []
    for g in both:
        ratio = g["predicted_step_s"] / g["measured_step_s"]
        assert g["prediction_error"] == pytest.approx(ratio - 1.0)
        assert 0.01 < ratio < 100.0, g
        ratios.append(ratio)
    assert 0.05 < statistics.median(ratios) < 20.0, ratios


@pytest.mark.parametrize(
    "sig", [signal.SIGINT, pytest.param(signal.SIGTERM, marks=pytest.mark.long)]
)
def test_demo_interrupted_leaves_no_process(tmp_path: Path, sig: signal.Signals) -> None:
    token = uuid.uuid4().hex
    proc = _demo(tmp_path, token, "--json", *_FAST)
    try:
        end = time.monotonic() + 90
        # interrupt once real workers run: the hardest moment (agents' own sessions, gloo)
        while not any(
            "sailor.training_process" in _cmdline(p) for p in marked_pids(token, _TEST_ENV)
        ):
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:] if proc.stderr else ""
            assert time.monotonic() < end, "no worker started"
            time.sleep(0.2)
        os.kill(proc.pid, sig)
        _out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        left = _left(token)
        _kill_leftovers(token)
    assert proc.returncode == 128 + sig, err.decode()[-3000:]
    assert not left, [_cmdline(p) for p in left]
    run_dirs = [ln for ln in err.decode().splitlines() if "sailor-demo-" in ln]
    assert not run_dirs or all(not Path(p).exists() for p in run_dirs)
