"""A link of other VM shapes stands in for an unprofiled one only after a link of the same
shapes elsewhere, and always as a guess: a node's NICs go with its shape."""

from __future__ import annotations

from sailor.schemas import BandwidthCurve, Endpoint, Link, NetworkProfile, ReplicaGroup
from sailor.simulator.network_model import guessed_link, inter_curve


def _link(za: str, zb: str, gbps: float, gpu: str = "A100-40", gpus: int = 4) -> Link:
    return Link(
        src=Endpoint(zone=za, gpu_type=gpu, gpus_per_node=gpus),
        dst=Endpoint(zone=zb, gpu_type=gpu, gpus_per_node=gpus),
        curve=BandwidthCurve(coeffs=(0.0, 0.0, gbps), max_gbps=gbps),
    )


def _rg(zone: str, gpu: str = "A100-40", gpus: int = 4) -> ReplicaGroup:
    return ReplicaGroup(gpu_type=gpu, zone=zone, tp=1, gpus_per_node=gpus)


ZA, ZB = "us-central1-a", "us-central1-b"


def test_another_shape_in_the_zone_is_a_flagged_guess_naming_the_shape() -> None:
    net = NetworkProfile(links=(_link(ZA, ZA, 0.3, gpu="T4", gpus=1),))
    curve, note = inter_curve(net, _rg(ZA, "H100-80", 8), _rg(ZA, "H100-80", 8))
    assert curve.max_gbps == 0.3  # the slowest measured between these zones, as before...
    assert guessed_link(note)  # ... but now the estimate says it rests on a guess
    assert "other VM shapes" in note and "T4x1 -> T4x1" in note


def test_a_sibling_zone_of_the_same_shape_comes_before_another_shape_in_the_zone() -> None:
    # one-GPU VMs measured in ZA, four-GPU VMs in ZB: a four-GPU pair in ZA has NICs like
    # ZB's, not like the one-GPU VMs'
    net = NetworkProfile(links=(_link(ZA, ZA, 2.4, gpus=1), _link(ZB, ZB, 6.0)))
    curve, note = inter_curve(net, _rg(ZA), _rg(ZA))
    assert curve.max_gbps == 6.0
    assert "these VM shapes" in note and "inside another zone of us-central1" in note
    assert guessed_link(note)


def test_a_zone_agnostic_curve_of_the_shapes_comes_before_another_shape() -> None:
    net = NetworkProfile(links=(_link(ZA, ZA, 0.3, gpu="T4", gpus=1), _link("*", "*", 5.0)))
    curve, note = inter_curve(net, _rg(ZA), _rg(ZA))
    assert curve.max_gbps == 5.0
    assert "zone-agnostic" in note and not guessed_link(note)  # measured for these shapes
    # it applies inside one zone only: between zones the other shape's curve is the guess
    net2 = net.model_copy(update={"links": (*net.links, _link(ZA, ZB, 0.2, gpu="T4", gpus=1))})
    curve, note = inter_curve(net2, _rg(ZA), _rg(ZB))
    assert curve.max_gbps == 0.2 and guessed_link(note)


def test_an_exact_link_either_way_round_is_measured() -> None:
    net = NetworkProfile(
        links=(
            Link(
                src=Endpoint(zone=ZA, gpu_type="A100-40", gpus_per_node=4),
                dst=Endpoint(zone=ZB, gpu_type="V100-16", gpus_per_node=4),
                curve=BandwidthCurve(coeffs=(0.0, 0.0, 3.0), max_gbps=3.0),
            ),
        )
    )
    for a, b in ((_rg(ZA), _rg(ZB, "V100-16")), (_rg(ZB, "V100-16"), _rg(ZA))):
        curve, note = inter_curve(net, a, b)
        assert curve.max_gbps == 3.0 and note == ""
