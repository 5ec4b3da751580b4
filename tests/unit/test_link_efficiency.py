"""Efficiencies taken on the link at hand: read on links of one peak, a throughput of the
framework's own in series with the link (``schemas.calibration.eta_on``).

Before, an efficiency read on GH200's 92.55 GB/s node links (0.2 for the gradient
all-reduces, 0.116 for pipeline transfers), or the prior's median 0.44 between that and the
probe, derated every link by the same factor: a 1 Gb/s link between consumer GPU nodes was
priced at 44 % of its probed bandwidth, so a pipeline across it was over-predicted by
~40 % against a model that takes the probe as it is.
"""

from __future__ import annotations

import pytest

from sailor import catalog
from sailor.schemas import (
    BandwidthCurve,
    Endpoint,
    Link,
    NetworkProfile,
    Pipeline,
    Plan,
    ProfileDB,
    ReplicaGroup,
    Stage,
)
from sailor.schemas.calibration import LinkEta, eta_on
from sailor.simulator import simulate
from sailor.simulator.network_model import ring_allreduce
from sailor.simulator.uncertainty import corners

GH = 92.5519010439898  # the catalog's GH-96 node link peak, GB/s


def test_on_the_links_it_was_read_on_an_efficiency_is_as_read_bit_for_bit() -> None:
    for eta in (0.116, 0.2, 0.44, 1.0):
        assert eta_on(eta, GH, GH) == eta
        assert eta_on(eta, None, 0.1) == eta  # no link recorded: every link as read


@pytest.mark.parametrize("eta", [0.05, 0.19, 0.44, 0.9])
def test_the_shortfall_is_a_throughput_in_series_with_the_link(eta: float) -> None:
    """bytes / (η_B · B) == bytes / B + bytes / R, R = ref·η/(1−η), on any link B."""
    ref = 10.0
    cap = ref * eta / (1 - eta)
    for b in (0.1, 1.0, 10.0, 100.0):
        assert 1 / (eta_on(eta, ref, b) * b) == pytest.approx(1 / b + 1 / cap, rel=1e-12)
    # slower links keep more of their bandwidth, faster ones less; 1 stays 1
    assert eta_on(eta, ref, 0.1) > eta > eta_on(eta, ref, 100.0)
    assert eta_on(1.0, ref, 0.1) == eta_on(1.0, ref, 1e4) == 1.0


def test_a_link_eta_is_the_least_of_its_types_on_the_link() -> None:
    both = LinkEta(((0.2, GH), (0.5, None)))
    assert both.on(GH) == 0.2
    assert both.on(0.115) == 0.5  # the GH-read 0.2 is ~0.995 there: the other type's 0.5
    assert hash(both) == hash(LinkEta(((0.2, GH), (0.5, None))))


def test_the_prior_is_read_on_gh200_links_and_taken_on_a_slow_link() -> None:
    """The catalog's medians and low ends, read on GH200 node links, keep most of a slow
    link's bandwidth, and are unchanged on a GH200 link (every corner but the original,
    which takes the probe as it is everywhere)."""
    cal = catalog.calibration()
    assert cal.prior is not None and cal.prior.efficiency_link_gbps == GH
    for name, c in corners(cal):
        d = c.for_gpu("RTX-3090")  # no measurements: the prior
        assert c.p2p_link("RTX-3090")[0].on(GH) == d.p2p_eta, name
        assert c.network_link_eta("RTX-3090").on(GH) == d.network_efficiency, name
        assert c.p2p_link("RTX-3090")[0].on(0.115) > 0.99, name  # a 1 Gb/s link
        assert c.network_link_eta("RTX-3090").on(0.115) > 0.99, name
    low = dict(corners(cal))["pessimistic"]
    assert low.network_link_eta("A100-40").on(6.04) == pytest.approx(0.78, abs=0.01)
    # a calibrated type records the links it was read on
    assert cal.for_gpu("GH-96").efficiency_link_gbps == GH


def _curve(gbps: float) -> BandwidthCurve:
    return BandwidthCurve(coeffs=(0.0, 0.0, gbps), max_gbps=gbps)


def test_a_ring_step_takes_the_efficiency_on_its_link() -> None:
    ep = Endpoint(zone="z", gpu_type="G", gpus_per_node=1)
    groups = [ReplicaGroup(gpu_type="G", zone="z", tp=1, gpus_per_node=1)] * 4
    for gbps in (0.125, GH):
        net = NetworkProfile(links=(Link(src=ep, dst=ep, curve=_curve(gbps)),))
        as_read = ring_allreduce(net, groups, 1e9, 2.5e8, LinkEta.as_read(0.2)).time_s
        on_link = ring_allreduce(net, groups, 1e9, 2.5e8, LinkEta(((0.2, GH),))).time_s
        at_one = ring_allreduce(net, groups, 1e9, 2.5e8, LinkEta.as_read(1.0)).time_s
        if gbps == GH:
            assert on_link == as_read
        else:  # the bytes at the link's rate plus the framework's throughput (R ~ 23 GB/s)
            assert at_one < on_link < 1.01 * at_one < as_read


def test_a_pipeline_across_a_slow_link_costs_its_bytes_at_the_link_rate() -> None:
    """A two-stage OPT-350 pipeline over a 1 Gb/s link between two GPU types without
    measurements (analytic profiles): in the median corner its transfers cost what the probe
    says plus the fixed cost per transfer, not 1/0.44 of the probe's time."""
    model = catalog.model("OPT-350")
    a = ReplicaGroup(gpu_type="RTX-3090", zone="z", tp=1, gpus_per_node=8)
    b = ReplicaGroup(gpu_type="Titan-RTX", zone="z", tp=1, gpus_per_node=8)
    links = []
    for x in (a, b):
        for y in (a, b):
            src = Endpoint(zone="z", gpu_type=x.gpu_type, gpus_per_node=8)
            dst = Endpoint(zone="z", gpu_type=y.gpu_type, gpus_per_node=8)
            links.append(Link(src=src, dst=dst, curve=_curve(0.115)))
    net = NetworkProfile(links=tuple(links))
    stages = (
        Stage(first_layer=0, last_layer=12, replica=a),
        Stage(first_layer=13, last_layer=25, replica=b),
    )
    pipe = Pipeline(stages=stages, microbatch_size=1, num_microbatches=8)
    plan = Plan(model=model.name, global_batch_size=8, pipelines=(pipe,))
    cs = dict(corners(catalog.calibration()))
    p2p = {}
    for name in ("optimistic", "median"):
        e = simulate(
            plan,
            model,
            ProfileDB(model=model.name),
            net,
            catalog.prices(),
            calibration=cs[name],
            gpu_specs=catalog.gpus(),
        )
        p2p[name] = e.time.p2p_s
    fixed = cs["median"].for_gpu("RTX-3090").p2p_fixed_s
    # 8 microbatches, both directions: at most 16 transfers' fixed cost on the critical path
    assert 0 < p2p["optimistic"] < p2p["median"] <= 1.01 * p2p["optimistic"] + 16 * fixed
