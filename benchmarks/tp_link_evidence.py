"""The evidence behind the catalog prior's TP link efficiencies, from measured TP profiles.

For every GPU type of the reference profiles measured at TP ``t`` > 1 and microbatch ``b``
and at TP 1 with microbatch ``b/t``, prints the fraction of its spec-sheet intra-node link
its TP all-reduces reached (``sailor.profiler.tp_link_evidence``): what the simulator's
``tp_link_efficiency`` (NVLink, any link but PCIe) or ``tp_link_efficiency_pcie`` would
have to be to price that TP degree from the TP-1 profile. Then the range per link kind,
which the catalog's prior takes (low = least, high = the lesser of the most and the 0.83
an intra-node all-reduce curve peaks at, median = the points' median: the geometric midpoint
of the ends would follow one outlier, RTX-3090's TP 8).

Prints the machine and the data. Never asserts. Run:
``python benchmarks/tp_link_evidence.py [--models OPT-350,GPT-Neo-2.7]``.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
from pathlib import Path

from sailor import catalog
from sailor.importers.sailor_format import import_profiles
from sailor.profiler.tp_link_evidence import implied_tp_link_efficiency
from sailor.schemas.calibration import pcie_link

REF = Path(__file__).resolve().parents[1] / ".." / "shared" / "reference" / "sailor"
CURVE_PEAK = 0.83
"""The most an intra-node all-reduce curve of the reference reaches of its spec sheet (249
of NVLink3's 300 GB/s on A100-40s): a ring's ceiling, whatever a profile's noise says."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="OPT-350,GPT-Neo-2.7,OPT-30,LLAMA-3-8")
    args = ap.parse_args()
    print("== TP link efficiency implied by measured TP profiles ==")
    print(f"machine: {platform.node()} {platform.machine()}; python {sys.version.split()[0]}")
    print(f"reference data: {REF.resolve()}")
    specs = catalog.gpus()
    by_kind: dict[str, list[float]] = {"NVLink and other": [], "PCIe": []}
    profiles = REF / "profiles"
    for name in args.models.split(","):
        model = catalog.model(name)
        db = import_profiles(profiles / "profiles_tmp.json", profiles / "llm_info.json", name)
        print(
            f"\n{name}: gpu, link, tp, mbs, measured blocks s, TP-1 compute s, "
            "all-reduces at efficiency 1 s, implied efficiency"
        )
        for r in implied_tp_link_efficiency(db, model, specs):
            e = r.efficiency
            print(
                f"  {r.gpu_type:10} {r.link:28} tp {r.tp} mbs {r.mbs:3}  {r.measured_s:8.4f} "
                f"{r.compute_s:8.4f} {r.spec_comm_s:8.4f}  "
                + (f"{e:.3f}" if e is not None else "none (faster than its TP-1 compute)")
            )
            if e is not None:
                by_kind["PCIe" if pcie_link(r.link) else "NVLink and other"].append(e)
    print("\nper link kind: points, least, most; the prior's range (high capped at the curve peak)")
    for kind, es in by_kind.items():
        if not es:
            continue
        low, high = min(es), min(max(es), CURVE_PEAK)
        print(
            f"  {kind:17} {len(es):3}  {min(es):.3f}  {max(es):.3f}  -> low {low:.3g}, "
            f"median {min(statistics.median(es), high):.3g}, high {high:.3g}"
        )


if __name__ == "__main__":
    main()
