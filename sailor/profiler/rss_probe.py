"""Probe: one training rank, unchanged, that also reports its peak RSS growth (memory checks).

``python -m sailor.profiler.rss_probe --rss-out FILE [worker options]`` imports the worker
(torch, torch.distributed, the framework), takes the process's RSS as the baseline, resets
the kernel's peak-RSS counter, runs :func:`sailor.megatron_patch.rank_main.main` unchanged, and
writes ``{"baseline_bytes", "peak_bytes", "growth_bytes"}`` to ``FILE`` (``{rank}`` is
replaced by the rank). The baseline is taken at the same point as in
:mod:`sailor.profiler.overhead`, so the process overhead measured there and the growth
measured here count the same things.

Used as ``launch_local(..., module="sailor.profiler.rss_probe", extra_args=[...])``; the
training framework needs no hook for it. Linux only (``/proc/self``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Run one worker rank and record its RSS growth; returns the worker's exit status."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--rss-out", required=True)
    p.add_argument("--rank", type=int, required=True)
    ours, _ = p.parse_known_args(argv)
    rest = list(sys.argv[1:] if argv is None else argv)
    i = rest.index("--rss-out")
    del rest[i : i + 2]

    from sailor.megatron_patch import rank_main
    from sailor.profiler.memory import peak_rss_bytes, reset_peak_rss, rss_bytes

    base = rss_bytes()
    reset_ok = reset_peak_rss()
    code = rank_main.main(rest)
    peak = peak_rss_bytes()
    out = Path(ours.rss_out.replace("{rank}", str(ours.rank)))
    out.write_text(
        json.dumps(
            {
                "baseline_bytes": base,
                "peak_bytes": peak,
                "growth_bytes": peak - base,
                "peak_reset": reset_ok,
            }
        )
    )
    return code


if __name__ == "__main__":
    sys.exit(main())
