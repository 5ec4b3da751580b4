"""An unprofiled zone pair takes a curve measured between sibling zones of its regions."""

from __future__ import annotations

from sailor.schemas import BandwidthCurve, Endpoint, Link, NetworkProfile, ReplicaGroup
from sailor.simulator.network_model import (
    FALLBACK_SAME_ZONE_GBPS,
    guessed_link,
    inter_curve,
    sibling_curve,
)


def _curve(gbps: float) -> BandwidthCurve:
    return BandwidthCurve(coeffs=(0.0, 0.0, gbps), max_gbps=gbps)


def _link(za: str, zb: str, gbps: float, gpu: str = "A100-40", gpus: int = 4) -> Link:
    return Link(
        src=Endpoint(zone=za, gpu_type=gpu, gpus_per_node=gpus),
        dst=Endpoint(zone=zb, gpu_type=gpu, gpus_per_node=gpus),
        curve=_curve(gbps),
    )


def _rg(zone: str, gpu: str = "A100-40", gpus: int = 4) -> ReplicaGroup:
    return ReplicaGroup(gpu_type=gpu, zone=zone, tp=1, gpus_per_node=gpus)


NET = NetworkProfile(
    links=(
        _link("us-central1-a", "us-central1-a", 6.0),
        _link("us-central1-c", "us-central1-c", 5.0),
        _link("us-central1-a", "us-central1-c", 4.0),
        _link("us-central1-a", "us-west1-b", 1.0),
        _link("us-central1-c", "us-west1-a", 0.8, gpu="V100-16"),
        _link("europe-west4-a", "europe-west4-a", 0.1, gpu="V100-16", gpus=1),
    )
)


def test_inside_an_unprofiled_zone_the_slowest_sibling_zone_of_the_region() -> None:
    curve, note = inter_curve(NET, _rg("us-central1-b"), _rg("us-central1-b"))
    assert curve.max_gbps == 5.0  # not europe's, not the cross-zone ones
    assert "inside another zone of us-central1" in note and guessed_link(note)


def test_between_two_unprofiled_zones_of_a_region() -> None:
    curve, note = inter_curve(NET, _rg("us-central1-b"), _rg("us-central1-f"))
    assert curve.max_gbps == 4.0
    assert "between two other zones of us-central1" in note


def test_between_regions_only_links_of_the_vm_shapes_stand_in() -> None:
    # the A100 pair has a measured A100 link between these regions: 1.0, not the V100's 0.8
    curve, note = inter_curve(NET, _rg("us-central1-b"), _rg("us-west1-c"))
    assert curve.max_gbps == 1.0 and "between other zones of us-central1 and us-west1" in note
    # an H100 x8 pair has no link of its shape: the flat guess, not another shape's NICs
    h = inter_curve(NET, _rg("us-central1-b", "H100-80", 8), _rg("us-west1-c", "H100-80", 8))
    assert "conservative flat" in h[1]
    # nor a 1-GPU pair inside a zone, beside 4-GPU links (faster NICs) of the region
    one = inter_curve(NET, _rg("us-central1-b", gpus=1), _rg("us-central1-b", gpus=1))
    assert "conservative flat" in one[1]


def test_without_a_sibling_the_flat_guess() -> None:
    curve, note = inter_curve(NET, _rg("asia-east1-a"), _rg("asia-east1-a"))
    assert curve.max_gbps == FALLBACK_SAME_ZONE_GBPS and "conservative flat" in note
    assert (
        sibling_curve(
            NET,
            Endpoint(zone="asia-east1-a", gpu_type="x", gpus_per_node=1),
            Endpoint(zone="asia-east1-b", gpu_type="x", gpus_per_node=1),
        )
        is None
    )


def test_a_measured_link_is_taken_as_it_is() -> None:
    curve, note = inter_curve(NET, _rg("us-central1-a"), _rg("us-central1-c"))
    assert curve.max_gbps == 4.0 and note == ""


def test_an_edge_zone_has_no_siblings_and_is_priced_as_another_region() -> None:
    """An AWS local zone is in its parent region for prices, but in another metro: a link
    between it and an availability zone of the region is not its siblings' (the region's
    fabric), and the flat guess is the one between regions."""
    from sailor.schemas.zones import edge_zone, region_of
    from sailor.simulator.network_model import FALLBACK_INTER_GBPS

    assert region_of("us-west-2-lax-1a") == "us-west-2" and edge_zone("us-west-2-lax-1a")
    assert region_of("us-east-1-wl1-bos-wlz-1") == "us-east-1"
    assert edge_zone("us-east-1-wl1-bos-wlz-1") and not edge_zone("us-west-2a")
    net = NetworkProfile(links=(_link("us-west-2a", "us-west-2b", 3.0),))
    # two availability zones of the region: the sibling pair's curve
    assert inter_curve(net, _rg("us-west-2c"), _rg("us-west-2d"))[0].max_gbps == 3.0
    # a local zone and an availability zone: no sibling, the flat guess between regions
    curve, note = inter_curve(net, _rg("us-west-2-lax-1a"), _rg("us-west-2c"))
    assert curve.max_gbps == FALLBACK_INTER_GBPS and "conservative flat" in note
    # nor does a link to a local zone stand in for two availability zones
    edge = NetworkProfile(links=(_link("us-west-2-lax-1a", "us-west-2b", 0.2),))
    assert "conservative flat" in inter_curve(edge, _rg("us-west-2c"), _rg("us-west-2d"))[1]
