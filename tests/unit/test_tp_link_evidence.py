"""The TP link efficiency a measured TP profile implies (``profiler.tp_link_evidence``)."""

from __future__ import annotations

import statistics

import pytest

from sailor import catalog
from sailor.profiler.tp_link_evidence import implied_tp_link_efficiency
from sailor.schemas import LayerProfile, ProfileDB
from sailor.schemas.profile import VOCAB_SPLIT_META
from sailor.simulator.estimate_profile import estimate_layer_timing
from sailor.simulator.tp_comm import layer_comm_s, tp_link
from tests.reference_opt350 import REF

MODEL = catalog.model("OPT-350")
SPECS = catalog.gpus()


def _db(gpu: str, eta: float, grid: list[tuple[int, int]]) -> ProfileDB:
    """Profiles whose compute is the roofline's, with the TP all-reduces over the spec
    sheet's link at ``eta`` inside."""
    out: list[LayerProfile] = []
    for tp, b in grid:
        link = tp_link(None, SPECS, gpu, tp, eta)
        for layer in range(MODEL.num_all_layers):
            r = estimate_layer_timing(MODEL, SPECS[gpu], tp, b, layer)
            cf, cb = layer_comm_s(MODEL, tp, b, layer, link, True)
            out.append(
                r.model_copy(
                    update={"fwd_s": r.fwd_s + cf, "bwd_s": r.bwd_s + cb, "source": "measured"}
                )
            )
    meta = {f"{gpu}.tp{tp}.{VOCAB_SPLIT_META}": "true" for tp, _ in grid if tp > 1}
    return ProfileDB(model=MODEL.name, timings=tuple(out), meta=meta)


@pytest.mark.parametrize(("gpu", "eta"), [("L4", 0.05), ("A100-40", 0.4)])
def test_the_efficiency_the_profiles_were_made_with_is_read_back(gpu: str, eta: float) -> None:
    """Every TP > 1 point with a TP-1 profile at the same work per GPU reads back the
    efficiency its all-reduces were priced at; a point without one gives no row."""
    grid = [(1, 1), (1, 2), (2, 2), (2, 4), (4, 4), (4, 2)]
    rows = implied_tp_link_efficiency(_db(gpu, eta, grid), MODEL, SPECS)
    assert [(r.tp, r.mbs) for r in rows] == [(2, 2), (2, 4), (4, 4)]
    for r in rows:
        assert r.link == SPECS[gpu].intra_node_link
        assert r.efficiency == pytest.approx(eta, rel=1e-9)


def test_a_tp_degree_faster_than_its_compute_gives_no_figure() -> None:
    db = _db("A100-40", 0.4, [(1, 1), (2, 2)])
    fast = tuple(
        t.model_copy(update={"fwd_s": t.fwd_s / 4, "bwd_s": t.bwd_s / 4}) if t.tp == 2 else t
        for t in db.timings
    )
    (row,) = implied_tp_link_efficiency(db.model_copy(update={"timings": fast}), MODEL, SPECS)
    assert row.measured_s < row.compute_s and row.efficiency is None


@pytest.mark.skipif(
    not (REF / "profiles").exists(), reason=f"needs the reference profiles at {REF}"
)
def test_the_catalog_prior_is_what_the_reference_profiles_say() -> None:
    """The catalog's TP link ranges follow from the evidence (benchmarks/tp_link_evidence.py):
    low = the least implied efficiency, median = the points' median, high = the lesser of the
    most and the 0.83 an intra-node all-reduce curve peaks at; per link kind, over the four
    reference models. A change of the data or of the computation shows here."""
    from sailor.importers.sailor_format import import_profiles
    from sailor.schemas.calibration import pcie_link

    es: dict[bool, list[float]] = {True: [], False: []}
    for name in ("OPT-350", "GPT-Neo-2.7", "OPT-30", "LLAMA-3-8"):
        db = import_profiles(
            REF / "profiles" / "profiles_tmp.json", REF / "profiles" / "llm_info.json", name
        )
        for r in implied_tp_link_efficiency(db, catalog.model(name), SPECS):
            if r.efficiency is not None:
                es[pcie_link(r.link)].append(r.efficiency)
    prior = catalog.calibration().prior
    assert prior is not None
    for pcie, rng in ((False, prior.tp_link_efficiency), (True, prior.tp_link_efficiency_pcie)):
        assert rng is not None
        high = min(max(es[pcie]), 0.83)
        assert rng.low == pytest.approx(min(es[pcie]), abs=0.002)
        assert rng.median == pytest.approx(statistics.median(es[pcie]), abs=0.005)
        assert rng.high == pytest.approx(high, abs=0.005)
