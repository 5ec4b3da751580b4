"""Import the original artifact's network fits and egress prices.

Network files hold ``[[c0, c1, c2], max_bytes_per_s]`` per endpoint pair, with bandwidth in
GB/s = c0·L² + c1·L + c2, L = log2(bytes / 1e6). The artifact probed 1 MB … 1 GB messages, so
the imported curves are clamped to that range (L in [0, 10]). A curve that is <= 0 GB/s
somewhere in that range is refused, naming the entry and the message sizes where it dips: the
files hold no probe points to refit it from (as ``profiler.curve_fit`` does for our own
probes), and the evaluation's 1 MB/s floor would price those transfers far too slow.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sailor.importers._read import ImportFormatError, as_float, as_int, load_json
from sailor.schemas import BandwidthCurve, EgressPrice, Endpoint, Link, NetworkProfile, PriceTable

__all__ = [
    "import_egress",
    "import_network",
    "parse_curve",
]

_PROBED_MIN_BYTES = 1_000_000
_PROBED_MAX_BYTES = 1_024_000_000


def parse_curve(v: Any, file: str | Path, field: str) -> BandwidthCurve:
    if not isinstance(v, list) or len(v) != 2 or not isinstance(v[0], list) or len(v[0]) != 3:
        raise ImportFormatError(file, field, f"expected [[c0, c1, c2], max_bytes_per_s], got {v!r}")
    c = tuple(as_float(x, file, f"{field}[0]") for x in v[0])
    mx = as_float(v[1], file, f"{field}[1]", min_value=0)
    if mx <= 0:
        raise ImportFormatError(file, f"{field}[1]", f"max bandwidth must be > 0, got {v[1]!r}")
    curve = BandwidthCurve(
        coeffs=(c[0], c[1], c[2]),
        max_gbps=mx / 1e9,
        min_bytes=_PROBED_MIN_BYTES,
        max_bytes=_PROBED_MAX_BYTES,
    )
    dips = curve.nonpositive_ranges()
    if dips:
        # only the coefficients are stored, not the probe points a refit would need: a curve
        # at or below zero inside its measured range (floored at 1 MB/s when evaluated) would
        # price those transfers hundreds of times too slow, so it is refused
        where = ", ".join(f"{a:,}..{b:,}" for a, b in dips)
        raise ImportFormatError(
            file,
            f"{field}[0]",
            f"the curve {list(c)} is <= 0 GB/s for messages of {where} bytes, inside the "
            f"measured range {_PROBED_MIN_BYTES:,}..{_PROBED_MAX_BYTES:,}",
        )
    return curve


def import_network(
    multizone_json: str | Path, intra_node_json: str | Path | None = None
) -> NetworkProfile:
    """``multizone_bandwidths*.json`` (+ optional ``intra_node_bandwidths.json``)."""
    data = load_json(multizone_json)
    if not isinstance(data, dict):
        raise ImportFormatError(multizone_json, "<root>", "expected an object keyed by zone")
    links: list[Link] = []
    for z1, by_gpu in data.items():
        for g1, by_n in _obj(by_gpu, multizone_json, z1).items():
            for n1, by_z2 in _obj(by_n, multizone_json, f"{z1}.{g1}").items():
                k1 = as_int(n1, multizone_json, f"{z1}.{g1}.<gpus_per_node>", min_value=1)
                for z2, by_g2 in _obj(by_z2, multizone_json, f"{z1}.{g1}.{n1}").items():
                    for g2, by_n2 in _obj(by_g2, multizone_json, f"{z1}.{g1}.{n1}.{z2}").items():
                        base = f"{z1}.{g1}.{n1}.{z2}.{g2}"
                        for n2, v in _obj(by_n2, multizone_json, base).items():
                            k2 = as_int(n2, multizone_json, f"{base}.<gpus_per_node>", min_value=1)
                            links.append(
                                Link(
                                    src=Endpoint(zone=z1, gpu_type=g1, gpus_per_node=k1),
                                    dst=Endpoint(zone=z2, gpu_type=g2, gpus_per_node=k2),
                                    curve=parse_curve(v, multizone_json, f"{base}.{n2}"),
                                )
                            )
    intra: list[Link] = []
    if intra_node_json is not None:
        idata = load_json(intra_node_json)
        for g, by_n in _obj(idata, intra_node_json, "<root>").items():
            for n, v in _obj(by_n, intra_node_json, g).items():
                k = as_int(n, intra_node_json, f"{g}.<gpus>", min_value=1)
                ep = Endpoint(zone="*", gpu_type=g, gpus_per_node=k)
                intra.append(
                    Link(src=ep, dst=ep, curve=parse_curve(v, intra_node_json, f"{g}.{n}"))
                )
    return NetworkProfile(
        links=tuple(links),
        intra_node=tuple(intra),
        source=f"imported from {Path(multizone_json).name}",
    )


def import_egress(communication_cost_json: str | Path) -> PriceTable:
    """``communication_cost.json``: ``{src_zone: {dst_zone: usd_per_gb}}``."""
    data = load_json(communication_cost_json)
    egress: list[EgressPrice] = []
    for src, by_dst in _obj(data, communication_cost_json, "<root>").items():
        for dst, v in _obj(by_dst, communication_cost_json, src).items():
            price = as_float(v, communication_cost_json, f"{src}.{dst}", min_value=0)
            if src != dst:
                egress.append(EgressPrice(src=src, dst=dst, usd_per_gb=price))
    return PriceTable(
        egress=tuple(egress), source=f"imported from {Path(communication_cost_json).name}"
    )


def _obj(d: Any, file: str | Path, field: str) -> dict[str, Any]:
    if not isinstance(d, dict):
        raise ImportFormatError(file, field, f"expected an object, got {type(d).__name__}")
    return {str(k): v for k, v in d.items()}
