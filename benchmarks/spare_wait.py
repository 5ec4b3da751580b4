"""A waiting worker's directive wait: CPU while idle and hand-over latency, against polling.

A warm spare (and a held rank) waits for its directive in its control file
(``sailor.megatron_patch.in_place.await_directive``). Two ways, measured in the same run, in
this process (torch imported, as in a spare), each ``--reps`` times:

* ``blocking``: ``await_directive`` as it is (``FileWait``: inotify on the file's directory,
  the signal wake-up fd, a recheck every ``RECHECK_S``);
* ``poll``: the loop it replaced, a read of the file every ``--poll-s`` (20 ms, the worker's
  default), reproduced here as the baseline.

Figures: CPU seconds per idle second of the waiting thread's process over ``--idle-s``
(``time.process_time``), and the hand-over latency: from the rename of a directive over the
file (as the agent writes it: from another process, at a random moment) to the wait's return;
median and max. Prints setup and machine load. Never asserts a timing.
Run: ``python benchmarks/spare_wait.py [--reps 20] [--idle-s 3] [--poll-s 0.02]``.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from sailor.megatron_patch.file_wait import RECHECK_S
from sailor.megatron_patch.in_place import await_directive, parse_directive

Wait = Callable[[str, float, float], tuple[int, list[str]] | None]


def _poll(control: str, poll_s: float, timeout_s: float) -> tuple[int, list[str]] | None:
    """The baseline: the wait as it was before ``FileWait``."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            got = parse_directive(Path(control).read_text(), -1)
        except OSError:
            got = None
        if got is not None:
            return got
        time.sleep(poll_s)
    return None


def _blocking(control: str, poll_s: float, timeout_s: float) -> tuple[int, list[str]] | None:
    return await_directive(control, -1, poll_s, timeout_s, lambda: False)


# The agent's side, in a process of its own (as the agent is): after a delay, write a
# directive to a temporary file and rename it over the control file; print the rename's
# CLOCK_MONOTONIC time, which both processes share. (A writer thread in the waiting process
# instead added its GIL hand-over to both ways: medians of 8-13 ms either way.)
_WRITER = """
import json, sys, time
from pathlib import Path
control, delay = Path(sys.argv[1]), float(sys.argv[2])
tmp = control.with_name(control.name + ".tmp")
time.sleep(delay)
tmp.write_text(json.dumps(dict(relayout=dict(generation=0, argv=["--rank", "0"]))))
t = time.monotonic()
tmp.replace(control)
print(t)
"""


def _idle_cpu(wait: Wait, d: Path, poll_s: float, idle_s: float) -> float:
    control = d / "idle.json"
    control.write_text("{}")
    c0, t0 = time.process_time(), time.monotonic()
    wait(str(control), poll_s, idle_s)
    return (time.process_time() - c0) / (time.monotonic() - t0)


def _latency(wait: Wait, d: Path, poll_s: float, rng: random.Random) -> float:
    control = d / "control.json"
    control.write_text("{}")
    delay = f"{rng.uniform(0.1, 0.3):.3f}"
    writer = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(control), delay], stdout=subprocess.PIPE, text=True
    )
    got = wait(str(control), poll_s, 10.0)
    done = time.monotonic()
    out, _ = writer.communicate()
    if got is None:
        raise RuntimeError("no directive within 10 s")
    return done - float(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--idle-s", type=float, default=3.0)
    ap.add_argument("--poll-s", type=float, default=0.02)
    a = ap.parse_args()
    print(
        f"setup: reps={a.reps} idle_s={a.idle_s} poll_s={a.poll_s} recheck_s={RECHECK_S} "
        f"cpus={os.cpu_count()} load_before={os.getloadavg()[0]:.2f}"
    )
    rng = random.Random(0)
    ways: dict[str, Wait] = {"poll": _poll, "blocking": _blocking}
    with tempfile.TemporaryDirectory() as tmp:
        for name, wait in ways.items():
            d = Path(tmp) / name
            d.mkdir()
            cpu = _idle_cpu(wait, d, a.poll_s, a.idle_s)
            lat = [_latency(wait, d, a.poll_s, rng) for _ in range(a.reps)]
            print(
                f"{name:>9}: idle {100 * cpu:.2f} % of a core; hand-over median "
                f"{1000 * statistics.median(lat):.2f} ms, max {1000 * max(lat):.2f} ms"
            )
    print(f"load_after={os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
